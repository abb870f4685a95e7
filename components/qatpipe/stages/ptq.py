"""Stage: the PTQ baseline: calibrate the FP32 ONNX on training images into an INT8 Q/DQ ONNX."""

from __future__ import annotations

import logging
from pathlib import Path

from qatpipe.export.precision import JSON_FILE, MARKDOWN_FILE
from qatpipe.fileio import write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)


def ptq(spec: ExperimentSpec, fp32_onnx: str | Path, output: str | Path) -> dict:
    """`spec.ptq` settings; calibration images: a seeded sample of dataset.train, preprocessed as in evaluation.
    Writes `output` (.onnx) and `<stem>_ptq.json` beside it."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split
    from qatpipe.quantization.ptq import quantize_ptq

    settings = spec.ptq
    samples = sample_split(spec, "train", settings.calibration_images, settings.seed)
    batches = (batch.numpy() for batch in eval_dataset(samples, spec))
    report = quantize_ptq(fp32_onnx, output, batches, settings.method, settings.percentile)
    report["source"] = str(fp32_onnx)
    output = Path(output)
    metrics = {"calibration_images": report["calibration_images"], "size_mb": report["size_mb"]}
    artifacts = [output.name]
    if settings.report_images:
        report.update(_precision(spec, Path(fp32_onnx), output, samples[:settings.report_images]))
        metrics.update(fp16_flags=report["fp16_flags"], layer_max_error=report["layer_max_error"])
        artifacts += [JSON_FILE, MARKDOWN_FILE]
    report_path = write_json(output.with_name(f"{output.stem}_ptq.json"), report)
    StageRecord(
        stage="ptq", params={f"ptq.{key}": value for key, value in settings.model_dump().items()},
        metrics=metrics, artifacts=[*artifacts, report_path.name],
    ).write(output.parent)
    return report


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


__all__ = ["ptq"]
