"""ResNet backbones of TAO's DetectNet_v2: stride 16, configurable depth and width.

Layer names follow TAO (`conv1`, `block_2a_conv_1`, `block_2a_bn_shortcut`, ...) so that pruning and
quantization rules can address layers by name.
"""

from __future__ import annotations

import tf_keras as keras

from qatpipe.models.blocks import MIN_FILTERS, bn, conv

BLOCKS_PER_STAGE = {10: (1, 1, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}
STAGE_FILTERS = (64, 128, 256, 512)
# conv1 /2, max-pool /2, stage 2 /2, stage 3 /2; stage 4 keeps stride 1 (TAO's DetectNet_v2) -> /16
STAGE_STRIDES = (1, 2, 2, 1)


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
    x = conv(filters[0], 7, 2, "conv1", regularizer)(inputs)
    x = bn("bn_conv1")(x)
    x = keras.layers.Activation("relu", name="activation_1")(x)
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name="max_pool_1")(x)
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


def label(backbone) -> str:
    return f"resnet{backbone.depth}"
