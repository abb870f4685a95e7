"""Parameters and FLOPs of a tf_keras model (what pruning reports before and after)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tf_keras as keras


def conv_flops(model: keras.Model) -> int:
    """FLOPs of one image through the model's convolutions (depthwise too) and Dense layers, counting a
    multiply-add as 2.

    Convolutions dominate a detector's cost; BatchNormalization folds into them at deployment and
    element-wise layers are a rounding error, so they are left out (as in TAO's reports)."""
    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.DepthwiseConv2D):
            kh, kw, channels, multiplier = layer.depthwise_kernel.shape
            _, oh, ow, _ = layer.output.shape
            total += 2 * int(oh) * int(ow) * int(kh) * int(kw) * int(channels) * int(multiplier)
        elif isinstance(layer, keras.layers.Conv2D):
            kh, kw, cin, cout = layer.kernel.shape
            _, oh, ow, _ = layer.output.shape
            total += 2 * int(oh) * int(ow) * int(kh) * int(kw) * (int(cin) // layer.groups) * int(cout)
        elif isinstance(layer, keras.layers.Dense):
            cin, cout = layer.kernel.shape
            total += 2 * int(cin) * int(cout)
    return total


def pruned_conv_flops(model: keras.Model, group_of_input: dict[str, int], group_of_output: dict[str, int],
                      kept: Sequence[int]) -> int:
    """conv_flops of the model pruning would build when channel group g keeps kept[g] channels, without
    building it: each conv's input and output channels are its groups' counts (-1 is the model input)."""

    def channels(group: int, layer) -> int:
        return int(layer.input.shape[-1]) if group < 0 else int(kept[group])

    total = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.DepthwiseConv2D):
            kh, kw, _, multiplier = layer.depthwise_kernel.shape
            _, oh, ow, _ = layer.output.shape
            cin = channels(group_of_input[layer.name], layer)
            total += 2 * int(oh) * int(ow) * int(kh) * int(kw) * cin * int(multiplier)
        elif isinstance(layer, keras.layers.Conv2D):
            kh, kw, _, _ = layer.kernel.shape
            _, oh, ow, _ = layer.output.shape
            cin, cout = channels(group_of_input[layer.name], layer), channels(group_of_output[layer.name], layer)
            total += 2 * int(oh) * int(ow) * int(kh) * int(kw) * (cin // layer.groups) * cout
        elif isinstance(layer, keras.layers.Dense):
            cin, cout = channels(group_of_input[layer.name], layer), channels(group_of_output[layer.name], layer)
            total += 2 * cin * cout
    return total


def param_count(model: keras.Model) -> int:
    return int(sum(np.prod(w.shape) for w in model.weights))
