"""Stage: export a trained detector to ONNX (TAO `export`), checked against TensorFlow in ONNX Runtime."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.fileio import write_json
from qatpipe.spec import ExperimentSpec

log = logging.getLogger(__name__)

# FP32 TensorFlow vs ONNX Runtime: the same maths in another order; anything larger is a conversion bug
FP32_TOLERANCE = 1e-3


def export(spec: ExperimentSpec, model_path: str | Path, output_path: str | Path) -> dict:
    """Write `output_path` (.onnx, dynamic batch) and `<stem>_export.json` beside it; fail if ONNX Runtime
    disagrees with TensorFlow on sample inputs."""
    from qatpipe.export.onnx_export import export_onnx, max_output_difference
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model

    output_path = Path(output_path)
    if output_path.suffix.lower() != ".onnx":
        raise QatpipeError(f"{output_path}: the export target must end in .onnx")
    model = load_keras_model(model_path, get_architecture(spec))
    export_onnx(model, output_path, spec.export.opset)
    # inputs in the model's range ([0, 1] pixels); two images exercise the dynamic batch
    sample = np.random.default_rng(0).uniform(size=(2, *model.input_shape[1:])).astype(np.float32)
    differences = max_output_difference(model, output_path, sample)
    report = {
        "model": str(model_path), "onnx": str(output_path), "opset": spec.export.opset,
        "size_mb": round(output_path.stat().st_size / 2**20, 3),
        "max_abs_difference_vs_tensorflow": differences,
    }
    write_json(output_path.with_name(f"{output_path.stem}_export.json"), report)
    worst = max(differences.values())
    if worst > FP32_TOLERANCE:
        raise QatpipeError(f"{output_path}: ONNX Runtime differs from TensorFlow by {worst:.2e} (> "
                           f"{FP32_TOLERANCE}); the export is wrong, see {output_path.stem}_export.json")
    log.info("exported %s -> %s (opset %d, %.2f MB, max |TF - ORT| %.1e)", model_path, output_path,
             spec.export.opset, report["size_mb"], worst)
    return report


__all__ = ["export"]
