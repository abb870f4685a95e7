"""Where Q/DQ goes: placement rules as named objects, each documenting one TensorRT requirement.

A rule looks at one layer in its graph and returns a Placement, which is its decision: the wrapper from
layers.WRAPPERS that replaces the layer, with its options, or `Placement.stays_float` (decided: the layer
stays float); or None (not this rule's kind).
`default_rules(settings)` is the ordered list the QAT transform applies; the first rule that decides wins,
and `Exclusions` runs first so a user can keep any layer in float by name or by type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tf_keras as keras

from qatpipe.graph.keras_graph import LayerGraph
from qatpipe.quantization.layers import WEIGHTED_KINDS, WRAPPERS, QDQActivation, QDQAdd, QDQMultiply


@dataclass(frozen=True)
class Placement:
    """A rule's decision on one layer: `wrapper` (with `options`) replaces it; None keeps it float."""

    wrapper: type | None
    options: dict = field(default_factory=dict)
    rule: str = ""

    @classmethod
    def stays_float(cls, rule: str) -> "Placement":
        return cls(None, rule=rule)

    @property
    def quantized(self) -> bool:
        return self.wrapper is not None


class PlacementRule:
    name = ""

    def place(self, layer, graph: LayerGraph) -> Placement | None:
        """This rule's decision on `layer`, or None when the layer is not of its kind."""
        raise NotImplementedError


class Exclusions(PlacementRule):
    """Layers named in `qat.excluded_layers`, or whose class is in `qat.excluded_layer_types`, stay float.
    (Their decision, stays_float, stops later rules.)"""

    name = "exclusions"

    def __init__(self, names=(), types=()):
        self.names, self.types = set(names), set(types)

    def place(self, layer, graph):
        excluded = layer.name in self.names or type(layer).__name__ in self.types
        return Placement.stays_float(self.name) if excluded else None


class WeightedInputsAndWeights(PlacementRule):
    """Every layer of a kind in kinds.WEIGHTED_KINDS (Conv2D, DepthwiseConv2D, Dense): per-tensor Q/DQ on the
    input and per-channel Q/DQ on the weight.

    TensorRT's explicit quantization runs a convolution or GEMM in int8 only when both its input and its
    weights arrive through DequantizeLinear; per-channel weight scales keep the accuracy and let TensorRT fold
    the following BatchNormalization into the kernel exactly (both are per output channel). A depthwise
    convolution is a grouped Conv in ONNX with one output channel per input channel: its scales run along the
    depth axis. One with depth_multiplier > 1 stays float (its per-channel scales would not be per output
    channel).
    """

    name = "weighted_inputs_and_weights"

    def place(self, layer, graph):
        if type(layer) not in WEIGHTED_KINDS:  # exact types: a subclass (Conv2DTranspose) needs its own row
            return None
        if getattr(layer, "depth_multiplier", 1) != 1:
            return Placement.stays_float(self.name)
        return Placement(WRAPPERS[type(layer)], rule=self.name)


def _fusable_conv_input(add_layer, graph: LayerGraph) -> int | None:
    """Index of the Add input TensorRT can fuse into a convolution: produced by a Conv2D, directly or through
    a BatchNormalization, whose output feeds nothing but this Add."""
    for index, producer in enumerate(graph.producers(add_layer)):
        chain = producer
        if isinstance(chain, keras.layers.BatchNormalization) and graph.sole_consumer(chain):
            chain = graph.producers(chain)[0]
        if type(chain) is keras.layers.Conv2D and graph.sole_consumer(chain):
            return index
    return None


class ResidualAddInput(PlacementRule):
    """Residual Add: Q/DQ on the inputs other than the one a convolution can fuse with (TensorRT's Conv+Add
    fusion takes the residual operand in int8; NVIDIA's toolkit calls this its residual QDQ case).

    In a ResNet block `Add([bn_2(conv_2(...)), shortcut])` the shortcut (identity, or the projection conv's
    BN output) is quantized and conv_2 absorbs the Add. An Add with no fusable input gets Q/DQ on every input
    and runs as an int8 element-wise layer.
    """

    name = "residual_add_input"

    def place(self, layer, graph):
        if type(layer) is not keras.layers.Add:
            return None
        count = len(graph.producers(layer))
        fused = _fusable_conv_input(layer, graph)
        quantized = [i for i in range(count) if i != fused]
        return Placement(QDQAdd, {"quantized_inputs": quantized}, rule=self.name)


