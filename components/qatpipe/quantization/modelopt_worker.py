"""Run inside NVIDIA Model Optimizer's own environment (quantization/modelopt_ptq.py starts it by path): INT8 PTQ
of an FP32 ONNX with modelopt.onnx.quantization, calibrated on CPU. Imports nothing of qatpipe, whose
environment it does not share (modelopt pins onnxruntime-gpu and torch).

    python modelopt_worker.py FP32_ONNX CALIBRATION_NPZ METHOD OUTPUT_ONNX

Writes OUTPUT_ONNX and, beside it, OUTPUT_ONNX.json with the versions that made it; exits 1 naming the failure.
"""

from __future__ import annotations

import json
import logging
import sys
from importlib.metadata import version


def main(fp32_onnx: str, calibration_npz: str, method: str, output: str) -> None:
    import numpy as np
    from modelopt.onnx.quantization import quantize

    with np.load(calibration_npz) as data:
        calibration = {name: data[name] for name in data.files}
    quantize(
        fp32_onnx, quantize_mode="int8", calibration_data=calibration, calibration_method=method,
        calibration_eps=["cpu"],  # CPU calibration: ONNX Runtime's CPU provider, wherever this runs
        high_precision_dtype="fp32",  # the float regions stay FP32, as the other variants' (FP16 is export's form)
        dq_only=True,  # weights stored int8 behind DequantizeLinear, what TensorRT's weight DQ expects
        output_path=output, log_level="WARNING")
    versions = {package: version(package) for package in ("nvidia-modelopt", "onnx")}
    versions["onnxruntime"] = __import__("onnxruntime").__version__
    with open(f"{output}.json", "w") as handle:
        json.dump({"versions": versions, "method": method}, handle)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    try:
        main(*sys.argv[1:])
    except Exception as exc:  # the parent reports it, naming the model
        print(f"modelopt PTQ failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
