"""The comparison of model variants as text (Markdown or aligned columns): the variant table, the pruning and
validation lines, the paired differences with their CIs and the per-class AP table."""

from __future__ import annotations

from typing import Any, Iterable

from qatpipe.metrics.comparisons import verdict

# column -> (header, format); latency at batch 1, throughput at the largest benchmarked batch
VARIANT_COLUMNS: dict[str, tuple[str, str]] = {
    "engine": ("engine", "{}"),  # the backend, device and precision the row's figures were measured with
    "layers": ("compute layers INT8 / FP16 / FP32", "{}"),  # per precision, as the engine's ONNX asks (engine.json)
    "quantized_by": ("INT8 by", "{}"),  # a PTQ model's tool, version and calibration method (ptq.tool)
    "map50": ("mAP@0.5", "{:.4f}"),
    "map50_tensorrt_emulated": ("mAP@0.5, TensorRT's numbers", "{:.4f}"),  # a fast CPU INT8 engine's exact form
    "map50_dla_emulated": ("mAP@0.5, Orin DLA's INT8", "{:.4f}"),  # export.target dla: INT8 on every tensor
    "map": ("mAP@[.5:.95]", "{:.4f}"),
    "latency_ms_p50": ("p50 latency (ms)", "{:.2f}"),
    "latency_ms_p99": ("p99 latency (ms)", "{:.2f}"),
    "throughput": ("throughput (img/s)", "{:.1f}"),
    "speedup_vs_fp32": ("speed-up vs FP32", "{:.2f}x"),
    "cpu_int8": ("CPU int8", "{}"),  # an int8 engine on the CPU: its form, the CPU's int8 support, what that means
    "size_mb": ("size (MB)", "{:.2f}"),
    "params": ("params", "{:,.0f}"),
    "gflops": ("GFLOPs", "{:.3f}"),
}
# shown only when some variant has them
OPTIONAL_COLUMNS = ("engine", "layers", "quantized_by", "map50_tensorrt_emulated", "map50_dla_emulated",
                    "cpu_int8")


def report(summary: dict[str, Any], markdown: bool = False) -> str:
    """The comparison for people: the variant table, the pruning and validation lines, the differences with
    their confidence intervals and the per-class table, whichever the summary holds."""
    parts = [format_table(summary["variants"], markdown)]
    if "pruning" in summary:
        parts.append(pruning_line(summary["pruning"]))
    if summary.get("validation"):
        parts.append(validation_line(summary["validation"]))
    if summary.get("comparisons"):
        parts.append(comparison_table(summary["comparisons"], summary.get("bootstrap"), markdown,
                                      names=summary["variants"]))
    if summary.get("comparisons_tensorrt_emulated"):
        title = "The same in TensorRT's numbers (INT8 in the exact form, FP16 forms as FP16 rounds them)"
        parts.append(comparison_table(summary["comparisons_tensorrt_emulated"], summary.get("bootstrap"), markdown,
                                      title=title, names=summary["variants"]))
    if summary.get("per_class_ap50"):
        parts.append(per_class_table(summary["per_class_ap50"], list(summary["variants"]), markdown))
    return "\n\n".join(parts)


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
    """One row per variant; an mAP with a confidence interval (`map50_ci95_lo`/`_hi`) shows it in brackets."""
    with_ci = any(row.get(f"{key}_ci95_lo") is not None for row in variants.values() for key in VARIANT_COLUMNS)
    columns = {key: column for key, column in VARIANT_COLUMNS.items()
               if key not in OPTIONAL_COLUMNS or any(row.get(key) is not None for row in variants.values())}
    headers = ["variant", *(f"{header} [95% CI]" if with_ci and key in ("map50", "map") else header
                            for key, (header, _) in columns.items())]
    rows = [[name, *(_cell(row, key, fmt) for key, (_, fmt) in columns.items())] for name, row in variants.items()]
    return _render(headers, rows, markdown)


def comparison_table(comparisons: dict[str, dict[str, dict]], bootstrap: dict | None = None,
                     markdown: bool = False, title: str = "Differences", names: Iterable[str] = ()) -> str:
    """The differences of the pairs in mAP points with their 95% CIs and a plain verdict (`names`: the
    variants, verdict's)."""
    how = (f" ({bootstrap['images']} images, {bootstrap['resamples']} resamples, seed {bootstrap['seed']})"
           if bootstrap else "")
    rows = [[pair, VARIANT_COLUMNS[metric][0], f"{100 * e['diff']:+.2f}",
             f"[{100 * e['ci95'][0]:+.2f}, {100 * e['ci95'][1]:+.2f}]", verdict(pair, e["ci95"], names)]
            for pair, metrics in comparisons.items() for metric, e in metrics.items()]
    return _titled(f"{title}, paired bootstrap over the val images{how}:",
                   _render(["pair", "metric", "difference (points)", "95% CI (points)", "verdict"], rows, markdown),
                   markdown)


def per_class_table(per_class: dict[str, dict[str, Any]], variants: list[str], markdown: bool = False) -> str:
    rows = [[cls, str(values["objects"]), *(_fmt(values.get(name), "{:.4f}") for name in variants)]
            for cls, values in per_class.items()]
    return _titled("AP@0.5 per class:", _render(["class", "objects", *variants], rows, markdown), markdown)


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    low, high = row.get(f"{key}_ci95_lo"), row.get(f"{key}_ci95_hi")
    text = _fmt(row.get(key), fmt)
    return text if low is None or high is None else f"{text} [{fmt.format(low)}, {fmt.format(high)}]"


def _titled(title: str, table: str, markdown: bool) -> str:
    return title + ("\n\n" if markdown else "\n") + table  # Markdown wants a blank line before a table


def _render(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in [headers, *rows])


def _fmt(value: Any, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


__all__ = ["report", "format_table", "comparison_table", "per_class_table", "pruning_line", "validation_line",
           "VARIANT_COLUMNS", "OPTIONAL_COLUMNS"]
