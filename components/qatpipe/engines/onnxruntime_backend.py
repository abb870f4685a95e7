"""The portable engine: ONNX Runtime, CPU by default, CUDA / TensorRT execution providers when present.

Building writes the ONNX the runtime executes: for a Q/DQ model, the CPU form `engine.cpu_form` of
cpu_qdq.py (`exact`: the same numbers with uint8 activations; `fast`: BatchNormalization folded and ReLU
absorbed, for integer kernels), so that the CPU provider runs integer kernels where it can; the TensorRT
artifact itself stays symmetric int8.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import numpy as np

from qatpipe.engines.base import (EngineBackend, EngineMetadata, EngineRunner, file_sha256,
                                  is_explicitly_quantized)

log = logging.getLogger(__name__)

ENGINE_FILE = "model.onnx"
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class OnnxRuntimeRunner(EngineRunner):
    def __init__(self, path: Path, metadata: EngineMetadata, threads: int | None = None):
        import onnxruntime as ort

        from qatpipe.runtime.onnx_runtime import OnnxModel

        available = ort.get_available_providers()
        providers = [p for p in PREFERRED_PROVIDERS if p in available]
        self.model = OnnxModel(path, providers=providers, threads=threads)
        self.providers = self.model.session.get_providers()
        self.metadata = metadata

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        return self.model.run(batch)


class OnnxRuntimeBackend(EngineBackend):
    name = "onnxruntime"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None  # a dependency of qatpipe: always here

    def build(self, onnx_path: Path, folder: Path, settings) -> EngineMetadata:
        import onnxruntime as ort

        from qatpipe.engines.cpu_qdq import (activations_to_uint8, fold_batch_norms, merge_requantization,
                                             quantize_conv_biases, quantize_residual_conv_outputs)
        from qatpipe.export.onnx_export import save_onnx
        from qatpipe.runtime.onnx_runtime import load_onnx_proto

        model = load_onnx_proto(onnx_path)
        providers = [p for p in PREFERRED_PROVIDERS if p in ort.get_available_providers()]
        # the CPU forms suit the CPU provider; TensorRT / CUDA providers take TensorRT's symmetric int8 as is
        quantized = is_explicitly_quantized(onnx_path) and providers[0] == "CPUExecutionProvider"
        fast = settings.cpu_form == "fast"
        folded = fold_batch_norms(model) if quantized and fast else 0
        residual = quantize_residual_conv_outputs(model) if quantized and fast else 0
        shifted = activations_to_uint8(model, zero_point_0_after_relu=fast) if quantized else 0
        requantizations = merge_requantization(model) if quantized and fast else 0
        biases = quantize_conv_biases(model) if quantized and fast else 0
        folder.mkdir(parents=True, exist_ok=True)
        save_onnx(model, folder / ENGINE_FILE)
        metadata = EngineMetadata(
            backend=self.name, engine_file=ENGINE_FILE, source_onnx=str(onnx_path),
            source_sha256=file_sha256(onnx_path),
            precision=(f"int8 (explicit Q/DQ, CPU form {settings.cpu_form})" if quantized else
                       "int8 (explicit Q/DQ)" if is_explicitly_quantized(onnx_path) else "fp32"),
            runtime_version=ort.__version__, device=_cpu_name() if providers[0] == "CPUExecutionProvider"
            else providers[0], input_name=model.graph.input[0].name,
            batch_profile={"min": settings.min_batch, "opt": settings.opt_batch, "max": settings.max_batch},
            extra={"batch_norms_folded": folded, "activation_qdq_shifted_to_uint8": shifted,
                   "requantizations_merged": requantizations, "biases_quantized": biases,
                   "residual_conv_outputs_quantized": residual},
        )
        metadata.write(folder)
        log.info("ONNX Runtime engine: %s (%s)", folder / ENGINE_FILE, metadata.precision)
        return metadata

    def load(self, folder: Path, metadata: EngineMetadata) -> EngineRunner:
        return OnnxRuntimeRunner(folder / metadata.engine_file, metadata)
