"""Markdown views of an evaluation (the KFP UI's report of the evaluate component): mAP, per-class AP and the
learning check (metrics/diagnostics.py) with its findings."""

from __future__ import annotations


def _number(value, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def evaluation_markdown(title: str, result: dict) -> str:
    """`result`: what `qatpipe.stages.evaluate.evaluate` returns (or metrics.json)."""
    diagnostics = result.get("diagnostics") or {}
    accuracy = diagnostics.get("per_class_accuracy", {})
    rows = [f"| {name} | {v['num_gt']} | {_number(v['ap50'])} | {_number(v['ap'])} | "
            f"{_number(accuracy.get(name), 3)} |" for name, v in result["per_class"].items()]
    lines = [f"# {title}: mAP@0.5 {result['map50']:.4f}, mAP@[.5:.95] {result['map']:.4f}", "",
             "| class | objects | AP@0.5 | AP@[.5:.95] | class accuracy |", "|---|---|---|---|---|", *rows, ""]
    if diagnostics:
        lines += learning_check_markdown(diagnostics)
    return "\n".join(lines)


def learning_check_markdown(diagnostics: dict) -> list[str]:
    """The learning check as Markdown lines: its numbers, the confusion at objects and the findings."""
    confusion = diagnostics["confusion"]
    lines = [
        "## Learning check", "",
        f"Class-agnostic mAP@0.5 {_number(diagnostics['class_agnostic_map50'])} (class-aware "
        f"{_number(diagnostics['map50'])}); {diagnostics['found_objects']} of {diagnostics['num_objects']} objects "
        f"found (IoU >= 0.5); class accuracy at found objects {_number(diagnostics['class_accuracy'], 3)} "
        f"(chance {diagnostics['chance']:.3f}).", "",
        "Rows: an object's class; columns: the class of the best detection overlapping it.", "",
        "| class | " + " | ".join(confusion["columns"]) + " |", "|---" * (len(confusion["columns"]) + 1) + "|",
        *(f"| {name} | " + " | ".join(str(count) for count in counts) + " |"
          for name, counts in zip(confusion["rows"], confusion["matrix"])), "",
    ]
    findings = diagnostics["findings"]
    lines += [f"**Warning:** {finding['message']}" for finding in findings] or ["No findings."]
    return [*lines, ""]


__all__ = ["evaluation_markdown", "learning_check_markdown"]
