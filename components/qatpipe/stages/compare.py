"""Stage: the FP32 / PTQ / PTQ-partial / QAT comparison: tables, charts and one summary.json for the pipeline run,
with paired bootstrap confidence intervals for the variants' mAP and for their differences."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any, Iterable

from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text, read_json, write_json
from qatpipe.html_report import png_page
from qatpipe.metrics.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED, match_detections, paired_bootstrap
from qatpipe.stages.bench_engine import BENCH_FILE  # copied beside the evaluation by the validate stage
from qatpipe.stages.evaluate import DETECTIONS_FILE, GROUND_TRUTH_FILE, METRICS_FILE
from qatpipe.stages.validate import EMULATED_FOLDER, REPORT_FILE as VALIDATION_FILE
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
TABLE_FILE = "comparison.md"
CHART_FILE = "comparison.png"
DIFFERENCES_CHART_FILE = "differences.png"  # the forest plot of the paired differences (plot_differences)
TRADEOFF_CHART_FILE = "accuracy_latency.png"
HTML_FILE = "comparison.html"
# the differences worth a confidence interval, "a-b" = a minus b (those whose variants both were evaluated):
# each INT8 variant against FP32, what keeping PTQ's sensitive layers float wins, and QAT against either PTQ
PAIRS = (("qat", "fp32"), ("ptq", "fp32"), ("ptq-partial", "fp32"), ("ptq-partial", "ptq"), ("qat", "ptq"),
         ("qat", "ptq-partial"))

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
    "size_mb": ("size (MB)", "{:.2f}"),
    "params": ("params", "{:,.0f}"),
    "gflops": ("GFLOPs", "{:.3f}"),
}
TENSORRT_PREFIX = "tensorrt."  # metrics of the differences in TensorRT's numbers: tensorrt.qat-fp32.map50_diff
# when some variant has them
OPTIONAL_COLUMNS = ("engine", "layers", "quantized_by", "map50_tensorrt_emulated", "map50_dla_emulated")


def variant_row(evaluation_dir: str | Path) -> dict[str, Any]:
    """One variant's figures from its evaluation (or validation) folder and, when there, its engine benchmark."""
    folder = Path(evaluation_dir)
    metrics = read_json(folder / METRICS_FILE, "evaluation metrics")
    bench = read_json(folder / BENCH_FILE, "engine benchmark") if (folder / BENCH_FILE).is_file() else {}
    validation = (read_json(folder / VALIDATION_FILE, "validation report")
                  if (folder / VALIDATION_FILE).is_file() else {})
    batches = bench.get("batches", [])
    single = min(batches, key=lambda row: row["batch_size"], default={})
    largest = max(batches, key=lambda row: row["batch_size"], default={})
    layers = validation.get("layer_precision")
    return {
        "engine": validation.get("engine_label") or bench.get("label"),
        "layers": f"{layers['int8']} / {layers['fp16']} / {layers['fp32']}" if layers else None,
        "quantized_by": validation.get("quantized_by"),
        "map50": metrics["map50"],
        "map50_tensorrt_emulated": validation.get("map50_tensorrt_emulated", metrics["map50"] if validation.get(
            "computes_tensorrt_numbers") else None),  # as tensorrt_emulated_folders: the engine's own numbers
        "map50_dla_emulated": validation.get("map50_dla_emulated"),
        "map": metrics["map"],
        "latency_ms_p50": single.get("latency_ms_p50"),
        "latency_ms_p99": single.get("latency_ms_p99"),
        "throughput": largest.get("throughput"),
        "throughput_batch": largest.get("batch_size"),
        "size_mb": metrics.get("model_size_mb"),
    }


def validation_results(folders: dict[str, str | Path]) -> dict[str, bool]:
    """variant -> whether it passed the gate, for the folders that hold a validation report."""
    return {name: bool(read_json(Path(folder) / VALIDATION_FILE, "validation report")["passed"])
            for name, folder in folders.items() if (Path(folder) / VALIDATION_FILE).is_file()}


def gate_budgets(folders: dict[str, str | Path]) -> dict[str, float]:
    """variant -> the mAP@0.5 drop below FP32 its validation gate allowed (validate.max_map_drop), for the folders
    whose validation report records it."""
    reports = {name: read_json(Path(folder) / VALIDATION_FILE, "validation report")
               for name, folder in folders.items() if (Path(folder) / VALIDATION_FILE).is_file()}
    return {name: report["max_map_drop"] for name, report in reports.items() if report.get("max_map_drop") is not None}


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


