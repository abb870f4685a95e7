"""Quantized twins of the Keras layers TensorRT runs in INT8: each is a subclass of the float layer with the
same weights, plus fake quant on the inputs a placement rule (rules.py) chose. Three families:

- weighted layers, one row each of kinds.py's `WEIGHTED_KINDS` (the attribute holding the weight and its
  output-channel axis): per-tensor Q/DQ on the input and per-channel Q/DQ on the weight, then the float
  layer's own call (bias, activation). A new weighted kind (Conv2DTranspose, ...) is one row there;
- merges (Add, Multiply): Q/DQ on the inputs at chosen indices (the residual input of a skip connection, both
  operands of a squeeze-excitation scale);
- pooling and model outputs: Q/DQ on the input (pooling) or the output (an activation named in
  qat.quantize_outputs).

All are registered Keras serialisables (`qatpipe>QDQConv2D`, ...): a saved QAT model loads once this module is
imported.
"""

from __future__ import annotations

import tf_keras as keras

from qatpipe.quantization import kinds
from qatpipe.quantization.kinds import WeightedKind
from qatpipe.quantization.quantizers import ActivationRange, fake_quant_per_channel
from qatpipe.spec import QatSpec, field_default

PACKAGE = "qatpipe"
DEFAULT_EMA_DECAY = field_default(QatSpec, "ema_decay")

# kinds.py's table by tf_keras class: which weighted layer kinds are quantized, and how
WEIGHTED_KINDS: dict[type, WeightedKind] = {getattr(keras.layers, name): row
                                            for name, row in kinds.WEIGHTED_KINDS.items()}


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


class _InputQuantized(_Quantized):
    """One input, quantized per tensor before the float layer's call."""

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges("input")
        self.input_range = self._ranges[0]

    def call(self, inputs, training=None):
        return super().call(self.input_range(inputs, training))


class _InputAndWeightQuantized(_InputQuantized):
    """A weighted layer: quantized input, and the weight named by `kind` quantized per output channel while
    the float layer's own call runs (the attribute is swapped for its fake-quantized value and back, as
    TFMOT's quantize wrapper does, so bias, activation and padding stay the float layer's code)."""

    kind: WeightedKind

    def call(self, inputs, training=None):
        inputs = self.input_range(inputs, training)
        weight = getattr(self, self.kind.weight)
        # object.__setattr__: a plain attribute, kept out of Keras' weight tracking
        object.__setattr__(self, self.kind.weight, fake_quant_per_channel(weight, axis=self.kind.axis))
        try:
            return super(_InputQuantized, self).call(inputs)
        finally:
            object.__setattr__(self, self.kind.weight, weight)


class _InputsQuantizedMerge(_Quantized):
    """A merge layer (Add, Multiply) with Q/DQ on the inputs at `quantized_inputs` (indices)."""

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


def _register(name: str, bases: tuple, doc: str, **attributes) -> type:
    return keras.utils.register_keras_serializable(package=PACKAGE)(
        type(name, bases, {"__doc__": doc, "__module__": __name__, **attributes}))


def _weighted_wrapper(kind: type, row: WeightedKind) -> type:
    return _register(f"QDQ{kind.__name__}", (_InputAndWeightQuantized, kind),
                     f"{kind.__name__} with a quantized input and per-channel int8 `{row.weight}` "
                     f"(axis {row.axis}).", kind=row)


QDQAdd = _register("QDQAdd", (_InputsQuantizedMerge, keras.layers.Add), "Add with quantized inputs.")
QDQMultiply = _register("QDQMultiply", (_InputsQuantizedMerge, keras.layers.Multiply),
                        "Multiply with quantized inputs.")
QDQGlobalAveragePooling2D = _register("QDQGlobalAveragePooling2D",
                                      (_InputQuantized, keras.layers.GlobalAveragePooling2D),
                                      "Global average pooling of a quantized input.")
QDQAveragePooling2D = _register("QDQAveragePooling2D", (_InputQuantized, keras.layers.AveragePooling2D),
                                "Average pooling of a quantized input.")


@keras.utils.register_keras_serializable(package=PACKAGE)
class QDQActivation(_Quantized, keras.layers.Activation):
    """Activation whose output is quantized (a model output the spec asks to quantize)."""

    def build(self, input_shape):
        super().build(input_shape)
        self._build_ranges("output")
        self.output_range = self._ranges[0]

    def call(self, inputs, training=None):
        return self.output_range(super().call(inputs), training)


# the registry: which quantized wrapper stands in for which float layer kind
WRAPPERS: dict[type, type] = {
    **{kind: _weighted_wrapper(kind, row) for kind, row in WEIGHTED_KINDS.items()},
    keras.layers.Add: QDQAdd,
    keras.layers.Multiply: QDQMultiply,
    keras.layers.GlobalAveragePooling2D: QDQGlobalAveragePooling2D,
    keras.layers.AveragePooling2D: QDQAveragePooling2D,
    keras.layers.Activation: QDQActivation,
}
QDQConv2D = WRAPPERS[keras.layers.Conv2D]
QDQDepthwiseConv2D = WRAPPERS[keras.layers.DepthwiseConv2D]
QDQDense = WRAPPERS[keras.layers.Dense]
QUANTIZED_LAYERS = tuple(WRAPPERS.values())


def quantized_layers(model) -> list:
    return [layer for layer in model.layers if isinstance(layer, QUANTIZED_LAYERS)]


def is_quantized_model(model) -> bool:
    return bool(quantized_layers(model))
