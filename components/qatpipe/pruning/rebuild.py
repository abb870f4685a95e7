"""Build the pruned model: the same layers, fewer channels, the kept weights copied in (BN included)."""

from __future__ import annotations

import numpy as np
import tf_keras as keras

from qatpipe.graph.keras_graph import rebuild as rebuild_graph
from qatpipe.pruning.graph import PRODUCERS, ChannelGraph


def rebuild(model: keras.Model, graph: ChannelGraph, keep: list[np.ndarray]) -> keras.Model:
    """A new functional model where every channel group g has only the channels `keep[g]`."""

    def kept(group: int, total: int) -> np.ndarray:
        return np.arange(total) if group < 0 else keep[group]

    def new_layer(layer):
        config = layer.get_config()
        if type(layer) in PRODUCERS:
            key = "filters" if "filters" in config else "units"
            config[key] = int(kept(graph.group_of_output[layer.name], config[key]).size)
        return type(layer).from_config(config)

    def new_weights(old, new):
        weights = old.get_weights()
        if type(old) in PRODUCERS:  # kernel (..., in, out) and bias (out,)
            in_idx = kept(graph.group_of_input[old.name], weights[0].shape[-2])
            out_idx = kept(graph.group_of_output[old.name], weights[0].shape[-1])
            return [np.take(np.take(weights[0], in_idx, axis=-2), out_idx, axis=-1)] + [
                w[out_idx] for w in weights[1:]]
        if type(old) is keras.layers.DepthwiseConv2D:  # kernel (kh, kw, channels, 1) and bias (channels,)
            idx = kept(graph.group_of_output[old.name], weights[0].shape[2])
            return [weights[0][:, :, idx, :]] + [w[idx] for w in weights[1:]]
        if isinstance(old, keras.layers.BatchNormalization):
            idx = kept(graph.group_of_output[old.name], weights[0].shape[0])
            return [w[idx] for w in weights]  # gamma, beta, moving mean, moving variance: per channel
        return weights  # activations, pooling, merges: no per-channel weights

    return rebuild_graph(model, new_layer, new_weights)
