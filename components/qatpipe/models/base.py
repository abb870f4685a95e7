"""The contract every detector architecture implements: everything that varies by `model.arch` is here.

An architecture owns the things that must agree with each other: the Keras model, the target encoder
(ground truth -> training targets, in TensorFlow so it runs inside tf.data), the losses, the decoder
(raw outputs -> boxes, in NumPy so it runs on any backend's outputs: TF, ONNX Runtime, TensorRT), the decoding
record its export carries for the engines and DeepStream (models/decoding.py), its DeepStream nvinfer layout, and
the spec keys a training checkpoint depends on. Its spec section and the row that names it are in
spec/architectures.py's ARCHITECTURES; stages, export, engines and deploy ask the architecture, never its name.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np

from qatpipe.errors import QatpipeError

# every architecture's image input (NHWC float32 RGB in [0, 1]), named as TAO names it: the ONNX export, the
# calibration cache and DeepStream's config all refer to it by this name
INPUT_NAME = "input_1"


@dataclass
class Detections:
    """Boxes of one image: x1 y1 x2 y2 pixels, a score and a class id each."""

    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    scores: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.float32))
    classes: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.int32))

    def __len__(self) -> int:
        return len(self.scores)

    def scaled(self, sx: float, sy: float) -> "Detections":
        return Detections(self.boxes * np.array([sx, sy, sx, sy], np.float32), self.scores, self.classes)


class DetectorArchitecture(abc.ABC):
    """One detection architecture, configured from the spec."""

    #: names of the model outputs, in the order the Keras model returns them
    output_names: tuple[str, ...]
    #: the network input, (height, width) in pixels, and how many input pixels one output cell spans
    input_hw: tuple[int, int]
    stride: int
    #: the spec keys (dotted) a training checkpoint of this architecture depends on beyond those of every
    #: architecture (stages/train.py): resuming across a change of one is refused
    resume_keys: ClassVar[tuple[str, ...]] = ()
    #: spec keys (dotted) added after checkpoints were written -> the value a spec.yaml without them trained with
    keys_added_later: ClassVar[dict[str, Any]] = {}

    @abc.abstractmethod
    def build_model(self):
        """A tf_keras Functional model from standard layers only (loads without custom objects)."""

    @abc.abstractmethod
    def encode(self, boxes, classes) -> dict:
        """TF ops: padded boxes (M,4) in input pixels and class ids (M,), -1 for padding -> targets per output."""

    @abc.abstractmethod
    def losses(self) -> dict[str, Callable]:
        """Keras loss per output name, matching `encode`'s targets."""

    def distill_losses(self) -> dict[str, Callable]:
        """Distillation terms per output name (QAT's `qat.distill_weight`): each `term(teacher, student)` takes
        two dicts output name -> batched output, the frozen teacher's and the trained model's, and returns a
        scalar that is 0 where the student equals the teacher (models/distill.py: the forms)."""
        raise NotImplementedError(f"{type(self).__name__} has no distillation losses")

    @abc.abstractmethod
    def check_model(self, model, source: str) -> None:
        """Raise ModelFileError (naming `source`) if `model` does not fit this spec (input size, classes)."""

    @abc.abstractmethod
    def decode(self, outputs: dict[str, np.ndarray]) -> list[Detections]:
        """Batched raw outputs (NumPy) -> detections per image, in network input pixels."""

    def decoding(self):
        """The decoding record (models/decoding.py) an export carries for the engine backends and DeepStream; None
        (the default): the engines output the heads as they are, which `decode` reads."""
        return None

    def nvinfer_layout(self):
        """How DeepStream's nvinfer runs this detector: an object with `description`, `onnx(model)` (the exported
        ONNX in the layout its parser reads), `labels(classes)` (labels.txt's lines, in the parser's class ids) and
        `properties()` / `class_attributes()` (the config lines that parser needs); deploy/deepstream.py writes the
        config around it."""
        raise QatpipeError(f"{type(self).__name__}: no DeepStream nvinfer layout for this architecture")
