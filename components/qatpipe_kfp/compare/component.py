"""compare: the FP32 / PTQ / PTQ-partial / QAT table (all scored in ONNX Runtime), charts and summary.json, with the
pruning block (unpruned vs pruned size and mAP), the differences between the variants with their bootstrap
confidence intervals and the per-class AP; logs them to the MLflow parent run for the side-by-side view."""

from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def compare(parent_run_id: str, fp32: Input[Artifact], ptq: Input[Artifact], ptq_partial: Input[Artifact],
            qat: Input[Artifact], unpruned: Input[Artifact], pruned: Input[Model], summary: Output[Artifact],
            table: Output[Markdown], chart: Output[HTML], metrics: Output[Metrics]):
    """Compare the FP32, PTQ, PTQ-partial and QAT variants and log the comparison to the MLflow parent run.

    Writes the variant table, the pruning block (unpruned vs pruned size and mAP), the differences between the
    variants with their paired-bootstrap 95% confidence intervals, the per-class AP and the charts.

    Args:
        parent_run_id: The MLflow parent run id (start-tracking's output). Empty, or no tracking server configured:
            nothing is logged to MLflow; the outputs are still written.
        fp32: The FP32 variant's evaluation folder (in the pipeline, validate's `results`).
        ptq: The PTQ variant's evaluation folder (in the pipeline, validate's `results`).
        ptq_partial: The ptq-partial variant's evaluation folder (the PTQ model with its most sensitive layers
            float; in the pipeline, validate's `results`); named `ptq-partial` in the outputs.
        qat: The QAT variant's evaluation folder (in the pipeline, validate's `results`).
        unpruned: The unpruned model's evaluation folder (evaluate's `results`): its mAP for the pruning block.
        pruned: The pruned model folder (prune's `pruned`): its prune_report.json gives the parameters and FLOPs
            before and after pruning.

    Returns:
        summary: Folder with summary.json, comparison.md, the charts, comparison.html and tracking.json.
        table: The comparison tables, as Markdown.
        chart: The comparison tables and the charts, as an HTML page.
        metrics: The comparison's figures: each variant's metrics, the pruning block and the pairwise differences
            with their confidence intervals.
    """
    import json
    from pathlib import Path

    from qatpipe.fileio import write_json
    from qatpipe.stages.compare import HTML_FILE, SUMMARY_FILE, TABLE_FILE, compare_variants, pair_metrics
    from qatpipe.stages.prune import REPORT_FILE
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe.tracking.records import StageRecord
    from qatpipe_kfp.runtime import stage, write_metrics, write_text

    with stage("compare"):
        evaluations = {"fp32": fp32.path, "ptq": ptq.path, "ptq-partial": ptq_partial.path, "qat": qat.path}
        prune_report = json.loads((Path(pruned.path) / REPORT_FILE).read_text())
        result = compare_variants(evaluations, summary.path, prune_report, unpruned.path)
        folder = Path(summary.path)
        write_text(table, (folder / TABLE_FILE).read_text())
        write_text(chart, (folder / HTML_FILE).read_text())
        write_metrics(metrics, StageRecord.read(folder).metrics)
        tracker = MlflowTracker.from_env()
        if parent_run_id and tracker is not None:
            result["mlflow"] = tracker.log_comparison(
                parent_run_id, result["variants"], folder, result["pruning"],
                pair_metrics(result.get("comparisons", {})),
                pair_metrics(result.get("comparisons_tensorrt_emulated", {})))
        write_json(folder / SUMMARY_FILE, result)