def uncertainty(evaluations: dict[str, str | Path], resamples: int = DEFAULT_RESAMPLES,
                seed: int = DEFAULT_SEED, pairs=PAIRS, matched: dict | None = None) -> dict | None:
    """The paired bootstrap (metrics.bootstrap.paired_bootstrap) over the variants whose folders hold
    detections.json and ground_truth.json, for the `pairs` (a, b) among them (a - b; the pipeline's PAIRS by
    default); None when no folder holds them. Folders whose two files are byte for byte the same (ptq-partial
    that kept no layer float, an engine that computes TensorRT's numbers itself) are matched and resampled once;
    `matched` (the file digests' MatchedDetections) carries that across calls."""
    folders = {name: Path(folder) for name, folder in evaluations.items()
               if (Path(folder) / DETECTIONS_FILE).is_file() and (Path(folder) / GROUND_TRUTH_FILE).is_file()}
    if not folders:
        return None
    truths = {name: read_json(folder / GROUND_TRUTH_FILE, "ground truth") for name, folder in folders.items()}
    first = next(iter(truths))
    others = [name for name, truth in truths.items() if truth != truths[first]]
    if others:
        raise QatpipeError(f"compare: {', '.join(others)} were evaluated on other val images or labels than "
                           f"{first}: their mAP cannot be compared image by image")
    matched = {} if matched is None else matched
    truth = hashlib.sha256((folders[first] / GROUND_TRUTH_FILE).read_bytes()).hexdigest()  # every folder's, above
    variants = {}
    for name, folder in folders.items():
        key = (truth, hashlib.sha256((folder / DETECTIONS_FILE).read_bytes()).hexdigest())
        if key not in matched:
            matched[key] = match_detections(truths[first], read_json(folder / DETECTIONS_FILE, "detections"))
        variants[name] = matched[key]
    return paired_bootstrap(variants, [(a, b) for a, b in pairs if a in variants and b in variants], resamples, seed)


def tensorrt_emulated_folders(evaluations: dict[str, str | Path]) -> dict[str, Path] | None:
    """The evaluations as TensorRT would score them: a validation folder's `tensorrt_emulated/` (the exact form
    of a fast CPU INT8 engine) where there is one, the folder itself elsewhere (float engines, engines that
    compute TensorRT's numbers); None when no variant has one."""
    emulated = {name: Path(folder) / EMULATED_FOLDER for name, folder in evaluations.items()
                if (Path(folder) / EMULATED_FOLDER / DETECTIONS_FILE).is_file()}
    return {name: emulated.get(name, Path(folder)) for name, folder in evaluations.items()} if emulated else None


def per_class_ap50(evaluations: dict[str, str | Path]) -> dict[str, dict[str, Any]]:
    """class -> {"objects": ground-truth count, variant: AP@0.5, ...} from the variants' metrics.json."""
    table: dict[str, dict[str, Any]] = {}
    for name, folder in evaluations.items():
        for cls, values in read_json(Path(folder) / METRICS_FILE, "evaluation metrics").get("per_class", {}).items():
            table.setdefault(cls, {"objects": values["num_gt"]})[name] = values["ap50"]
    return table


