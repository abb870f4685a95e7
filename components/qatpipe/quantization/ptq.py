"""Post-training quantisation with ONNX Runtime: an FP32 ONNX -> an explicit-quantisation (Q/DQ) ONNX with
symmetric int8 activations (zero point 0) and per-channel symmetric int8 weights, which TensorRT builds as
a strongly typed INT8 engine and ONNX Runtime runs on CPU."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.fileio import temp_path
from qatpipe.runtime.onnx_runtime import load_onnx_proto

log = logging.getLogger(__name__)

METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


class BatchReader:
    """ONNX Runtime's CalibrationDataReader over NHWC float32 batches, one image per read: ORT's histogram
    calibrators stack the reads' outputs and fail on a short last batch."""

    def __init__(self, input_name: str, batches: Iterable[np.ndarray]):
        self.input_name = input_name
        self._images: Iterator[np.ndarray] = (image for batch in batches for image in np.asarray(batch, np.float32))
        self.images = 0

    def get_next(self):
        image = next(self._images, None)
        if image is None:
            return None
        self.images += 1
        return {self.input_name: image[None]}


def quantize_ptq(fp32_onnx: str | Path, output: str | Path, batches: Iterable[np.ndarray], method: str,
                 percentile: float = 99.99) -> dict:
    """Calibrate on `batches` by `method` (minmax, entropy, percentile) and write the Q/DQ model."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if method not in METHODS:
        raise QatpipeError(f"unknown calibration method {method!r}: one of {', '.join(METHODS)}")
    fp32_onnx, output = Path(fp32_onnx), Path(output)
    input_name = load_onnx_proto(fp32_onnx).graph.input[0].name
    output.parent.mkdir(parents=True, exist_ok=True)
    prepared, tmp = temp_path(output), temp_path(output)
    reader = BatchReader(input_name, batches)
    try:
        # shape inference and graph clean-up first, as ORT's quantisation guide asks
        quant_pre_process(str(fp32_onnx), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared), str(tmp), reader, quant_format=QuantFormat.QDQ, per_channel=True,
            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
            op_types_to_quantize=["Conv", "Gemm", "MatMul", "Add"],
            calibrate_method=getattr(CalibrationMethod, METHODS[method]),
            # float bias: TensorRT's ONNX parser rejects an int32 bias behind DequantizeLinear
            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "CalibPercentile": percentile,
                           "QuantizeBias": False},
        )
        os.replace(tmp, output)
    except QatpipeError:
        raise
    except Exception as exc:
        raise QatpipeError(f"{fp32_onnx}: post-training quantisation failed: {type(exc).__name__}: {exc}") from None
    finally:
        prepared.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    if reader.images == 0:
        raise QatpipeError("post-training quantisation got no calibration images")
    log.info("PTQ (%s) calibrated on %d images: %s", method, reader.images, output)
    return {"method": method, "calibration_images": reader.images, "onnx": str(output),
            "size_mb": round(output.stat().st_size / 2**20, 3)}
