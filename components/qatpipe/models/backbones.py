"""The backbones DetectNet_v2 can use, by `model.backbone.name`. Each is a module with
`build(inputs, backbone_spec, regularizer) -> stride-16 feature map` (standard tf_keras layers only, so a
saved model loads without custom objects), `label(backbone_spec) -> str` (the model's name), and, for
pretrained weights (models/pretrained.py, docs/pretrained.md), `FREEZE_BLOCKS` (the numbers
`model.freeze_blocks` may name), `block_of(layer_name) -> int | None` (a backbone layer's block; None outside
the backbone) and optionally `KERAS_APPLICATION` (where `keras:imagenet` takes its weights). Adding a backbone
is one module and one line of BACKBONES in spec/registries.py (on the spec's floor, so the spec checks a name
without importing from above it); this module, the tests and bench/backbones.py read that registry."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from qatpipe.spec.registries import BACKBONES


def backbone_module(name: str):
    return importlib.import_module(BACKBONES[name])


@dataclass(frozen=True)
class KerasApplication:
    """A tf_keras.applications model with the backbone's layers, for `model.pretrained: keras:imagenet`."""

    build: Callable  # (width, weights) -> the applications model without its classifier top
    widths: tuple[float, ...]  # the widths (alpha) it has ImageNet weights for
    rename: Callable[[str], str]  # its layer name -> the backbone's
    preprocess: Callable  # an image in [0, 1] (qatpipe's input) -> what the applications model reads
    stem: tuple[str, str]  # the backbone's first conv and its batch norm (the input scaling folds into them)
