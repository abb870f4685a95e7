"""Where Q/DQ goes: placement rules as named objects, each documenting one TensorRT requirement.

A rule looks at one layer in its graph and returns a Placement (the wrapper from layers.WRAPPERS that
replaces it, with its options) or None. `default_rules(settings)` is the ordered list the QAT transform
applies; the first rule that places a layer wins, and `Exclusions` runs first so a user can keep any
layer in float by name or by type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tf_keras as keras

from qatpipe.pruning.graph import inbound_layers
from qatpipe.quantization.layers import WRAPPERS, QDQActivation, QDQAdd


@dataclass(frozen=True)
class Placement:
    wrapper: type
    options: dict = field(default_factory=dict)
    rule: str = ""


class LayerGraph:
    """Producers and consumers of each layer of a functional model (first inbound node)."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.outputs = {tensor.node.layer.name for tensor in model.outputs}
        self.consumers: dict[str, list] = {layer.name: [] for layer in model.layers}
        for layer in model.layers:
            if not isinstance(layer, keras.layers.InputLayer):
                for source in inbound_layers(layer):
                    self.consumers[source.name].append(layer)

    def producers(self, layer) -> list:
        return [] if isinstance(layer, keras.layers.InputLayer) else inbound_layers(layer)


class PlacementRule:
    name = ""

    def place(self, layer, graph: LayerGraph) -> Placement | None | bool:
        raise NotImplementedError


class Exclusions(PlacementRule):
    """Layers named in `qat.excluded_layers`, or whose class is in `qat.excluded_layer_types`, stay float.
    (Returns False: "decided, no placement", which stops later rules.)"""

    name = "exclusions"

    def __init__(self, names=(), types=()):
        self.names, self.types = set(names), set(types)

    def place(self, layer, graph):
        return False if layer.name in self.names or type(layer).__name__ in self.types else None


class ConvDenseInputsAndWeights(PlacementRule):
    """Every Conv2D and Dense: per-tensor Q/DQ on the input and per-channel Q/DQ on the kernel.

    TensorRT's explicit quantisation runs a convolution or GEMM in int8 only when both its input and its
    weights arrive through DequantizeLinear; per-channel weight scales keep the accuracy and let TensorRT fold
    the following BatchNormalization into the kernel exactly (both are per output channel).
    """

    name = "conv_dense_inputs_and_weights"
    kinds = (keras.layers.Conv2D, keras.layers.Dense)

    def place(self, layer, graph):
        if type(layer) not in self.kinds:  # exact types: depthwise/transposed convs are not covered
            return None
        return Placement(WRAPPERS[type(layer)], rule=self.name)


def _fusable_conv_input(add_layer, graph: LayerGraph) -> int | None:
    """Index of the Add input TensorRT can fuse into a convolution: produced by a Conv2D, directly or through
    a BatchNormalization, whose output feeds nothing but this Add."""
    for index, producer in enumerate(graph.producers(add_layer)):
        chain = producer
        if isinstance(chain, keras.layers.BatchNormalization) and len(graph.consumers[chain.name]) == 1:
            chain = graph.producers(chain)[0]
        if type(chain) is keras.layers.Conv2D and len(graph.consumers[chain.name]) == 1:
            return index
    return None


class ResidualAddInput(PlacementRule):
    """Residual Add: Q/DQ on the inputs other than the one a convolution can fuse with (TensorRT's Conv+Add
    fusion takes the residual operand in int8; NVIDIA's toolkit calls this its residual QDQ case).

    In a ResNet block `Add([bn_2(conv_2(...)), shortcut])` the shortcut (identity, or the projection conv's
    BN output) is quantised and conv_2 absorbs the Add. An Add with no fusable input gets Q/DQ on every input
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


class QuantizedOutputs(PlacementRule):
    """Model outputs named in `qat.quantize_outputs` (activation layers) get Q/DQ on their values.

    Empty by default: TAO found that quantising DetectNet_v2's regression (bbox) output ruins the boxes, so
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
        ConvDenseInputsAndWeights(),
        ResidualAddInput(),
        QuantizedOutputs(settings.quantize_outputs),
    ]


def plan(model: keras.Model, rules: list[PlacementRule]) -> dict[str, Placement]:
    """Layer name -> placement, for every layer some rule quantises."""
    graph = LayerGraph(model)
    placements = {}
    for layer in model.layers:
        for rule in rules:
            decision = rule.place(layer, graph)
            if decision is False:
                break
            if decision is not None:
                placements[layer.name] = decision
                break
    return placements
