"""Post-training quantization with NVIDIA Model Optimizer's ONNX quantizer (`ptq.tool: modelopt`): NVIDIA's own
INT8 PTQ for TensorRT, as the second PTQ baseline. Its choices are its own (which nodes get Q/DQ, entropy or max
calibration); the float regions stay FP32 and the weights are stored int8 behind DequantizeLinear, as the
ONNX Runtime baseline's.

nvidia-modelopt[onnx] pins onnxruntime-gpu (which replaces the CPU `onnxruntime` module this project runs on),
and pulls in torch and cupy, so it lives in its own environment: the worker script beside this module runs in
that environment's Python, found as

1. $QATPIPE_MODELOPT_PYTHON, else
2. `<this environment>-modelopt/bin/python` beside this one (`.venv` -> `.venv-modelopt`, made by `make modelopt`;
   `/opt/venv` -> `/opt/venv-modelopt` in the training image).

Calibration runs on ONNX Runtime's CPU provider there, on the images this process passes through a .npz file.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.fileio import temp_path
from qatpipe.onnx_model import load_onnx_proto

log = logging.getLogger(__name__)

ENV_PYTHON = "QATPIPE_MODELOPT_PYTHON"
WORKER = Path(__file__).with_name("modelopt_worker.py")
METHODS = {"entropy": "entropy", "minmax": "max"}  # ours -> modelopt's calibration_method
TIMEOUT_S = 3 * 3600


def modelopt_python() -> Path:
    """The Python of Model Optimizer's environment (module docstring), or an error saying how to make one."""
    configured = os.environ.get(ENV_PYTHON)
    prefix = Path(sys.prefix)
    python = Path(configured) if configured else prefix.with_name(f"{prefix.name}-modelopt") / "bin" / "python"
    if not python.is_file():
        where = f"${ENV_PYTHON} ({configured})" if configured else f"{python} (no ${ENV_PYTHON} set)"
        raise QatpipeError(
            f"ptq.tool modelopt: no Model Optimizer environment at {where}. It needs its own environment "
            "(nvidia-modelopt[onnx] pins onnxruntime-gpu and torch): run `make modelopt`, or point "
            f"${ENV_PYTHON} at a Python with nvidia-modelopt[onnx] installed")
    return python


def quantize_modelopt(fp32_onnx: str | Path, output: str | Path, batches: Iterable[np.ndarray],
                      method: str) -> dict:
    """Calibrate on `batches` (NHWC float32, as the model reads them) by `method` (entropy, minmax) with Model
    Optimizer and write its INT8 Q/DQ model to `output`; the report has the versions that made it."""
    if method not in METHODS:
        raise QatpipeError(f"ptq.tool modelopt: calibration method {method!r} is not one of {', '.join(METHODS)}")
    fp32_onnx, output = Path(fp32_onnx), Path(output)
    input_name = load_onnx_proto(fp32_onnx).graph.input[0].name  # a missing or corrupt model fails here, naming it
    python = modelopt_python()
    arrays = [np.asarray(batch, np.float32) for batch in batches]
    if not arrays or not sum(len(array) for array in arrays):
        raise QatpipeError("post-training quantization got no calibration images")
    images = np.concatenate(arrays)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(output)
    started = time.monotonic()
    log.info("PTQ by Model Optimizer (%s, %s) on %d images, CPU calibration ...", method, python, len(images))
    try:
        with tempfile.TemporaryDirectory(prefix="qatpipe-modelopt-") as work:
            calibration = Path(work) / "calibration.npz"
            np.savez(calibration, **{input_name: images})
            # -I: the worker sees neither this process's PYTHONPATH nor its working folder, only its environment
            result = subprocess.run([str(python), "-I", str(WORKER), str(fp32_onnx), str(calibration),
                                     METHODS[method], str(tmp)], capture_output=True, text=True,
                                    timeout=TIMEOUT_S, cwd=work)
            if result.returncode != 0:
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                raise QatpipeError(f"{fp32_onnx}: Model Optimizer's PTQ failed (exit {result.returncode}): "
                                   + " | ".join(lines[-5:]))
            made = json.loads(Path(f"{tmp}.json").read_text())
        os.replace(tmp, output)
    except subprocess.TimeoutExpired:
        raise QatpipeError(f"{fp32_onnx}: Model Optimizer's PTQ ran past {TIMEOUT_S} s") from None
    finally:
        tmp.unlink(missing_ok=True)
        Path(f"{tmp}.json").unlink(missing_ok=True)
    log.info("PTQ by Model Optimizer %s (%s) calibrated on %d images in %.0f s: %s",
             made["versions"]["nvidia-modelopt"], method, len(images), time.monotonic() - started, output)
    return {"tool": "modelopt", "method": method, "calibration_images": int(len(images)), "onnx": str(output),
            "size_mb": round(output.stat().st_size / 2**20, 3), "versions": made["versions"]}


__all__ = ["quantize_modelopt", "modelopt_python"]
