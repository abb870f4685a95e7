"""Stage: the FP32 / PTQ / QAT comparison: one table, one chart, one summary.json for the pipeline run."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text, write_json
from qatpipe.html_report import png_page
from qatpipe.stages.evaluate import METRICS_FILE
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
TABLE_FILE = "comparison.md"
CHART_FILE = "comparison.png"
HTML_FILE = "comparison.html"

# column -> (header, format); latency at batch 1, throughput at the largest benchmarked batch
VARIANT_COLUMNS: dict[str, tuple[str, str]] = {
    "map50": ("mAP@0.5", "{:.4f}"),
    "map": ("mAP@[.5:.95]", "{:.4f}"),
    "latency_ms_p50": ("p50 latency (ms)", "{:.2f}"),
    "latency_ms_p99": ("p99 latency (ms)", "{:.2f}"),
    "throughput": ("throughput (img/s)", "{:.1f}"),
    "speedup_vs_fp32": ("speed-up vs FP32", "{:.2f}x"),
    "size_mb": ("size (MB)", "{:.2f}"),
    "params": ("params", "{:,.0f}"),
    "gflops": ("GFLOPs", "{:.3f}"),
}
BENCH_FILE = "bench.json"  # written beside the evaluation by the validate stage (the engine's benchmark)
VALIDATION_FILE = "validation.json"


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QatpipeError(f"{path}: cannot read the {what}: {exc}") from None


def variant_row(evaluation_dir: str | Path) -> dict[str, Any]:
    """One variant's figures from its evaluation (or validation) folder and, when there, its engine benchmark."""
    folder = Path(evaluation_dir)
    metrics = _read_json(folder / METRICS_FILE, "evaluation metrics")
    batches = _read_json(folder / BENCH_FILE, "engine benchmark")["batches"] if (folder / BENCH_FILE).is_file() else []
    single = min(batches, key=lambda row: row["batch_size"], default={})
    largest = max(batches, key=lambda row: row["batch_size"], default={})
    return {
        "map50": metrics["map50"],
        "map": metrics["map"],
        "latency_ms_p50": single.get("latency_ms_p50"),
        "latency_ms_p99": single.get("latency_ms_p99"),
        "throughput": largest.get("throughput"),
        "throughput_batch": largest.get("batch_size"),
        "size_mb": metrics.get("model_size_mb"),
    }


def validation_results(folders: dict[str, str | Path]) -> dict[str, bool]:
    """variant -> whether it passed the gate, for the folders that hold a validation report."""
    return {name: bool(_read_json(Path(folder) / VALIDATION_FILE, "validation report")["passed"])
            for name, folder in folders.items() if (Path(folder) / VALIDATION_FILE).is_file()}


def pruning_block(prune_report: dict, unpruned_evaluation: str | Path | None, fp32_row: dict | None) -> dict:
    """What pruning cost and saved: sizes before/after, and mAP@0.5 of the unpruned model vs the retrained
    FP32 one."""
    block = {key: prune_report[key] for key in ("params_before", "params_after", "flops_before", "flops_after",
                                                 "flops_ratio", "params_ratio")}
    if unpruned_evaluation is not None:
        unpruned = variant_row(unpruned_evaluation)
        block.update(unpruned_map50=unpruned["map50"], unpruned_map=unpruned["map"],
                     unpruned_size_mb=unpruned["size_mb"])
        if fp32_row is not None:
            block["fp32_map50_change"] = round(fp32_row["map50"] - unpruned["map50"], 4)
    return block


