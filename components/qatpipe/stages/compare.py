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

# column -> (header, format); latency/throughput come from the engine benchmark once that stage exists
VARIANT_COLUMNS: dict[str, tuple[str, str]] = {
    "map50": ("mAP@0.5", "{:.4f}"),
    "map": ("mAP@[.5:.95]", "{:.4f}"),
    "latency_ms_p50": ("p50 latency (ms)", "{:.2f}"),
    "throughput": ("throughput (img/s)", "{:.1f}"),
    "size_mb": ("size (MB)", "{:.2f}"),
    "params": ("params", "{:,.0f}"),
    "gflops": ("GFLOPs", "{:.3f}"),
}


def variant_row(evaluation_dir: str | Path) -> dict[str, Any]:
    """One variant's figures from its evaluate output (and, when present, its engine benchmark)."""
    path = Path(evaluation_dir) / METRICS_FILE
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise QatpipeError(f"{path}: cannot read the evaluation metrics: {exc}") from None
    bench = metrics.get("benchmark", {})
    return {
        "map50": metrics["map50"],
        "map": metrics["map"],
        "latency_ms_p50": bench.get("latency_ms_p50"),
        "throughput": bench.get("throughput"),
        "size_mb": metrics.get("model_size_mb"),
    }


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
    summary: dict[str, Any] = {"variants": variants}
    if prune_report is not None:
        for row in variants.values():
            row.update(params=prune_report["params_after"], gflops=round(prune_report["flops_after"] / 1e9, 4))
        summary["pruning"] = pruning_block(prune_report, unpruned_evaluation, variants.get("fp32"))
    summary["gate_passed"] = None  # the validation gate fills it
    write_json(output_dir / SUMMARY_FILE, summary)
    table = format_table(variants, markdown=True)
    if "pruning" in summary:
        table += "\n\n" + pruning_line(summary["pruning"])
    atomic_write_text(output_dir / TABLE_FILE, "# Variants\n\n" + table + "\n")
    plot_variants(variants, output_dir / CHART_FILE)
    atomic_write_text(output_dir / HTML_FILE, png_page("Variants", output_dir / CHART_FILE, table))
    StageRecord(
        stage="compare", params={"variants": ",".join(variants)},
        metrics={f"{name}.{key}": value for name, row in variants.items() for key, value in row.items()
                 if value is not None},
        artifacts=[SUMMARY_FILE, TABLE_FILE, CHART_FILE],
    ).write(output_dir)
    log.info("variants:\n%s%s", format_table(variants),
             "\n" + pruning_line(summary["pruning"]) if "pruning" in summary else "")
    return summary


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
