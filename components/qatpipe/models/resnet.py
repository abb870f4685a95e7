"""ResNet backbones of TAO's DetectNet_v2: stride 16, configurable depth and width.

Layer names follow TAO (`conv1`, `block_2a_conv_1`, `block_2a_bn_shortcut`, ...) so that pruning and
quantization rules can address layers by name, and TAO's pretrained ResNet files load by name
(docs/pretrained.md).
"""

from __future__ import annotations

import re

import tf_keras as keras

from qatpipe.models.blocks import MIN_FILTERS, bn, conv

BLOCKS_PER_STAGE = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}
STAGE_FILTERS = (64, 128, 256, 512)
# conv1 /2, max-pool /2, stage 2 /2, stage 3 /2; stage 4 keeps stride 1 (TAO's DetectNet_v2) -> /16
STAGE_STRIDES = (1, 2, 2, 1)
STEM_LAYERS = ("conv1", "bn_conv1", "activation_1", "max_pool_1")
# model.freeze_blocks, TAO's numbers: 0 the stem (conv1, bn_conv1), 1-4 the four stages (block_1a_* ...)
FREEZE_BLOCKS = (0, 1, 2, 3, 4)
_STAGE_LAYER = re.compile(r"^block_(\d)[a-z]_")


def _basic_block(x, filters, strides, name, regularizer, projection):
    shortcut = x
    y = conv(filters, 3, strides, f"{name}_conv_1", regularizer)(x)
    y = bn(f"{name}_bn_1")(y)
    y = keras.layers.Activation("relu", name=f"{name}_relu_1")(y)
    y = conv(filters, 3, 1, f"{name}_conv_2", regularizer)(y)
    y = bn(f"{name}_bn_2")(y)
    if projection or strides != 1 or x.shape[-1] != filters:
        shortcut = conv(filters, 1, strides, f"{name}_conv_shortcut", regularizer)(x)
        shortcut = bn(f"{name}_bn_shortcut")(shortcut)
    y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
    return keras.layers.Activation("relu", name=f"{name}_relu")(y)


def resnet_backbone(inputs, depth: int, width: float, regularizer=None, all_projections: bool = True):
    """Feature map at stride 16 of `inputs` (NHWC float in [0, 1])."""
    if depth not in BLOCKS_PER_STAGE:
        raise ValueError(f"ResNet depth must be one of {sorted(BLOCKS_PER_STAGE)}, got {depth}")
    # ResNet's own rounding (TAO's): down to a multiple of 8, at least MIN_FILTERS
    filters = [max(MIN_FILTERS, int(round(f * width / 8)) * 8) for f in STAGE_FILTERS]
    conv_name, bn_name, relu_name, pool_name = STEM_LAYERS
    x = conv(filters[0], 7, 2, conv_name, regularizer)(inputs)
    x = bn(bn_name)(x)
    x = keras.layers.Activation("relu", name=relu_name)(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name=pool_name)(x)
    for stage, (blocks, stage_filters, stride) in enumerate(
        zip(BLOCKS_PER_STAGE[depth], filters, STAGE_STRIDES), start=1
    ):
        for block in range(blocks):
            name = f"block_{stage}{chr(ord('a') + block)}"
            x = _basic_block(
                x, stage_filters, stride if block == 0 else 1, name, regularizer,
                projection=all_projections,
            )
    return x


def build(inputs, backbone, regularizer):
    """The registry's entry (models/backbones.py): `backbone` is the spec's model.backbone."""
    return resnet_backbone(inputs, backbone.depth, backbone.width, regularizer, backbone.all_projections)


def block_of(layer_name: str) -> int | None:
    """The freeze_blocks number of a backbone layer; None for a layer outside the backbone."""
    if layer_name in STEM_LAYERS:
        return 0
    match = _STAGE_LAYER.match(layer_name)
    return int(match.group(1)) if match else None


def label(backbone) -> str:
    return f"resnet{backbone.depth}"