def compare_variants(evaluations: dict[str, str | Path], output_dir: str | Path, prune_report: dict | None = None,
                     unpruned_evaluation: str | Path | None = None, resamples: int = DEFAULT_RESAMPLES,
                     seed: int = DEFAULT_SEED) -> dict:
    """Summarise the variants' evaluations into output_dir: summary.json, a Markdown table, charts, an HTML page.
    With the prune report (and the unpruned model's evaluation) the variants get their params and FLOPs
    (all variants are the pruned network) and the summary a `pruning` block. Where the evaluations hold their
    detections, each variant's mAP gets a 95% CI (`map50_ci95_lo`, ...) and the summary `comparisons`: the
    differences of PAIRS with theirs (paired bootstrap over the val images, `resamples` times, `seed`); where
    validation scored TensorRT's numbers too, `comparisons_tensorrt_emulated` holds the same differences in
    those. The differences are drawn as a forest plot (differences.png, plot_differences) beside the bar chart
    (comparison.png, which `qatpipe compare` redraws from MLflow) and the accuracy-vs-latency chart; the
    summary's `max_map_drop` (variant -> its validation gate's budget) gives the plot its gate lines."""
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
    budgets = gate_budgets(evaluations)
    if budgets:  # the gate's budget per variant, for the forest plot's line
        summary["max_map_drop"] = budgets
    matched = {}  # the engines' numbers and TensorRT's often share files: each is matched once
    bootstrap = uncertainty(evaluations, resamples, seed, matched=matched)
    if bootstrap is not None:
        for name, intervals in bootstrap["variants"].items():
            for metric, estimate in intervals.items():
                variants[name][f"{metric}_ci95_lo"], variants[name][f"{metric}_ci95_hi"] = estimate["ci95"]
        summary["bootstrap"] = {key: bootstrap[key] for key in ("images", "resamples", "seed")}
        summary["comparisons"] = bootstrap["pairs"]
    emulated = tensorrt_emulated_folders(evaluations)
    if bootstrap is not None and emulated is not None:  # the same differences in what TensorRT will compute
        summary["comparisons_tensorrt_emulated"] = uncertainty(emulated, resamples, seed, matched=matched)["pairs"]
    classes = per_class_ap50(evaluations)
    if classes:
        summary["per_class_ap50"] = classes
    write_json(output_dir / SUMMARY_FILE, summary)
    table = report(summary, markdown=True)
    atomic_write_text(output_dir / TABLE_FILE, "# Variants\n\n" + table + "\n")
    differences = plot_differences(summary, output_dir / DIFFERENCES_CHART_FILE)
    charts = [differences] if differences else []
    charts.append(plot_variants(variants, output_dir / CHART_FILE))
    tradeoff = plot_tradeoff(variants, output_dir / TRADEOFF_CHART_FILE)
    charts += [tradeoff] if tradeoff else []
    atomic_write_text(output_dir / HTML_FILE, png_page("Variants", charts, table))
    metrics = {f"{name}.{key}": value for name, row in variants.items() for key, value in row.items()
               if not isinstance(value, str)}
    metrics.update({f"pruning.{key}": value for key, value in summary.get("pruning", {}).items()})
    metrics.update(pair_metrics(summary.get("comparisons", {})))
    metrics.update({f"{TENSORRT_PREFIX}{key}": value
                    for key, value in pair_metrics(summary.get("comparisons_tensorrt_emulated", {})).items()})
    engines = {f"{name}.engine": row["engine"] for name, row in variants.items() if row.get("engine")}
    StageRecord(
        stage="compare", params={"variants": ",".join(variants), "bootstrap_resamples": resamples,
                                 "bootstrap_seed": seed, **engines},
        metrics={key: value for key, value in metrics.items() if value is not None},
        artifacts=[SUMMARY_FILE, TABLE_FILE, *(chart.name for chart in charts)],
    ).write(output_dir)
    log.info("variants:\n%s", report(summary))
    return summary


def pair_metrics(comparisons: dict[str, dict[str, dict]]) -> dict[str, float]:
    """summary.json's comparisons as flat metrics: `qat-fp32.map50_diff`, `qat-fp32.map50_ci95_lo`, `..._hi`."""
    flat = {}
    for pair, metrics in comparisons.items():
        for metric, estimate in metrics.items():
            flat[f"{pair}.{metric}_diff"] = estimate["diff"]
            flat[f"{pair}.{metric}_ci95_lo"], flat[f"{pair}.{metric}_ci95_hi"] = estimate["ci95"]
    return flat


def comparisons_from_metrics(flat: dict[str, float]) -> dict[str, dict[str, dict]]:
    """pair_metrics' inverse (the comparisons as an experiment tracker gives them back)."""
    comparisons: dict[str, dict[str, dict]] = {}
    for key, value in flat.items():
        pair, name = key.split(".", 1)
        metric, part = name.split("_", 1)
        estimate = comparisons.setdefault(pair, {}).setdefault(metric, {"diff": None, "ci95": [None, None]})
        if part == "diff":
            estimate["diff"] = value
        else:
            estimate["ci95"][("ci95_lo", "ci95_hi").index(part)] = value
    return comparisons


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


def verdict(pair: str, ci95: list[float], names: Iterable[str] = ()) -> str:
    """Plain words for a difference a-b: no significant difference when its interval holds 0, else which is
    better (split_pair: `names`, the variants, split a name holding "-")."""
    better, worse = split_pair(pair, names)
    if not all(math.isfinite(bound) for bound in ci95):  # e.g. every resample drew images without objects
        return "n/a"
    if ci95[0] <= 0 <= ci95[1]:
        return "no significant difference"
    return f"{better} better" if ci95[0] > 0 else f"{worse} better"


