"""evaluate: mAP@0.5, mAP@[.5:.95] and per-class AP of one model variant on the val set (pycocotools)."""

from kfp.dsl import HTML, Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def evaluate(evaluate_spec: str, variant: str, dataset: Input[Dataset], model: Input[Model],
             results: Output[Artifact], metrics: Output[Metrics], report: Output[Markdown],
             pr_curves: Output[HTML]):
    """Score one model variant on the val set: mAP@0.5, mAP@[.5:.95] and per-class AP (pycocotools).

    Args:
        evaluate_spec: The spec's evaluate view (sections dataset, model, evaluate), as YAML; its data paths are
            replaced by the prepared data set's.
        variant: The variant's name (unpruned, fp32, ptq, ptq-partial or qat); names the task's stage, the results
            and the report.
        dataset: The prepared data set (prepare-data's `dataset`); its val split is scored.
        model: The model folder, Keras or ONNX; the file is its `file` metadata (default model.keras).

    Returns:
        results: Folder with metrics.json, pr_curves.png, detections.json and ground_truth.json (COCO format),
            report.md and tracking.json; its metadata names the variant.
        metrics: mAP@0.5, mAP@[.5:.95], per-class AP, the class-agnostic mAP@0.5 and class accuracy, speed and size.
        report: The per-class table and the learning check, as Markdown.
        pr_curves: The precision/recall curves at IoU 0.5, as an HTML page.
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.html_report import png_page
    from qatpipe.stages.evaluate import PR_CURVE_FILE, evaluate as evaluate_stage, tracked_metrics
    from qatpipe.tracking.records import REPORT_MARKDOWN
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage(f"evaluate-{variant}", record=results):
        spec = spec_with_prepared_dataset(load_stage_spec(evaluate_spec), dataset.path)
        model_file = Path(model.path) / model.metadata.get("file", "model.keras")
        result = evaluate_stage(spec, model_file, results.path, stage_name=f"evaluate_{variant.replace('-', '_')}",
                                variant=variant)
        results.metadata["variant"] = variant
        write_metrics(metrics, tracked_metrics(result))
        write_text(report, (Path(results.path) / REPORT_MARKDOWN).read_text())
        write_text(pr_curves, png_page(f"{variant}: precision/recall at IoU 0.5",
                                       Path(results.path) / PR_CURVE_FILE))
