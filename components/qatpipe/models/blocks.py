"""The layers every backbone and detection head is made of, configured once: bias-free convolutions
(BatchNormalization follows), TAO's BatchNormalization settings, filter counts rounded for int8 kernels, and the
spec's weight regulariser (model.regularizer)."""

from __future__ import annotations

import tf_keras as keras

# Multiples of 8 suit int8 kernels. At least 16: TensorFlow 2.21's oneDNN CPU kernels segfault while
# training 8-filter convolutions at 192x320; 16 filters train fine.
DIVISOR = 8
MIN_FILTERS = 16
BN_EPSILON = 1e-5  # TAO's; Keras Applications' 1e-3 is converted when their weights load (models/pretrained.py)


def scaled_filters(filters: int, width: float) -> int:
    """`filters` x `width`, rounded to the nearest multiple of 8 (never down by more than 10%, as MobileNet's
    and EfficientNet's rounding does), at least MIN_FILTERS."""
    scaled = filters * width
    rounded = max(DIVISOR, int(scaled + DIVISOR / 2) // DIVISOR * DIVISOR)
    if rounded < 0.9 * scaled:
        rounded += DIVISOR
    return max(MIN_FILTERS, rounded)


def conv(filters, kernel, strides, name, regularizer, use_bias=False):
    return keras.layers.Conv2D(
        filters, kernel, strides=strides, padding="same", use_bias=use_bias, name=name,
        kernel_initializer="he_normal", kernel_regularizer=regularizer,
    )


def depthwise(kernel, strides, name, regularizer):
    return keras.layers.DepthwiseConv2D(
        kernel, strides=strides, padding="same", use_bias=False, name=name,
        depthwise_initializer="he_normal", depthwise_regularizer=regularizer,
    )


def bn(name):
    return keras.layers.BatchNormalization(momentum=0.9, epsilon=BN_EPSILON, name=name)


def weight_regularizer(spec):
    """model.regularizer of an ExperimentSpec as a Keras regulariser (None for type none or weight 0)."""
    reg = spec.model.regularizer
    if reg.type == "none" or reg.weight == 0:
        return None
    return keras.regularizers.L1(reg.weight) if reg.type == "l1" else keras.regularizers.L2(reg.weight)
