"""The backbones DetectNet_v2 can use, by `model.backbone.name`. Each is a module with
`build(inputs, backbone_spec, regularizer) -> stride-16 feature map` (standard tf_keras layers only, so a
saved model loads without custom objects) and `label(backbone_spec) -> str` (the model's name). Adding a
backbone is one module and one line here: the spec's check, the tests and bench/backbones.py take the names from
this registry. Modules are named, not imported: the spec validates names without loading TensorFlow."""

from __future__ import annotations

import importlib

BACKBONES = {
    "resnet": "qatpipe.models.resnet",  # TAO's ResNet 10/18/34 (model.backbone.depth)
    "mobilenet_v2": "qatpipe.models.mobilenet_v2",  # depthwise, ReLU6
    "efficientnet_b0": "qatpipe.models.efficientnet",  # depthwise, SiLU, squeeze-excitation
}


def backbone_module(name: str):
    return importlib.import_module(BACKBONES[name])