def split_pair(pair: str, names: Iterable[str] = ()) -> tuple[str, str]:
    """(a, b) of a difference named "a-b". A variant's name may hold "-" (ptq-partial): the split is the one
    whose sides are both among `names` (the summary's variants), else one side is, else the first "-"."""
    known = set(names)
    splits = [(pair[:at], pair[at + 1:]) for at, char in enumerate(pair) if char == "-"]
    if not splits:
        raise ValueError(f"{pair!r} is no difference a-b")
    for wanted in (2, 1):
        for a, b in splits:
            if (a in known) + (b in known) >= wanted:
                return a, b
    return splits[0]


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


def plot_variants(variants: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """Grouped bars: mAP@0.5 and mAP@[.5:.95] per variant (the accuracy side of the FP32/PTQ/QAT trade), with
    their 95% CIs where known."""
    import numpy as np

    plt = _pyplot()
    names = list(variants)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(names), 3.6))
    for offset, key in ((-0.2, "map50"), (0.2, "map")):
        values = [variants[n].get(key) or 0.0 for n in names]
        bars = ax.bar(x + offset, values, width=0.4, label=VARIANT_COLUMNS[key][0],
                      yerr=_error_bars([variants[n] for n in names], key), capsize=3)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("mAP (val)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Variants")
    return _save(fig, path)


# forest plot: summary key -> (marker, filled, what its rows measured); colours by where the 95% CI lies
DIFFERENCE_SETS = {"comparisons": ("o", True, "engines as validated"),
                   "comparisons_tensorrt_emulated": ("D", False, "TensorRT's numbers")}
SIGNIFICANCE_COLOURS = {"above": ("tab:blue", "CI above 0: a better"),
                        "below": ("tab:red", "CI below 0: b better"),
                        "holds": ("0.45", "CI holds 0: no significant difference")}
BUDGET_COLOUR = "tab:orange"


def plot_differences(summary: dict[str, Any], path: str | Path, metric: str = "map50") -> Path | None:
    """The forest plot of the paired differences (differences_figure) as a PNG; None when the summary has none."""
    fig = differences_figure(summary, metric)
    return None if fig is None else _save(fig, path)


