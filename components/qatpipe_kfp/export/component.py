"""export: a trained detector to ONNX through tf2onnx, checked in ONNX Runtime; for a QAT model the
explicit-quantization ONNX (int8 weights) plus the TensorRT <= 10 calibration cache pair; for both the FP16
form (float regions in FP16, the FP16 guard's tensors FP32) and its precision report."""

from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def export(export_spec: str, variant: str, dataset: Input[Dataset], model: Input[Model], onnx_model: Output[Model],
           metrics: Output[Metrics], precision: Output[Markdown]):
    """Export a trained tf_keras detector to ONNX through tf2onnx, checked against TensorFlow in ONNX Runtime.

    A QAT model becomes an explicit-quantization ONNX (int8 weights), with the implicit ONNX, the calibration
    cache and the scales for TensorRT <= 10 beside it.

    Args:
        export_spec: The spec's export view (sections dataset, model, export), as YAML; its data paths are
            replaced by the prepared data set's.
        variant: The variant's name (fp32 or qat); names the task's stage and goes into the ONNX model's metadata.
        dataset: The prepared data set (prepare-data's `dataset`): the FP16 guard records tensor ranges on a
            seeded sample of its train split (`export.fp16_images`).
        model: The trained model folder (retrain's `model`); the file is its `file` metadata (default model.keras).

    Returns:
        onnx_model: Folder with model.onnx, model_export.json and tracking.json, and for a QAT model also
            model_implicit.onnx, model.cache and model_scales.json; with `export.fp16_onnx` model_fp16.onnx
            and precision_report.json/.md; its metadata names the framework, file, variant, opset and
            quantization, and the FP16 form's file.
        metrics: The ONNX file's size in MB and, per model output, the largest absolute difference from
            TensorFlow; the FP16 form's nodes in FP16 and FP32, the tensors the guard kept FP32, and its worst
            tensor's error against the float32 model.
        precision: The precision report: the tensors the FP16 guard keeps FP32, which nodes compute in FP16, and
            the FP16 form against the float32 model layer by layer.
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.export.precision import MARKDOWN_FILE
    from qatpipe.stages.export import export as export_stage
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage(f"export-{variant}", record=onnx_model):
        spec = spec_with_prepared_dataset(load_stage_spec(export_spec), dataset.path)
        source = Path(model.path) / model.metadata.get("file", "model.keras")
        report = export_stage(spec, source, Path(onnx_model.path) / "model.onnx", stage_name=f"export_{variant}")
        onnx_model.metadata.update({"framework": "onnx", "file": "model.onnx", "variant": variant,
                                    "opset": report["opset"], "quantization": report["quantization"]})
        figures = {"size_mb": report["size_mb"]}
        figures.update({f"{name}.max_abs_difference_vs_tf": d["max_abs"]
                        for name, d in report["difference_vs_tensorflow"].items()})
        form = report.get("fp16")
        if form:
            onnx_model.metadata["fp16_file"] = Path(form["onnx"]).name
            figures.update({f"fp16_{key}": form[key]
                            for key in ("fp16_nodes", "fp32_nodes", "guard_flags", "layer_max_error")})
        write_metrics(metrics, figures)
        markdown = Path(onnx_model.path) / MARKDOWN_FILE
        write_text(precision, markdown.read_text() if markdown.is_file() else "No FP16 form (export.fp16_onnx: "
                   "false).\n")
