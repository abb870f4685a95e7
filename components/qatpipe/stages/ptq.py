"""Stage: the PTQ baseline: calibrate the FP32 ONNX on training images into an INT8 Q/DQ ONNX."""

from __future__ import annotations

import logging
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.export.bundle import ExportBundle
from qatpipe.export.precision import JSON_FILE, MARKDOWN_FILE
from qatpipe.fileio import write_json
from qatpipe.onnx_model import QUANTIZED_BY_KEY
from qatpipe.spec import ExperimentSpec, PtqSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)


def ptq(spec: ExperimentSpec, fp32_onnx: str | Path, output: str | Path) -> dict:
    """`spec.ptq` settings (its tool: ONNX Runtime or Model Optimizer); calibration images: a seeded sample of
    dataset.train, preprocessed as in evaluation. Writes `output` (.onnx, checked against TensorRT's Q/DQ rules,
    what made it in its metadata) and `<stem>_ptq.json` beside it."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split

    settings = spec.ptq
    samples = sample_split(spec, "train", settings.calibration_images, settings.seed)
    batches = (batch.numpy() for batch in eval_dataset(samples, spec))
    report = _quantize(settings, Path(fp32_onnx), Path(output), batches)
    report["source"] = str(fp32_onnx)
    output = Path(output)
    report["quantized_by"] = quantized_by(report)
    report["qdq_check"] = _finish(output, report["quantized_by"], Path(fp32_onnx))
    metrics = {"calibration_images": report["calibration_images"], "size_mb": report["size_mb"],
               "quantized_layers": len(report["qdq_check"]["quantized"])}
    artifacts = [output.name]
    if settings.report_images:
        report.update(_precision(spec, Path(fp32_onnx), output, samples[:settings.report_images]))
        metrics.update(fp16_flags=report["fp16_flags"], layer_max_error=report["layer_max_error"])
        artifacts += [JSON_FILE, MARKDOWN_FILE]
    report_path = write_json(ExportBundle(output).ptq_report, report)
    params = {f"ptq.{key}": value for key, value in settings.model_dump().items()}
    params["ptq.method"] = report["method"]  # the tool's default where the spec leaves it unset
    StageRecord(
        stage="ptq", params=params,
        metrics=metrics, artifacts=[*artifacts, report_path.name],
    ).write(output.parent)
    return report


def _quantize(settings: PtqSpec, fp32_onnx: Path, output: Path, batches) -> dict:
    """The Q/DQ model of `settings.tool` (ONNX Runtime's quantize_static, or Model Optimizer's quantizer in its
    own environment) at `output`, and its report."""
    if settings.tool == "modelopt":
        from qatpipe.quantization.modelopt_ptq import quantize_modelopt

        return quantize_modelopt(fp32_onnx, output, batches, settings.calibration_method)
    from qatpipe.quantization.ptq import quantize_ptq

    return quantize_ptq(fp32_onnx, output, batches, settings.calibration_method, settings.percentile)


TOOL_PACKAGES = {"onnxruntime": "onnxruntime", "modelopt": "nvidia-modelopt"}  # ptq.tool -> the package it runs


def quantized_by(report: dict) -> str:
    """What made a PTQ model, for tables and the model's metadata: "onnxruntime 1.31.1, percentile"."""
    return f"{report['tool']} {report['versions'][TOOL_PACKAGES[report['tool']]]}, {report['method']}"


def _finish(model_path: Path, made_by: str, source: Path) -> dict:
    """Check the PTQ model against TensorRT's explicit-quantization rules (export/qdq.py), as every Q/DQ ONNX the
    project ships: a model that breaks them is an error naming the rules it breaks. Then record what made it in
    its metadata (QUANTIZED_BY_KEY; validate and compare show it), over the FP32 model's own (`source`'s: an
    decoding record, models/decoding.py), which a quantizer may drop. Returns the check."""
    import onnx

    from qatpipe.export.onnx_export import save_onnx
    from qatpipe.export.qdq import check_explicit_quantization
    from qatpipe.onnx_model import load_onnx_proto

    model = onnx.load(model_path)
    check = check_explicit_quantization(model)
    if check.problems:
        raise QatpipeError(f"{model_path}: the PTQ model ({made_by}) breaks TensorRT's Q/DQ rules: "
                           f"{'; '.join(check.problems[:5])}")
    inherited = {p.key: p.value for p in load_onnx_proto(source).metadata_props}
    onnx.helper.set_model_props(model, {**inherited, **{p.key: p.value for p in model.metadata_props},
                                        QUANTIZED_BY_KEY: made_by})
    save_onnx(model, model_path)
    log.info("PTQ model (%s): %d quantized Conv/Gemm, %d float, %d Add nodes with a quantized input", made_by,
             len(check.quantized), len(check.float_), len(check.residual_adds))
    return check.to_dict()


def _precision(spec: ExperimentSpec, fp32_onnx: Path, ptq_onnx: Path, samples) -> dict:
    """The precision report (export/precision.py) beside the PTQ model: which of the FP32 model's tensors FP16
    must leave alone, and where the INT8 model first parts from the FP32 one, layer by layer."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.export.precision import precision_report, write_report

    batches = [batch.numpy() for batch in eval_dataset(samples, spec)]
    report = precision_report(fp32_onnx, batches, ptq_onnx)
    json_path, _ = write_report(report, ptq_onnx.parent)
    jump = report["layers"]["first_jump"]
    log.info("precision: %d tensor(s) must stay FP32 for FP16; INT8 parts from FP32 first at %s",
             len(report["fp16_flags"]), f"{jump['tensor']} ({jump['op']})" if jump else "no tensor")
    return {"precision_report": str(json_path), "fp16_flags": len(report["fp16_flags"]),
            "layer_max_error": report["layers"]["worst"]["max_error"]}


__all__ = ["ptq", "quantized_by"]
