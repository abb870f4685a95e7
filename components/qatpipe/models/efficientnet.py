"""EfficientNet-B0 (Tan and Le 2019) as a stride-16 DetectNet_v2 backbone: MBConv blocks of a 1x1 expand conv,
a depthwise conv, squeeze-excitation and a linear 1x1 project conv, with SiLU (Swish) activations. The
192-channel stage, which would take the stride to 32, keeps stride 1 so the heads see a /16 grid; the 1280-
channel classification head conv is left out (DetectNet_v2's heads read the 320 channels).

Squeeze-excitation as Keras Applications builds it, from standard layers: GlobalAveragePooling2D (keepdims),
a 1x1 reduce conv (SiLU), a 1x1 expand conv (sigmoid) and a Multiply with the block's features. Layer names
follow Keras Applications (`stem_conv`, `block2a_expand_conv`, `block2a_se_excite`, `block2a_add`); stochastic
depth is left out. `model.backbone.width` multiplies every filter count (EfficientNet's width coefficient).
"""

from __future__ import annotations

import tf_keras as keras

from qatpipe.models.blocks import bn, conv, depthwise, scaled_filters

# kernel, expansion, output channels, repeats, first stride; the 192-channel stage's stride 2 is 1 here
STAGES = ((3, 1, 16, 1, 1), (3, 6, 24, 2, 2), (5, 6, 40, 2, 2), (3, 6, 80, 3, 2), (5, 6, 112, 3, 1),
          (5, 6, 192, 4, 1), (3, 6, 320, 1, 1))
STEM_FILTERS = 32
SE_RATIO = 0.25


def _mbconv(x, kernel, expansion, filters, stride, name, regularizer):
    channels = x.shape[-1]
    y = x
    if expansion != 1:
        y = conv(channels * expansion, 1, 1, f"{name}expand_conv", regularizer)(y)
        y = bn(f"{name}expand_bn")(y)
        y = keras.layers.Activation("swish", name=f"{name}expand_activation")(y)
    y = depthwise(kernel, stride, f"{name}dwconv", regularizer)(y)
    y = bn(f"{name}bn")(y)
    y = keras.layers.Activation("swish", name=f"{name}activation")(y)
    # squeeze-excitation: the reduction is relative to the block's input channels
    se = keras.layers.GlobalAveragePooling2D(keepdims=True, name=f"{name}se_squeeze")(y)
    se = conv(max(1, int(channels * SE_RATIO)), 1, 1, f"{name}se_reduce", regularizer, use_bias=True)(se)
    se = keras.layers.Activation("swish", name=f"{name}se_reduce_activation")(se)
    se = conv(y.shape[-1], 1, 1, f"{name}se_expand", regularizer, use_bias=True)(se)
    se = keras.layers.Activation("sigmoid", name=f"{name}se_expand_activation")(se)
    y = keras.layers.Multiply(name=f"{name}se_excite")([y, se])
    y = conv(filters, 1, 1, f"{name}project_conv", regularizer)(y)
    y = bn(f"{name}project_bn")(y)
    if stride == 1 and channels == filters:
        y = keras.layers.Add(name=f"{name}add")([y, x])
    return y


def build(inputs, backbone, regularizer):
    """Feature map at stride 16 of `inputs`; `backbone` is the spec's model.backbone."""
    x = conv(scaled_filters(STEM_FILTERS, backbone.width), 3, 2, "stem_conv", regularizer)(inputs)
    x = bn("stem_bn")(x)
    x = keras.layers.Activation("swish", name="stem_activation")(x)
    for stage, (kernel, expansion, filters, repeats, stride) in enumerate(STAGES, start=1):
        for repeat in range(repeats):
            name = f"block{stage}{chr(ord('a') + repeat)}_"
            x = _mbconv(x, kernel, expansion, scaled_filters(filters, backbone.width),
                        stride if repeat == 0 else 1, name, regularizer)
    return x


def label(backbone) -> str:
    return f"efficientnet_b0_{backbone.width:g}"
