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

import re

import tf_keras as keras

from qatpipe.models.backbones import KerasApplication
from qatpipe.models.blocks import bn, conv, depthwise, scaled_filters

# kernel, expansion, output channels, repeats, first stride; the 192-channel stage's stride 2 is 1 here
STAGES = ((3, 1, 16, 1, 1), (3, 6, 24, 2, 2), (5, 6, 40, 2, 2), (3, 6, 80, 3, 2), (5, 6, 112, 3, 1),
          (5, 6, 192, 4, 1), (3, 6, 320, 1, 1))
STEM_FILTERS = 32
SE_RATIO = 0.25
STEM_LAYERS = ("stem_conv", "stem_bn", "stem_activation")
# model.freeze_blocks: 0 the stem (stem_conv, stem_bn), 1-7 the seven stages of STAGES (block1a_* .. block7a_*)
FREEZE_BLOCKS = tuple(range(len(STAGES) + 1))
_STAGE_LAYER = re.compile(r"^block(\d+)[a-z]+_")


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
    conv_name, bn_name, activation_name = STEM_LAYERS
    x = conv(scaled_filters(STEM_FILTERS, backbone.width), 3, 2, conv_name, regularizer)(inputs)
    x = bn(bn_name)(x)
    x = keras.layers.Activation("swish", name=activation_name)(x)
    for stage, (kernel, expansion, filters, repeats, stride) in enumerate(STAGES, start=1):
        for repeat in range(repeats):
            name = f"block{stage}{chr(ord('a') + repeat)}_"
            x = _mbconv(x, kernel, expansion, scaled_filters(filters, backbone.width),
                        stride if repeat == 0 else 1, name, regularizer)
    return x


def block_of(layer_name: str) -> int | None:
    """The freeze_blocks number of a backbone layer; None for a layer outside the backbone."""
    if layer_name in STEM_LAYERS:
        return 0
    match = _STAGE_LAYER.match(layer_name)
    return int(match.group(1)) if match and 1 <= int(match.group(1)) <= len(STAGES) else None


# keras:imagenet: Keras' EfficientNetB0 has the same layer names and reads images in [0, 255] (its own
# Rescaling and Normalization layers, which have no layer here, nor have top_conv and top_bn)
KERAS_APPLICATION = KerasApplication(
    build=lambda width, weights: keras.applications.EfficientNetB0(
        input_shape=(224, 224, 3), include_top=False, weights=weights),
    widths=(1.0,), rename=lambda name: name, preprocess=lambda image: 255.0 * image, stem=STEM_LAYERS[:2],
)


def label(backbone) -> str:
    return f"efficientnet_b0_{backbone.width:g}"