def differences_figure(summary: dict[str, Any], metric: str = "map50"):
    """A forest plot of summary.json's paired differences in `metric`: one row per pair a-b the summary holds
    (`comparisons`, then any only in `comparisons_tensorrt_emulated`; none named in code), top to bottom in its
    order. Each difference is a point in mAP points (x100) with its 95% CI as a horizontal bar, filled circles for
    the engines as validated and open diamonds beside them for TensorRT's numbers; coloured by where the CI lies
    (blue above 0: a better, red below: b better, grey holding 0: no significant difference) and printed right of
    its row with the verdict. A solid line marks 0; on the rows a-fp32 a dashed line marks the drop a's
    validation gate allowed (-validate.max_map_drop, summary `max_map_drop`), the line an interval must stay
    right of for the gate to pass with room. None when the summary holds no difference in `metric`."""
    from matplotlib.lines import Line2D
    from matplotlib.transforms import blended_transform_factory

    sets = [(key, summary.get(key) or {}) for key in DIFFERENCE_SETS]
    sets = [(key, comparisons) for key, comparisons in sets
            if any(metric in metrics for metrics in comparisons.values())]
    pairs = list(dict.fromkeys(pair for _, comparisons in sets for pair, metrics in comparisons.items()
                               if metric in metrics))
    if not pairs:
        return None
    names = list(summary.get("variants", {}))
    budgets = summary.get("max_map_drop") or {}
    plt = _pyplot()
    row_height = 0.3 + 0.22 * len(sets)  # inches
    fig, (ax, key) = plt.subplots(2, 1, figsize=(9, 1.9 + row_height * len(pairs)),
                                  gridspec_kw={"height_ratios": [row_height * len(pairs) + 0.4, 0.5]})
    spacing = 0.36 / len(sets)
    offsets = [spacing * ((len(sets) - 1) / 2 - i) for i in range(len(sets))]  # the sets, top to bottom in a row
    xs, colours, budget_values = [0.0], set(), set()
    for row, pair in enumerate(pairs):
        y = len(pairs) - 1 - row
        a, b = split_pair(pair, names)
        budget = budgets.get(a) if b == "fp32" else None
        if budget is not None:
            ax.vlines(-100 * budget, y - 0.45, y + 0.45, colors=BUDGET_COLOUR, linestyles="--", lw=1.3, zorder=1)
            xs.append(-100 * budget)
            budget_values.add(budget)
        for (set_key, comparisons), dy in zip(sets, offsets):
            estimate = comparisons.get(pair, {}).get(metric)
            if estimate is None:
                continue
            marker, filled, what = DIFFERENCE_SETS[set_key]
            diff, low, high = (100 * value for value in (estimate["diff"], *estimate["ci95"]))
            where = _ci_side(estimate["ci95"])
            colour = SIGNIFICANCE_COLOURS[where][0]
            colours.add(where)
            finite = all(math.isfinite(value) for value in (diff, low, high))
            if finite:
                ax.errorbar(diff, y + dy, xerr=[[max(diff - low, 0.0)], [max(high - diff, 0.0)]], fmt=marker,
                            color=colour, mfc=colour if filled else "white", mec=colour, ms=6, capsize=3, lw=1.5,
                            zorder=3)
                xs += [low, high, diff]
            figures = (f"{diff:+6.2f} [{low:+6.2f}, {high:+6.2f}]  {verdict(pair, estimate['ci95'], names)}"
                       if finite else "n/a")
            label = f"{'TensorRT' if set_key != 'comparisons' else 'engine':<8} " if len(sets) > 1 else ""
            ax.annotate(label + figures, xy=(1.02, y + dy), xycoords=("axes fraction", "data"), ha="left",
                        va="center", fontsize=8, family="monospace", color=colour)
    ax.axvline(0, color="0.15", lw=0.9, zorder=2)
    low, high = min(xs), max(xs)
    pad = max(high - low, 1.0) * 0.08
    ax.set_xlim(low - pad, high + pad)
    ax.set_ylim(-0.6, len(pairs) - 0.4)
    ax.set_yticks(range(len(pairs) - 1, -1, -1), pairs)
    ax.grid(axis="x", alpha=0.3)
    bootstrap = summary.get("bootstrap")
    how = (f"; {bootstrap['images']} val images, {bootstrap['resamples']} paired bootstrap resamples"
           if bootstrap else "")
    header = VARIANT_COLUMNS.get(metric, (metric,))[0]
    ax.set_xlabel(f"a − b in {header} (points), 95% CI")
    ax.set_title(f"Paired differences a − b in {header}{how}", loc="left", fontsize=10)  # over the figures too
    handles = [Line2D([], [], color=colour, marker="s", ls="", label=label)
               for where, (colour, label) in SIGNIFICANCE_COLOURS.items() if where in colours]
    if len(sets) > 1:
        handles += [Line2D([], [], color="0.15", marker=DIFFERENCE_SETS[set_key][0], ls="",
                           mfc="0.15" if DIFFERENCE_SETS[set_key][1] else "white", label=DIFFERENCE_SETS[set_key][2])
                    for set_key, _ in sets]
    if budget_values:
        value = (f" −{100 * next(iter(budget_values)):.2f} points" if len(budget_values) == 1 else "")
        handles.append(Line2D([], [], color=BUDGET_COLOUR, ls="--",
                              label=f"validation gate's budget{value} (a − fp32 rows; validate.max_map_drop)"))
    key.axis("off")  # the legend's row, centred on the figure (the plot's axes leave the figures room)
    key.legend(handles=handles, loc="center", ncol=min(len(handles), 3), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.5), bbox_transform=blended_transform_factory(fig.transFigure, key.transAxes))
    return fig


def _ci_side(ci95: list[float]) -> str:
    """Where a 95% CI lies against 0: "above", "below" or "holds" (a CI that is not finite counts as holding 0)."""
    if not all(math.isfinite(bound) for bound in ci95) or ci95[0] <= 0 <= ci95[1]:
        return "holds"
    return "above" if ci95[0] > 0 else "below"


def plot_tradeoff(variants: dict[str, dict[str, Any]], path: str | Path) -> Path | None:
    """Accuracy against latency (tradeoff_figure) as a PNG; None when no variant was benchmarked."""
    fig = tradeoff_figure(variants)
    return None if fig is None else _save(fig, path)


