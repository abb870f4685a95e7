"""evaluate: mAP@0.5, mAP@[.5:.95] and per-class AP of one model variant on the val set (pycocotools)."""

from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def evaluate(evaluate_spec: str, variant: str, dataset: Input[Dataset], model: Input[Model],
             results: Output[Artifact], metrics: Output[Metrics], report: Output[Markdown],
             pr_curves: Output[HTML]):
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.html_report import png_page
    from qatpipe.metrics.report import evaluation_markdown
    from qatpipe.stages.evaluate import PR_CURVE_FILE, evaluate as evaluate_stage, tracked_metrics
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage(f"evaluate-{variant}"):
        spec = spec_with_prepared_dataset(load_stage_spec(evaluate_spec), dataset.path)
        model_file = Path(model.path) / model.metadata.get("file", "model.keras")
        result = evaluate_stage(spec, model_file, results.path, stage_name=f"evaluate_{variant}")
        results.metadata["variant"] = variant
        write_metrics(metrics, tracked_metrics(result))
        write_text(report, evaluation_markdown(variant, result))
        write_text(pr_curves, png_page(f"{variant}: precision/recall at IoU 0.5",
                                       Path(results.path) / PR_CURVE_FILE))
