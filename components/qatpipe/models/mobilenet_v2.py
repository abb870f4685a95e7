"""MobileNetV2 (Sandler et al. 2018) as a stride-16 DetectNet_v2 backbone: inverted residual blocks of a 1x1
expand conv, a 3x3 depthwise conv and a linear 1x1 project conv, ReLU6 between, residual adds where the shape
allows. The two stages that would take the stride to 32 (160 and 320 channels) keep stride 1, as TAO's
DetectNet_v2 templates do for their last stage, so the heads see a /16 grid.

Layer names follow Keras Applications (`Conv1`, `block_3_expand`, `block_3_depthwise_BN`, `block_3_add`), but
for the first block: Keras' `expanded_conv_*` is `block_0_*` here. `model.backbone.width` is the width
multiplier (alpha).
"""

from __future__ import annotations

import re

import tf_keras as keras

from qatpipe.models.backbones import KerasApplication
from qatpipe.models.blocks import bn, conv, depthwise, scaled_filters

# expansion t, output channels c, repeats n, first stride s; the 160-channel stage's stride 2 is 1 here
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 1),
          (6, 320, 1, 1))
STEM_FILTERS = 32
STEM_LAYERS = ("Conv1", "bn_Conv1", "Conv1_relu")
# model.freeze_blocks: 0 the stem (Conv1, bn_Conv1), 1-7 the seven stages of STAGES (block_0 is stage 1,
# block_1-2 stage 2, block_3-5 stage 3, block_6-9 stage 4, block_10-12 stage 5, block_13-15 stage 6, block_16 7)
FREEZE_BLOCKS = tuple(range(len(STAGES) + 1))
_STAGE_OF_BLOCK = [stage for stage, (_, _, repeats, _) in enumerate(STAGES, start=1) for _ in range(repeats)]
_BLOCK_LAYER = re.compile(r"^block_(\d+)_")


def _relu6(name):
    return keras.layers.ReLU(6.0, name=name)


def _inverted_residual(x, expansion, filters, stride, block, regularizer):
    prefix = f"block_{block}_"
    channels = x.shape[-1]
    y = x
    if expansion != 1:
        y = conv(channels * expansion, 1, 1, prefix + "expand", regularizer)(y)
        y = bn(prefix + "expand_BN")(y)
        y = _relu6(prefix + "expand_relu")(y)
    y = depthwise(3, stride, prefix + "depthwise", regularizer)(y)
    y = bn(prefix + "depthwise_BN")(y)
    y = _relu6(prefix + "depthwise_relu")(y)
    y = conv(filters, 1, 1, prefix + "project", regularizer)(y)
    y = bn(prefix + "project_BN")(y)  # linear bottleneck: no activation
    if stride == 1 and channels == filters:
        y = keras.layers.Add(name=prefix + "add")([y, x])
    return y


def build(inputs, backbone, regularizer):
    """Feature map at stride 16 of `inputs`; `backbone` is the spec's model.backbone."""
    conv_name, bn_name, relu_name = STEM_LAYERS
    x = conv(scaled_filters(STEM_FILTERS, backbone.width), 3, 2, conv_name, regularizer)(inputs)
    x = bn(bn_name)(x)
    x = _relu6(relu_name)(x)
    block = 0
    for expansion, filters, repeats, stride in STAGES:
        for repeat in range(repeats):
            x = _inverted_residual(x, expansion, scaled_filters(filters, backbone.width),
                                   stride if repeat == 0 else 1, block, regularizer)
            block += 1
    return x


def block_of(layer_name: str) -> int | None:
    """The freeze_blocks number of a backbone layer; None for a layer outside the backbone."""
    if layer_name in STEM_LAYERS:
        return 0
    match = _BLOCK_LAYER.match(layer_name)
    if match and int(match.group(1)) < len(_STAGE_OF_BLOCK):
        return _STAGE_OF_BLOCK[int(match.group(1))]
    return None


def _from_keras_name(name: str) -> str:
    return "block_0_" + name[len("expanded_conv_"):] if name.startswith("expanded_conv_") else name


# keras:imagenet: Keras' MobileNetV2 reads images in [-1, 1] (its preprocess_input); its last 1x1 conv
# (Conv_1, 1280 channels) has no layer here
KERAS_APPLICATION = KerasApplication(
    build=lambda width, weights: keras.applications.MobileNetV2(
        input_shape=(224, 224, 3), alpha=width, include_top=False, weights=weights),
    widths=(0.35, 0.5, 0.75, 1.0, 1.3, 1.4), rename=_from_keras_name, preprocess=lambda image: 2.0 * image - 1.0,
    stem=STEM_LAYERS[:2],
)


def label(backbone) -> str:
    return f"mobilenet_v2_{backbone.width:g}"
