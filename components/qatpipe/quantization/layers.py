"""Quantised twins of the Keras layers TensorRT runs in INT8, one wrapper class per layer kind (as NVIDIA's
TensorFlow quantization toolkit has): each is a subclass of the float layer with the same weights, plus
fake-quant on the inputs a placement rule (rules.py) chose.

- QDQConv2D / QDQDense: per-tensor Q/DQ on the input, per-channel Q/DQ on the kernel (output-channel axis);
  TensorRT runs the layer as an int8 GEMM/convolution.
- QDQAdd: Q/DQ on chosen inputs: the residual input of a skip connection, so TensorRT fuses Conv+Add.
- QDQActivation: Q/DQ on the output, for a model output explicitly chosen (qat.quantize_outputs).

All are registered Keras serialisables: a saved QAT model loads once this module is imported.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras

from qatpipe.quantization.quantizers import ActivationRange, fake_quant_per_channel

PACKAGE = "qatpipe"
DEFAULT_EMA_DECAY = 0.999


class _Quantized:
    """Mixin: the activation ranges of one layer, the calibration switch and the `ema_decay` option. Keras
    may build a layer twice while loading it (Merge layers do): `_build_ranges` creates the ranges once."""

    def __init__(self, *args, ema_decay: float = DEFAULT_EMA_DECAY, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema_decay = ema_decay

    def _build_ranges(self, *names: str) -> None:
        if not getattr(self, "_ranges_built", False):
            self._ranges = [ActivationRange(self, name, self.ema_decay) for name in names]
            self._ranges_built = True

    def activation_ranges(self) -> list[ActivationRange]:
        return list(getattr(self, "_ranges", []))

    def set_calibrating(self, on: bool) -> None:
        for quantizer in self.activation_ranges():
            quantizer.calibrating = on

    def get_config(self):
        return {**super().get_config(), "ema_decay": self.ema_decay}


class _InputAndKernelQuantized(_Quantized):
    """Conv2D / Dense: per-tensor fake quant on the input, per-channel on the kernel, then the layer's own
    linear op, bias and activation."""

    kernel_axis: int  # the kernel's output-channel axis

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges("input")
        self.input_range = self._ranges[0]

    def call(self, inputs, training=None):
        inputs = self.input_range(inputs, training)
        outputs = self._linear(inputs, fake_quant_per_channel(self.kernel, axis=self.kernel_axis))
        if self.use_bias:
            channels_first = getattr(self, "data_format", "channels_last") == "channels_first"
            outputs = tf.nn.bias_add(outputs, self.bias, data_format="NCHW" if channels_first else "NHWC")
        return self.activation(outputs) if self.activation is not None else outputs


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQConv2D(_InputAndKernelQuantized, keras.layers.Conv2D):
    kernel_axis = 3  # HWIO

    def _linear(self, inputs, kernel):
        return self.convolution_op(inputs, kernel)


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQDense(_InputAndKernelQuantized, keras.layers.Dense):
    kernel_axis = 1  # (in, out)

    def _linear(self, inputs, kernel):
        return tf.tensordot(inputs, kernel, axes=[[inputs.shape.rank - 1], [0]])


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQAdd(_Quantized, keras.layers.Add):
    """Add with Q/DQ on the inputs at `quantized_inputs` (indices into its input list)."""

    def __init__(self, quantized_inputs=(1,), **kwargs):
        super().__init__(**kwargs)
        self.quantized_inputs = tuple(int(i) for i in quantized_inputs)

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges(*(f"input{i}" for i in self.quantized_inputs))

    def call(self, inputs, training=None):
        inputs = list(inputs)
        for index, quantizer in zip(self.quantized_inputs, self._ranges):
            inputs[index] = quantizer(inputs[index], training)
        return super().call(inputs)

    def get_config(self):
        return {**super().get_config(), "quantized_inputs": list(self.quantized_inputs)}


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQActivation(_Quantized, keras.layers.Activation):
    """Activation whose output is quantised (a model output the spec asks to quantise)."""

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges("output")
        self.output_range = self._ranges[0]

    def call(self, inputs, training=None):
        return self.output_range(super().call(inputs), training)


# the registry: which quantised wrapper stands in for which float layer kind
WRAPPERS: dict[type, type] = {
    keras.layers.Conv2D: QDQConv2D,
    keras.layers.Dense: QDQDense,
    keras.layers.Add: QDQAdd,
    keras.layers.Activation: QDQActivation,
}
QUANTIZED_LAYERS = tuple(WRAPPERS.values())


def quantized_layers(model) -> list:
    return [layer for layer in model.layers if isinstance(layer, QUANTIZED_LAYERS)]


def is_quantized_model(model) -> bool:
    return bool(quantized_layers(model))
