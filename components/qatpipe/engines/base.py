"""The engine interface every backend implements: build an engine from an ONNX model, load it, run it.

An engine is a folder: the backend's file (`model.engine` for TensorRT, `model.onnx` for ONNX Runtime) and
`engine.json`, the metadata that says what it was built from, with what and for which device. Each backend also
says which of an export's files it builds from (`EngineBackend.source`).
"""

from __future__ import annotations

import abc
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qatpipe.errors import ModelFileError

METADATA_FILE = "engine.json"


PRECISIONS = ("int8", "fp16", "tf32", "fp32")  # what an engine computes its layers in (compute_precision)


@dataclass
class EngineMetadata:
    backend: str
    engine_file: str  # relative to the engine folder
    source_onnx: str
    source_sha256: str
    precision: str  # for people: "int8 (explicit Q/DQ, CPU form fast)", "fp16 (explicit casts, ...)", "tf32"
    runtime_version: str  # TensorRT or ONNX Runtime version that built it
    device: str  # GPU name, or the CPU
    input_name: str
    batch_profile: dict  # min / opt / max batch
    built_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    extra: dict = field(default_factory=dict)
    label: str = ""  # what the engine is, for tables: "onnxruntime cpu int8", "tensorrt fp16"
    layer_precision: dict = field(default_factory=dict)  # compute layers per precision: {"int8": n, ...}
    compute_precision: str = ""  # for code: one of PRECISIONS
    cpu_form: str | None = None  # an ONNX Runtime CPU engine of a Q/DQ model: its form ("exact", "fast"); else None
    build_key: str = ""  # the backend, source bytes and engine settings it was built from (build_engine's build_key)

    def __post_init__(self):
        # engine.json written before these fields: they are what its precision string said
        if not self.compute_precision:
            self.compute_precision = self.precision.split()[0] if self.precision else ""
        if self.cpu_form is None and "CPU form " in self.precision:
            self.cpu_form = self.precision.split("CPU form ", 1)[1].split(")")[0].split(",")[0].strip()
        if not self.label:  # engine.json written before labels: the backend and its compute precision
            self.label = engine_label(self.backend, "", self.compute_precision)

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

    @classmethod
    def source(cls, bundle, settings) -> Path:
        """The file of the export `bundle` (export/bundle.ExportBundle) this backend builds an engine from, under
        `settings` (the spec's EngineSpec): the export's ONNX unless a backend says otherwise."""
        return bundle.onnx

    @classmethod
    @abc.abstractmethod
    def device(cls) -> str:
        """The device an engine built here now is for (its EngineMetadata.device)."""

    @abc.abstractmethod
    def build(self, onnx_path: Path, folder: Path, settings) -> EngineMetadata:
        """Build an engine for `onnx_path` into `folder` (settings: the spec's EngineSpec)."""

    @abc.abstractmethod
    def load(self, folder: Path, metadata: EngineMetadata) -> EngineRunner: ...


def engine_label(backend: str, device_kind: str, compute_precision: str) -> str:
    """`backend [device kind] compute precision`: "onnxruntime cpu int8", "tensorrt fp16"."""
    return " ".join(part for part in (backend, device_kind, compute_precision) if part)


def is_explicitly_quantized(model) -> bool:
    """Whether an ONNX model (a loaded ModelProto) carries Q/DQ."""
    return any(node.op_type == "QuantizeLinear" for node in model.graph.node)