def tradeoff_figure(variants: dict[str, dict[str, Any]]):
    """mAP@0.5 (95% CI bars where known) over p50 latency at batch 1, a labelled point per benchmarked variant,
    the labels placed so that none overlaps another (place_labels); None when no variant was benchmarked."""
    timed = {name: row for name, row in variants.items() if row.get("latency_ms_p50") is not None}
    if not timed:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, row in timed.items():
        ax.errorbar(row["latency_ms_p50"], row["map50"], yerr=_error_bars([row], "map50"), fmt="o", capsize=4)
    with_ci = any(row.get("map50_ci95_lo") is not None for row in timed.values())
    ax.set(xlabel=VARIANT_COLUMNS["latency_ms_p50"][0] + ", batch 1",
           ylabel="mAP@0.5 (val)" + (", 95% CI" if with_ci else ""), title="Accuracy vs latency")
    ax.set_xlim(0, 1.6 * max(row["latency_ms_p50"] for row in timed.values()))  # room for the labels
    ax.grid(alpha=0.3)
    fig.tight_layout()  # the axes' final place first: the labels are placed in display space
    place_labels(ax, [(f"{name} ({row['engine']})" if row.get("engine") else name, row["latency_ms_p50"],
                       row["map50"]) for name, row in timed.items()])
    return fig


LABEL_GAP = 6  # points between a point and its label, and between stacked labels


def place_labels(ax, points: list[tuple[str, float, float]], fontsize: float = 8) -> list:
    """Annotate each (label, x, y) beside its point where it overlaps no label placed before it: the corners
    around the point first, then ever farther above or below it with a leader line. Among those, one clear of
    every marker, inside the axes and nearest its point wins, crossing the fewest error bars. Measured in display
    space (the renderer's extents), so the axes must have their final size and limits; the labels take no part
    in the layout, so a later tight_layout keeps them apart. Returns the annotations, top to bottom."""
    renderer = ax.figure.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    markers, bars = _obstacles(ax)
    corners = [(LABEL_GAP, LABEL_GAP, "left", "bottom"), (LABEL_GAP, -LABEL_GAP, "left", "top"),
               (-LABEL_GAP, LABEL_GAP, "right", "bottom"), (-LABEL_GAP, -LABEL_GAP, "right", "top")]
    step = fontsize + LABEL_GAP  # one stacked line, in points
    placed, boxes = [], []
    for label, x, y in sorted(points, key=lambda point: -point[2]):  # top to bottom: stacks keep the order
        best = None  # (score, annotation, box)
        for ring in range(len(points) + 2):
            for dx, dy, ha, va in corners:
                offset = (dx, dy + ring * step * (1 if dy > 0 else -1))
                text = ax.annotate(label, (x, y), textcoords="offset points", xytext=offset, fontsize=fontsize,
                                   ha=ha, va=va, annotation_clip=False,
                                   arrowprops=dict(arrowstyle="-", lw=0.6, color="0.5") if ring else None)
                text.set_in_layout(False)
                box = label_extent(text, renderer)
                clear = box.padded(1)
                outside = not (inside.contains(box.x0, box.y0) and inside.contains(box.x1, box.y1))
                score = (sum(clear.overlaps(other) for other in boxes), sum(clear.overlaps(m) for m in markers),
                         outside, ring, sum(clear.overlaps(bar) for bar in bars))
                if best is None or score < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (score, text, box)
                else:
                    text.remove()
            if best[0][:3] == (0, 0, False):
                break
        placed.append(best[1])
        boxes.append(best[2])
    return placed


def _obstacles(ax) -> tuple[list, list]:
    """Display boxes a label should not cover: (every marker, error bar caps included; every error bar)."""
    from matplotlib.transforms import Bbox

    scale = ax.figure.dpi / 72  # points to pixels
    markers = []
    for line in ax.lines:
        if line.get_marker() in (None, "", " ", "None", "none"):
            continue
        half = line.get_markersize() * scale / 2
        markers += [Bbox.from_extents(x - half, y - half, x + half, y + half)
                    for x, y in line.get_transform().transform(line.get_xydata())]
    bars = [path.get_extents(collection.get_transform()) for collection in ax.collections
            for path in collection.get_paths()]
    return markers, bars


def label_extent(annotation, renderer):
    """The display-space box of an annotation's text alone (Annotation.get_window_extent adds its leader line)."""
    from matplotlib.text import Text

    annotation.update_positions(renderer)
    return Text.get_window_extent(annotation, renderer)


def _error_bars(rows: list[dict[str, Any]], key: str):
    """matplotlib's yerr (2, n) from the rows' 95% CIs, None when a row has none."""
    if any(row.get(f"{key}_ci95_lo") is None for row in rows):
        return None
    return [[row[key] - row[f"{key}_ci95_lo"] for row in rows], [row[f"{key}_ci95_hi"] - row[key] for row in rows]]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _fmt(value: Any, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)
