"""Stage: the PTQ baseline: calibrate the FP32 ONNX on training images into an INT8 Q/DQ ONNX."""

from __future__ import annotations

import logging
from pathlib import Path

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
    report_path = write_json(output.with_name(f"{output.stem}_ptq.json"), report)
    StageRecord(
        stage="ptq", params={f"ptq.{key}": value for key, value in settings.model_dump().items()},
        metrics={"calibration_images": report["calibration_images"], "size_mb": report["size_mb"]},
        artifacts=[output.name, report_path.name],
    ).write(output.parent)
    return report


__all__ = ["ptq"]
