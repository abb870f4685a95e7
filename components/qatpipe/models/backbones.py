"""The backbones DetectNet_v2 can use, by `model.backbone.name`. Each is a module with
`build(inputs, backbone_spec, regularizer) -> stride-16 feature map` (standard tf_keras layers only, so a
saved model loads without custom objects) and `label(backbone_spec) -> str` (the model's name). Adding a
backbone is one module and one line here. Modules are named, not imported: the spec validates names without
loading TensorFlow."""

from __future__ import annotations

import importlib

BACKBONES = {
    "resnet": "qatpipe.models.resnet",
    "mobilenet_v2": "qatpipe.models.mobilenet_v2",
    "efficientnet_b0": "qatpipe.models.efficientnet",
}


def backbone_module(name: str):
    return importlib.import_module(BACKBONES[name])
