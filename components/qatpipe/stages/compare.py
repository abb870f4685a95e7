"""Stage: the FP32 / PTQ / PTQ-partial / QAT comparison: tables, charts and one summary.json for the pipeline run,
with paired bootstrap confidence intervals for the variants' mAP and for their differences.

The stage reads the variants' evaluation folders and writes the outputs; the numbers are metrics/bootstrap.py's
and metrics/comparisons.py's, the tables metrics/comparison_report.py's, the charts metrics/comparison_charts.py's."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text, read_json, write_json
from qatpipe.html_report import png_page
from qatpipe.metrics.bootstrap import DEFAULT_RESAMPLES, DEFAULT_SEED, match_detections, paired_bootstrap
from qatpipe.metrics.comparison_charts import plot_differences, plot_tradeoff, plot_variants
from qatpipe.metrics.comparison_report import report
from qatpipe.metrics.comparisons import pair_metrics
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
TENSORRT_PREFIX = "tensorrt."  # metrics of the differences in TensorRT's numbers: tensorrt.qat-fp32.map50_diff


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
        "cpu_int8": bench.get("cpu_int8", {}).get("note"),  # an int8 engine on the CPU: what its speed-up means
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
    engines = {f"{name}.{key}": row[key] for name, row in variants.items() for key in ("engine", "cpu_int8")
               if row.get(key)}
    StageRecord(
        stage="compare", params={"variants": ",".join(variants), "bootstrap_resamples": resamples,
                                 "bootstrap_seed": seed, **engines},
        metrics={key: value for key, value in metrics.items() if value is not None},
        artifacts=[SUMMARY_FILE, TABLE_FILE, *(chart.name for chart in charts)],
    ).write(output_dir)
    log.info("variants:\n%s", report(summary))
    return summary


__all__ = ["compare_variants", "variant_row", "uncertainty", "tensorrt_emulated_folders", "PAIRS",
           "SUMMARY_FILE", "TABLE_FILE", "HTML_FILE"]
