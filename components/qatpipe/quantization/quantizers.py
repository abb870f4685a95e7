"""TensorRT-style fake quantization in TensorFlow: symmetric int8, zero point 0, narrow range [-127, 127].

Two ops, chosen because tf2onnx exports each as QuantizeLinear/DequantizeLinear with int8 zero points of 0
(docs/design/qat-export-notes.md has the measurements):
- activations, per tensor: QuantizeAndDequantizeV4 (tf.quantization.quantize_and_dequantize_v2), whose
  gradient is the straight-through estimator masked to the range;
- weights, per output channel: QuantizeAndDequantizeV3 with `axis` (V2/V4 with an axis and range_given fail on
  CPU in TF 2.21), straight-through gradient.
"""

from __future__ import annotations

import tensorflow as tf

NUM_BITS = 8
QMAX = 2 ** (NUM_BITS - 1) - 1  # 127: narrow range, so the scale is amax / 127 on both sides of zero
_MIN_AMAX = 1e-8  # an all-zero tensor still gets a valid (tiny) scale instead of a division by zero


def fake_quant_per_tensor(x, amax):
    """x quantized to int8 with scale amax/127 and back to float (per tensor)."""
    amax = tf.maximum(tf.cast(amax, x.dtype), _MIN_AMAX)
    return tf.quantization.quantize_and_dequantize_v2(
        x, -amax, amax, signed_input=True, num_bits=NUM_BITS, range_given=True, narrow_range=True,
        round_mode="HALF_TO_EVEN",
    )


def fake_quant_per_channel(kernel, axis: int):
    """A weight tensor quantized per slice along `axis` (the output channels) with its own max |w| as range,
    as TensorRT's per-channel weight scales do."""
    kernel = tf.convert_to_tensor(kernel)
    reduce_axes = [i for i in range(kernel.shape.rank) if i != axis]
    amax = tf.maximum(tf.reduce_max(tf.abs(kernel), axis=reduce_axes), _MIN_AMAX)
    return tf.raw_ops.QuantizeAndDequantizeV3(
        input=kernel, input_min=-amax, input_max=amax, num_bits=NUM_BITS, signed_input=True, range_given=True,
        narrow_range=True, axis=axis,
    )


class ActivationRange:
    """The tracked range (amax) of one quantized activation tensor, owned by a layer.

    Three phases: calibration (`calibrating` set: pass values through unchanged and keep the largest |x| seen
    over the calibration batches), training (an exponential moving average of each batch's max |x|, as TFMOT
    tracks its ranges; none once `frozen` is set: quantization/freeze.py), inference (the stored amax, a constant
    in the exported graph).
    """

    def __init__(self, layer, name: str, ema_decay: float):
        self.ema_decay = ema_decay
        self.calibrating = False  # a Python flag: calibration runs eagerly, before any training graph is traced
        self.frozen = False  # a Python flag too: the training step is traced again after it changes
        self.amax = layer.add_weight(f"{name}_amax", shape=(), initializer="zeros", trainable=False,
                                     dtype=tf.float32)

    def __call__(self, x, training):
        batch_amax = tf.reduce_max(tf.abs(tf.cast(x, tf.float32)))
        if self.calibrating:
            self.amax.assign(tf.maximum(self.amax, batch_amax))
            return x
        if training and not self.frozen:
            batch_amax = tf.stop_gradient(batch_amax)
            tracked = self.ema_decay * self.amax + (1.0 - self.ema_decay) * batch_amax
            # never calibrated (amax 0): start from this batch rather than creep up from zero
            self.amax.assign(tf.where(self.amax > 0, tracked, batch_amax))
        return fake_quant_per_tensor(x, self.amax)
