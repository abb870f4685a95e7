"""compare: the FP32 / PTQ / QAT table (all three scored in ONNX Runtime), charts and summary.json, with the
pruning block (unpruned vs pruned size and mAP), the differences between the variants with their bootstrap
confidence intervals and the per-class AP; logs them to the MLflow parent run for the side-by-side view."""

from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def compare(parent_run_id: str, fp32: Input[Artifact], ptq: Input[Artifact], qat: Input[Artifact],
            unpruned: Input[Artifact], pruned: Input[Model], summary: Output[Artifact], table: Output[Markdown],
            chart: Output[HTML], metrics: Output[Metrics]):
    import json
    from pathlib import Path

    from qatpipe.fileio import write_json
    from qatpipe.stages.compare import HTML_FILE, SUMMARY_FILE, TABLE_FILE, compare_variants, pair_metrics
    from qatpipe.stages.prune import REPORT_FILE
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe.tracking.records import StageRecord
    from qatpipe_kfp.runtime import stage, write_metrics, write_text

    with stage("compare"):
        evaluations = {"fp32": fp32.path, "ptq": ptq.path, "qat": qat.path}
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
