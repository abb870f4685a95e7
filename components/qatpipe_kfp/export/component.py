"""export: a trained detector to ONNX through tf2onnx, checked in ONNX Runtime; for a QAT model the
explicit-quantisation ONNX (int8 weights) plus the TensorRT <= 10 calibration cache pair."""

from kfp.dsl import Input, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def export(export_spec: str, variant: str, model: Input[Model], onnx_model: Output[Model],
           metrics: Output[Metrics]):
    """Export a trained tf_keras detector to ONNX through tf2onnx, checked against TensorFlow in ONNX Runtime.

    A QAT model becomes an explicit-quantisation ONNX (int8 weights), with the implicit ONNX, the calibration
    cache and the scales for TensorRT <= 10 beside it.

    Args:
        export_spec: The spec's export view (sections dataset, model, export), as YAML.
        variant: The variant's name (fp32 or qat); names the task's stage and goes into the ONNX model's metadata.
        model: The trained model folder (retrain's `model`); the file is its `file` metadata (default model.keras).

    Returns:
        onnx_model: Folder with model.onnx, model_export.json and tracking.json, and for a QAT model also
            model_implicit.onnx, model.cache and model_scales.json; its metadata names the framework, file,
            variant, opset and quantisation.
        metrics: The ONNX file's size in MB and, per model output, the largest absolute difference from TensorFlow.
    """
    from pathlib import Path

    from qatpipe.stages.export import export as export_stage
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics

    with stage(f"export-{variant}"):
        spec = load_stage_spec(export_spec)
        source = Path(model.path) / model.metadata.get("file", "model.keras")
        report = export_stage(spec, source, Path(onnx_model.path) / "model.onnx", stage_name=f"export_{variant}")
        onnx_model.metadata.update({"framework": "onnx", "file": "model.onnx", "variant": variant,
                                    "opset": report["opset"], "quantization": report["quantization"]})
        figures = {"size_mb": report["size_mb"]}
        figures.update({f"{name}.max_abs_difference_vs_tf": d["max_abs"]
                        for name, d in report["difference_vs_tensorflow"].items()})
        write_metrics(metrics, figures)
