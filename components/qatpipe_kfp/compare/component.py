"""compare: the variant table (FP32, and PTQ / QAT as their stages land), chart and summary.json; logs them
to the MLflow parent run for the side-by-side view."""

from kfp.dsl import HTML, Artifact, Input, Markdown, Metrics, Output

from qatpipe_kfp.settings import component


@component
def compare(parent_run_id: str, fp32: Input[Artifact], summary: Output[Artifact], table: Output[Markdown],
            chart: Output[HTML], metrics: Output[Metrics]):
    from pathlib import Path

    from qatpipe.fileio import write_json
    from qatpipe.stages.compare import HTML_FILE, SUMMARY_FILE, TABLE_FILE, compare_variants
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe_kfp.runtime import stage, write_metrics, write_text

    with stage("compare"):
        evaluations = {"fp32": fp32.path}
        result = compare_variants(evaluations, summary.path)
        folder = Path(summary.path)
        write_text(table, (folder / TABLE_FILE).read_text())
        write_text(chart, (folder / HTML_FILE).read_text())
        write_metrics(metrics, {f"{name}.{key}": value for name, row in result["variants"].items()
                                for key, value in row.items()})
        tracker = MlflowTracker.from_env()
        if parent_run_id and tracker is not None:
            result["mlflow"] = tracker.log_comparison(parent_run_id, result["variants"], folder)
        write_json(folder / SUMMARY_FILE, result)
