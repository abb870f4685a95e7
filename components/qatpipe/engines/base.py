"""The engine interface every backend implements: build an engine from an ONNX model, load it, run it.

An engine is a folder: the backend's file (`model.engine` for TensorRT, `model.onnx` for ONNX Runtime) and
`engine.json`, the metadata that says what it was built from, with what and for which device.
"""

from __future__ import annotations

import abc
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qatpipe.errors import ModelFileError

METADATA_FILE = "engine.json"


@dataclass
class EngineMetadata:
    backend: str
    engine_file: str  # relative to the engine folder
    source_onnx: str
    source_sha256: str
    precision: str  # "int8 (explicit Q/DQ)", "fp16", "tf32", "fp32"
    runtime_version: str  # TensorRT or ONNX Runtime version that built it
    device: str  # GPU name, or the CPU
    input_name: str
    batch_profile: dict  # min / opt / max batch
    built_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    extra: dict = field(default_factory=dict)
    label: str = ""  # what the engine is, for tables: "onnxruntime cpu int8", "tensorrt fp16"
    layer_precision: dict = field(default_factory=dict)  # compute layers per precision: {"int8": n, ...}

    def __post_init__(self):
        if not self.label:  # engine.json written before labels: the backend and the precision's first word
            self.label = engine_label(self.backend, "", self.precision)

    def write(self, folder: Path) -> Path:
        path = Path(folder) / METADATA_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, folder: str | Path) -> "EngineMetadata":
        path = Path(folder) / METADATA_FILE
        if not Path(folder).is_dir():
            raise ModelFileError(f"{folder}: engine folder not found")
        if not path.is_file():
            raise ModelFileError(f"{folder}: not an engine folder (no {METADATA_FILE}; build one with "
                                 "`qatpipe build-engine`)")
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:
            raise ModelFileError(f"{path}: unreadable engine metadata: {exc}") from None


class EngineRunner(abc.ABC):
    """A loaded engine: NHWC float32 batch in, {output name: array} out."""

    metadata: EngineMetadata

    @abc.abstractmethod
    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]: ...


class EngineBackend(abc.ABC):
    name: str

    @classmethod
    @abc.abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can build and run engines here, else why not."""

    @abc.abstractmethod
    def build(self, onnx_path: Path, folder: Path, settings) -> EngineMetadata:
        """Build an engine for `onnx_path` into `folder` (settings: the spec's EngineSpec)."""

    @abc.abstractmethod
    def load(self, folder: Path, metadata: EngineMetadata) -> EngineRunner: ...


def engine_label(backend: str, device_kind: str, precision: str) -> str:
    """`backend [device kind] precision` with the precision's first word: "onnxruntime cpu int8", "tensorrt fp16"."""
    return " ".join(part for part in (backend, device_kind, precision.split()[0] if precision else "") if part)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_explicitly_quantized(model) -> bool:
    """Whether an ONNX model (a loaded ModelProto) carries Q/DQ."""
    return any(node.op_type == "QuantizeLinear" for node in model.graph.node)
