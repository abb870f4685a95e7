"""Build the pruned model: the same layers, fewer channels, the kept weights copied in (BN included)."""

from __future__ import annotations

import numpy as np
import tf_keras as keras

from qatpipe.pruning.graph import ChannelGraph, inbound_layers


def rebuild(model: keras.Model, graph: ChannelGraph, keep: list[np.ndarray]) -> keras.Model:
    """A new functional model where every channel group g has only the channels `keep[g]`."""

    def kept(group: int, total: int) -> np.ndarray:
        return np.arange(total) if group < 0 else keep[group]

    tensors: dict[str, object] = {}
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            config = layer.get_config()
            tensors[layer.name] = keras.Input(batch_shape=config["batch_input_shape"], name=layer.name,
                                              dtype=config.get("dtype"))
            continue
        config = layer.get_config()
        in_idx = out_idx = None
        if isinstance(layer, keras.layers.Conv2D):
            in_idx = kept(graph.group_of_input[layer.name], layer.kernel.shape[-2])
            out_idx = kept(graph.group_of_output[layer.name], layer.filters)
            config["filters"] = int(out_idx.size)
        new_layer = type(layer).from_config(config)
        inputs = [tensors[src.name] for src in inbound_layers(layer)]
        tensors[layer.name] = new_layer(inputs if len(inputs) > 1 else inputs[0])
        new_layer.set_weights(_sliced_weights(layer, graph, kept, in_idx, out_idx))
    outputs = [tensors[out.node.layer.name] for out in model.outputs]
    inputs = [tensors[inp.node.layer.name] for inp in model.inputs]
    return keras.Model(inputs if len(inputs) > 1 else inputs[0], outputs, name=model.name)


def _sliced_weights(layer, graph, kept, in_idx, out_idx) -> list[np.ndarray]:
    weights = layer.get_weights()
    if isinstance(layer, keras.layers.Conv2D):
        sliced = [weights[0][:, :, in_idx, :][:, :, :, out_idx]]
        if layer.use_bias:
            sliced.append(weights[1][out_idx])
        return sliced
    if isinstance(layer, keras.layers.BatchNormalization):
        idx = kept(graph.group_of_output[layer.name], weights[0].shape[0])
        return [w[idx] for w in weights]  # gamma, beta, moving mean, moving variance: per channel
    return weights  # activations, pooling, add: no per-channel weights