def compare_variants(evaluations: dict[str, str | Path], output_dir: str | Path, prune_report: dict | None = None,
                     unpruned_evaluation: str | Path | None = None) -> dict:
    """Summarise the variants' evaluations into output_dir: summary.json, a Markdown table, a chart.
    With the prune report (and the unpruned model's evaluation) the variants get their params and FLOPs
    (all variants are the pruned network) and the summary a `pruning` block."""
    if not evaluations:
        raise QatpipeError("compare: no evaluated variants")
    output_dir = Path(output_dir)
    variants = {name: variant_row(folder) for name, folder in evaluations.items()}
    fp32_throughput = variants.get("fp32", {}).get("throughput")
    for row in variants.values():
        row["speedup_vs_fp32"] = (round(row["throughput"] / fp32_throughput, 3)
                                  if row["throughput"] and fp32_throughput else None)
    summary: dict[str, Any] = {"variants": variants}
    if prune_report is not None:
        for row in variants.values():
            row.update(params=prune_report["params_after"], gflops=round(prune_report["flops_after"] / 1e9, 4))
        summary["pruning"] = pruning_block(prune_report, unpruned_evaluation, variants.get("fp32"))
    validation = validation_results(evaluations)
    if validation:
        summary["validation"] = validation
    # the gate: the QAT model, the deployment candidate, passed its validation (None: not validated)
    summary["gate_passed"] = validation.get("qat")
    write_json(output_dir / SUMMARY_FILE, summary)
    table = format_table(variants, markdown=True)
    if "pruning" in summary:
        table += "\n\n" + pruning_line(summary["pruning"])
    if validation:
        table += "\n\n" + validation_line(validation)
    atomic_write_text(output_dir / TABLE_FILE, "# Variants\n\n" + table + "\n")
    plot_variants(variants, output_dir / CHART_FILE)
    atomic_write_text(output_dir / HTML_FILE, png_page("Variants", output_dir / CHART_FILE, table))
    StageRecord(
        stage="compare", params={"variants": ",".join(variants)},
        metrics={f"{name}.{key}": value for name, row in variants.items() for key, value in row.items()
                 if value is not None},
        artifacts=[SUMMARY_FILE, TABLE_FILE, CHART_FILE],
    ).write(output_dir)
    log.info("variants:\n%s%s%s", format_table(variants),
             "\n" + pruning_line(summary["pruning"]) if "pruning" in summary else "",
             "\n" + validation_line(validation) if validation else "")
    return summary


def validation_line(validation: dict[str, bool]) -> str:
    verdicts = ", ".join(f"{name} {'passed' if ok else 'FAILED'}" for name, ok in validation.items())
    gate = validation.get("qat")
    return f"Validation (validate.max_map_drop): {verdicts}" + (
        "" if gate is None else f"; gate (QAT): {'PASSED' if gate else 'FAILED'}")


def pruning_line(block: dict) -> str:
    text = (f"Pruning: {block['flops_before'] / 1e9:.3f} → {block['flops_after'] / 1e9:.3f} GFLOPs "
            f"(x{block['flops_ratio']:.3f}), {block['params_before']:,} → {block['params_after']:,} params")
    if "unpruned_map50" in block:
        text += f"; unpruned mAP@0.5 {block['unpruned_map50']:.4f}"
        if "fp32_map50_change" in block:
            text += f", retrained FP32 {100 * block['fp32_map50_change']:+.2f} points"
    return text


def format_table(variants: dict[str, dict[str, Any]], markdown: bool = False) -> str:
    headers = ["variant", *(header for header, _ in VARIANT_COLUMNS.values())]
    rows = [[name, *(_fmt(row.get(key), fmt) for key, (_, fmt) in VARIANT_COLUMNS.items())]
            for name, row in variants.items()]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in [headers, *rows])


def plot_variants(variants: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Grouped bars: mAP@0.5 and mAP@[.5:.95] per variant (the accuracy side of the FP32/PTQ/QAT trade)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(variants)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(names), 3.6))
    for offset, key in ((-0.2, "map50"), (0.2, "map")):
        values = [variants[n].get(key) or 0.0 for n in names]
        bars = ax.bar(x + offset, values, width=0.4, label=VARIANT_COLUMNS[key][0])
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("mAP (val)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Variants")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(value: Any, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)
