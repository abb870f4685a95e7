"""Detector architectures, looked up by `model.arch` in the spec's registry (spec.ARCHITECTURES)."""

from __future__ import annotations

import importlib

from qatpipe.errors import SpecError
from qatpipe.models.base import Detections, DetectorArchitecture
from qatpipe.spec import ARCHITECTURES, ExperimentSpec


def architecture_class(arch: str) -> type[DetectorArchitecture]:
    """The DetectorArchitecture of model.arch `arch`, imported here: TensorFlow loads only when a stage needs one."""
    row = ARCHITECTURES.get(arch)
    if row is None:
        raise SpecError(f"model.arch: {arch!r} is not an architecture: one of {', '.join(ARCHITECTURES)}")
    module, name = row.implementation.split(":")
    return getattr(importlib.import_module(module), name)


def get_architecture(spec: ExperimentSpec) -> DetectorArchitecture:
    return architecture_class(spec.model.arch)(spec)


__all__ = ["Detections", "DetectorArchitecture", "architecture_class", "get_architecture"]
