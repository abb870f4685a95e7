"""MobileNetV2 (Sandler et al. 2018) as a stride-16 DetectNet_v2 backbone: inverted residual blocks of a 1x1
expand conv, a 3x3 depthwise conv and a linear 1x1 project conv, ReLU6 between, residual adds where the shape
allows. The two stages that would take the stride to 32 (160 and 320 channels) keep stride 1, as TAO's
DetectNet_v2 templates do for their last stage, so the heads see a /16 grid.

Layer names follow Keras Applications (`Conv1`, `block_3_expand`, `block_3_depthwise_BN`, `block_3_add`).
`model.backbone.width` is the width multiplier (alpha).
"""

from __future__ import annotations

import tf_keras as keras

from qatpipe.models.blocks import bn, conv, depthwise, scaled_filters

# expansion t, output channels c, repeats n, first stride s; the 160-channel stage's stride 2 is 1 here
STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 1),
          (6, 320, 1, 1))
STEM_FILTERS = 32


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
    x = conv(scaled_filters(STEM_FILTERS, backbone.width), 3, 2, "Conv1", regularizer)(inputs)
    x = bn("bn_Conv1")(x)
    x = _relu6("Conv1_relu")(x)
    block = 0
    for expansion, filters, repeats, stride in STAGES:
        for repeat in range(repeats):
            x = _inverted_residual(x, expansion, scaled_filters(filters, backbone.width),
                                   stride if repeat == 0 else 1, block, regularizer)
            block += 1
    return x


def label(backbone) -> str:
    return f"mobilenet_v2_{backbone.width:g}"
