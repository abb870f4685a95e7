"""Inference engines behind one interface: TensorRT where it and a GPU are present, ONNX Runtime anywhere."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from qatpipe.engines.base import EngineBackend, EngineMetadata, EngineRunner
from qatpipe.errors import QatpipeError
from qatpipe.spec.registries import BACKENDS  # engine.backend -> "module:class", on the spec's floor (it checks names)

log = logging.getLogger(__name__)


def backends() -> dict[str, type[EngineBackend]]:
    found = {}
    for name, where in BACKENDS.items():
        module, cls = where.split(":")
        found[name] = getattr(importlib.import_module(module), cls)
    return found


def select_backend(name: str = "auto") -> EngineBackend:
    """`auto`: TensorRT when it is importable and a GPU is visible, else ONNX Runtime (saying why)."""
    available = backends()
    if name == "auto":
        reason = available["tensorrt"].unavailable_reason()
        if reason is None:
            return available["tensorrt"]()
        log.info("engine backend: onnxruntime (TensorRT not used: %s)", reason)
        return available["onnxruntime"]()
    if name not in available:
        raise QatpipeError(f"unknown engine backend {name!r}: one of auto, {', '.join(available)}")
    reason = available[name].unavailable_reason()
    if reason is not None:
        raise QatpipeError(f"engine backend {name} is not available here: {reason}")
    return available[name]()


def load_engine(folder: str | Path) -> EngineRunner:
    """The engine in `folder` (built by `qatpipe build-engine`), on the backend that built it."""
    folder = Path(folder)
    metadata = EngineMetadata.read(folder)
    if metadata.backend not in backends():
        raise QatpipeError(f"{folder}: unknown engine backend {metadata.backend!r}")
    return backends()[metadata.backend]().load(folder, metadata)


__all__ = ["BACKENDS", "EngineBackend", "EngineMetadata", "EngineRunner", "load_engine", "select_backend"]
