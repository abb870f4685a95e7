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
    """Mixin: the activation ranges of one layer and the calibration switch. Keras may build a layer twice
    while loading it (Merge layers do): `_ranges_built` makes sure the ranges are created once."""

    def _build_ranges(self, make) -> None:
        if not getattr(self, "_ranges_built", False):
            self._ranges = make()
            self._ranges_built = True

    def activation_ranges(self) -> list[ActivationRange]:
        return list(getattr(self, "_ranges", []))

    def set_calibrating(self, on: bool) -> None:
        for quantizer in self.activation_ranges():
            quantizer.calibrating = on


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQConv2D(_Quantized, keras.layers.Conv2D):
    def __init__(self, *args, ema_decay: float = DEFAULT_EMA_DECAY, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema_decay = ema_decay

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges(lambda: [ActivationRange(self, "input", self.ema_decay)])
        self.input_range = self._ranges[0]

    def call(self, inputs, training=None):
        inputs = self.input_range(inputs, training)
        kernel = fake_quant_per_channel(self.kernel, axis=3)  # HWIO: axis 3 is the output channel
        outputs = self.convolution_op(inputs, kernel)
        if self.use_bias:
            outputs = tf.nn.bias_add(outputs, self.bias,
                                     data_format="NHWC" if self.data_format == "channels_last" else "NCHW")
        return self.activation(outputs) if self.activation is not None else outputs

    def get_config(self):
        return {**super().get_config(), "ema_decay": self.ema_decay}


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQDense(_Quantized, keras.layers.Dense):
    def __init__(self, *args, ema_decay: float = DEFAULT_EMA_DECAY, **kwargs):
        super().__init__(*args, **kwargs)
        self.ema_decay = ema_decay

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges(lambda: [ActivationRange(self, "input", self.ema_decay)])
        self.input_range = self._ranges[0]

    def call(self, inputs, training=None):
        inputs = self.input_range(inputs, training)
        kernel = fake_quant_per_channel(self.kernel, axis=1)  # (in, out): axis 1 is the output unit
        outputs = tf.tensordot(inputs, kernel, axes=[[inputs.shape.rank - 1], [0]])
        if self.use_bias:
            outputs = tf.nn.bias_add(outputs, self.bias)
        return self.activation(outputs) if self.activation is not None else outputs

    def get_config(self):
        return {**super().get_config(), "ema_decay": self.ema_decay}


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQAdd(_Quantized, keras.layers.Add):
    """Add with Q/DQ on the inputs at `quantized_inputs` (indices into its input list)."""

    def __init__(self, quantized_inputs=(1,), ema_decay: float = DEFAULT_EMA_DECAY, **kwargs):
        super().__init__(**kwargs)
        self.quantized_inputs = tuple(int(i) for i in quantized_inputs)
        self.ema_decay = ema_decay

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges(lambda: [ActivationRange(self, f"input{i}", self.ema_decay) for i in self.quantized_inputs])

    def call(self, inputs, training=None):
        inputs = list(inputs)
        for index, quantizer in zip(self.quantized_inputs, self._ranges):
            inputs[index] = quantizer(inputs[index], training)
        return super().call(inputs)

    def get_config(self):
        return {**super().get_config(), "quantized_inputs": list(self.quantized_inputs),
                "ema_decay": self.ema_decay}


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQActivation(_Quantized, keras.layers.Activation):
    """Activation whose output is quantised (a model output the spec asks to quantise)."""

    def __init__(self, activation, ema_decay: float = DEFAULT_EMA_DECAY, **kwargs):
        super().__init__(activation, **kwargs)
        self.ema_decay = ema_decay

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges(lambda: [ActivationRange(self, "output", self.ema_decay)])
        self.output_range = self._ranges[0]

    def call(self, inputs, training=None):
        return self.output_range(super().call(inputs), training)

    def get_config(self):
        return {**super().get_config(), "ema_decay": self.ema_decay}


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