class SqueezeExcitationScale(PlacementRule):
    """Multiply (the x * sigmoid(se) of a squeeze-excitation block): Q/DQ on both inputs, so TensorRT runs the
    scale as an int8 element-wise layer and the following projection conv reads int8 without a float detour.
    NVIDIA's TensorFlow quantization toolkit places the same pair for EfficientNet (its EfficientNet QDQ
    case); its model zoo reads 75.82 top-1 QAT against 76.97 FP32 with it.
    """

    name = "squeeze_excitation_scale"

    def place(self, layer, graph):
        if type(layer) is not keras.layers.Multiply:
            return None
        return Placement(QDQMultiply, {"quantized_inputs": list(range(len(graph.producers(layer))))},
                         rule=self.name)


class GlobalPoolingInput(PlacementRule):
    """Average pooling, global (the squeeze of a squeeze-excitation block) or not: Q/DQ on the input. TensorRT
    runs pooling in int8 when its input arrives through DequantizeLinear; the squeeze then feeds the SE
    convs, which quantize their own inputs."""

    name = "global_pooling_input"

    def place(self, layer, graph):
        if type(layer) not in (keras.layers.GlobalAveragePooling2D, keras.layers.AveragePooling2D):
            return None
        return Placement(WRAPPERS[type(layer)], rule=self.name)


POINTWISE_ACTIVATIONS = {"relu", "relu6", "swish", "silu", "sigmoid", "hard_sigmoid", "hard_silu", "elu",
                         "leaky_relu", "linear", "tanh"}


class PointwiseActivationsStayFloat(PlacementRule):
    """ReLU, ReLU6, SiLU/Swish, Sigmoid and other element-wise activations: no Q/DQ of their own. TensorRT fuses
    them into the convolution before them (Conv+BN+activation, then the next layer's Q as the int8 output
    scale), so a Q/DQ here would only split a fusion; the next weighted layer, merge or pooling quantizes
    the value where it is read. (A model output named in qat.quantize_outputs is placed before this rule.)
    """

    name = "pointwise_activations_stay_float"

    def place(self, layer, graph):
        if type(layer) is keras.layers.ReLU or (type(layer) is keras.layers.Activation
                                                 and layer.get_config()["activation"] in POINTWISE_ACTIVATIONS):
            return Placement.stays_float(self.name)
        return None


class QuantizedOutputs(PlacementRule):
    """Model outputs named in `qat.quantize_outputs` (activation layers) get Q/DQ on their values.

    Empty by default: TAO found that quantizing DetectNet_v2's regression (bbox) output ruins the boxes, so
    outputs stay float and TensorRT writes them from the last int8 convolution in FP32.
    """

    name = "quantized_outputs"

    def __init__(self, names=()):
        self.names = set(names)

    def place(self, layer, graph):
        if layer.name in self.names and type(layer) is keras.layers.Activation and layer.name in graph.outputs:
            return Placement(QDQActivation, rule=self.name)
        return None


def default_rules(settings) -> list[PlacementRule]:
    """The rules for a QatSpec, in the order they are tried."""
    return [
        Exclusions(settings.excluded_layers, settings.excluded_layer_types),
        WeightedInputsAndWeights(),
        ResidualAddInput(),
        SqueezeExcitationScale(),
        GlobalPoolingInput(),
        QuantizedOutputs(settings.quantize_outputs),
        PointwiseActivationsStayFloat(),
    ]


def plan(model: keras.Model, rules: list[PlacementRule]) -> dict[str, Placement]:
    """Layer name -> placement, for every layer some rule quantizes."""
    graph = LayerGraph(model)
    placements = {}
    for layer in model.layers:
        for rule in rules:
            decision = rule.place(layer, graph)
            if decision is None:
                continue
            if decision.quantized:
                placements[layer.name] = decision
            break
    return placements
