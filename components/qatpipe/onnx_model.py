"""An ONNX detector in ONNX Runtime: CPU by default, CUDA when the installed build and machine have it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qatpipe.errors import ModelFileError

# ONNX Runtime's execution providers in the order qatpipe prefers them, where the installed build has them.
# Scoring and checks run the graph as written: CUDA, else CPU. An engine may also take TensorRT's provider,
# which builds a TensorRT engine from the Q/DQ graph (engines/onnxruntime_backend.py).
MODEL_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
ENGINE_PROVIDERS = ("TensorrtExecutionProvider", *MODEL_PROVIDERS)
# metadata_props key of a PTQ model: what quantized it ("modelopt 0.47.0, entropy"; stages/ptq.py writes it)
QUANTIZED_BY_KEY = "qatpipe.quantized_by"


def available_providers(preferred: tuple[str, ...] = MODEL_PROVIDERS) -> list[str]:
    """The providers of `preferred` that the installed ONNX Runtime has, in that order."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    return [provider for provider in preferred if provider in available]


def check_onnx_file(path: str | Path) -> Path:
    """`path`, when it is there and named as an ONNX model; else a ModelFileError saying what is wrong. Cheap (it
    reads nothing), so a command checks its inputs with it before any work."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: model file not found")
    if path.suffix.lower() != ".onnx":
        raise ModelFileError(f"{path}: not an ONNX model file (expected .onnx; export a Keras model first)")
    return path


def load_onnx_proto(path: str | Path):
    """The ONNX graph in `path`, with the errors of OnnxModel for a missing, wrong-kind or corrupt file."""
    import onnx

    path = check_onnx_file(path)
    try:
        return onnx.load(path, load_external_data=False)
    except Exception as exc:  # protobuf DecodeError and friends
        raise ModelFileError(f"{path}: not a loadable ONNX model: {type(exc).__name__}: {exc}") from None


class OnnxModel:
    """`run(batch)` -> {output name: array}, with graph optimisation on (Q/DQ fused where ORT can)."""

    def __init__(self, path: str | Path, providers: list[str] | None = None, threads: int | None = None):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise ModelFileError(f"{path}: model file not found")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
        providers = providers or available_providers()
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # ORT raises InvalidGraph / InvalidProtobuf / Fail for bad files
            raise ModelFileError(f"{path}: not a loadable ONNX model: {type(exc).__name__}: {exc}") from None
        self.path = path
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [o.name for o in self.session.get_outputs()]

    @property
    def input_shape(self) -> list:
        return self.session.get_inputs()[0].shape

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        outputs = self.session.run(self.output_names, {self.input_name: np.asarray(batch, np.float32)})
        return dict(zip(self.output_names, outputs))
