"""ptq: the PTQ baseline: calibrate the FP32 ONNX on training images (ONNX Runtime's static quantization or
NVIDIA Model Optimizer's, symmetric int8 Q/DQ) into an INT8 ONNX."""

from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output

from qatpipe_kfp.settings import component


@component
def ptq(ptq_spec: str, dataset: Input[Dataset], fp32_onnx: Input[Model], int8_onnx: Output[Model],
        metrics: Output[Metrics], precision: Output[Markdown]):
    """Build the PTQ baseline: an INT8 ONNX calibrated from the FP32 ONNX on training images.

    Symmetric int8 Q/DQ by `ptq.tool` (onnxruntime: ONNX Runtime's static quantization; modelopt: NVIDIA Model
    Optimizer's ONNX quantizer, in its own environment); `ptq.method` and `ptq.calibration_images` set the
    calibration. The model must pass TensorRT's Q/DQ rule check.

    Args:
        ptq_spec: The spec's ptq view (sections dataset, model, evaluate, ptq), as YAML; its data paths are
            replaced by the prepared data set's.
        dataset: The prepared data set (prepare-data's `dataset`); the calibration images are sampled from its
            train split.
        fp32_onnx: The FP32 ONNX model folder (export's `onnx_model`); the file is its `file` metadata
            (default model.onnx).

    Returns:
        int8_onnx: Folder with model.onnx (int8 Q/DQ), model_ptq.json, precision_report.json/.md and
            tracking.json; its metadata names the framework, file, variant, PTQ tool and calibration method.
        metrics: The number of calibration images, the INT8 model's size in MB, its Conv/Gemm layers in INT8, and
            the precision report's figures: tensors FP16 must leave in FP32, the INT8 model's worst layer error
            against FP32.
        precision: The precision report: which tensors FP16 must leave alone, and the INT8 model against the
            FP32 one layer by layer.
    """
    from pathlib import Path

    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.export.precision import MARKDOWN_FILE
    from qatpipe.stages.ptq import ptq as ptq_stage
    from qatpipe_kfp.runtime import load_stage_spec, stage, write_metrics, write_text

    with stage("ptq", record=int8_onnx):
        spec = spec_with_prepared_dataset(load_stage_spec(ptq_spec), dataset.path)
        source = Path(fp32_onnx.path) / fp32_onnx.metadata.get("file", "model.onnx")
        report = ptq_stage(spec, source, Path(int8_onnx.path) / "model.onnx")
        int8_onnx.metadata.update({"framework": "onnx", "file": "model.onnx", "variant": "ptq",
                                   "quantization": f"int8 Q/DQ, PTQ by {report['quantized_by']}"})
        write_metrics(metrics, {key: report.get(key) for key in ("calibration_images", "size_mb", "fp16_flags",
                                                                  "layer_max_error")}
                      | {"quantized_layers": len(report["qdq_check"]["quantized"])})
        markdown = Path(int8_onnx.path) / MARKDOWN_FILE
        write_text(precision, markdown.read_text() if markdown.is_file() else "No precision report "
                   "(ptq.report_images: 0).\n")
