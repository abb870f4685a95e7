"""Detector architectures, looked up by `model.arch` in the spec."""

from __future__ import annotations

from qatpipe.models.base import Detections, DetectorArchitecture
from qatpipe.spec import ExperimentSpec


def get_architecture(spec: ExperimentSpec) -> DetectorArchitecture:
    # Imported here: TensorFlow loads only when a stage needs a model.
    from qatpipe.models.detectnet_v2 import DetectNetV2
    from qatpipe.models.ssd import SSD

    architectures = {"detectnet_v2": DetectNetV2, "ssd": SSD}
    return architectures[spec.model.arch](spec)


__all__ = ["Detections", "DetectorArchitecture", "get_architecture"]
