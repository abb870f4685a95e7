"""The one view of a tf_keras functional model as a graph, shared by pruning and quantization: who feeds a
layer, who reads it, and one way to rebuild the model layer by layer (`clone_model` with a clone function,
as TFMOT and NVIDIA's quantization toolkit do) with each new layer's weights set from the old one's.
"""

from __future__ import annotations

from typing import Callable

import tf_keras as keras

from qatpipe.errors import ModelFileError


def inbound_layers(layer) -> list:
    """The layers whose outputs `layer` reads (its first and, in the models qatpipe builds, only call)."""
    node = layer.inbound_nodes[0]
    inbound = node.inbound_layers
    return list(inbound) if isinstance(inbound, (list, tuple)) else [inbound]


class LayerGraph:
    """Producers and consumers of each layer of a functional model, and which layers are model outputs."""

    def __init__(self, model: keras.Model):
        self.model = model
        self.outputs = {tensor.node.layer.name for tensor in model.outputs}
        self.consumers: dict[str, list] = {layer.name: [] for layer in model.layers}
        for layer in model.layers:
            if isinstance(layer, keras.layers.InputLayer):
                continue
            if len(layer.inbound_nodes) != 1:
                raise ModelFileError(f"layer {layer.name} is used {len(layer.inbound_nodes)} times; qatpipe "
                                     f"needs each layer used once")
            for source in inbound_layers(layer):
                self.consumers[source.name].append(layer)

    def producers(self, layer) -> list:
        return [] if isinstance(layer, keras.layers.InputLayer) else inbound_layers(layer)

    def sole_consumer(self, layer) -> bool:
        return len(self.consumers[layer.name]) == 1


def rebuild(model: keras.Model, new_layer: Callable, new_weights: Callable) -> keras.Model:
    """The same graph with every non-input layer replaced by `new_layer(old)`; then each new layer's weights
    are `new_weights(old, new)` (a list in the new layer's order). Names and wiring are kept."""
    clone = keras.models.clone_model(model, clone_function=new_layer)
    for old in model.layers:
        if not isinstance(old, keras.layers.InputLayer):
            new = clone.get_layer(old.name)
            new.set_weights(new_weights(old, new))
    return clone
