"""Parameters and FLOPs of a tf_keras model (what pruning reports before and after)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tf_keras as keras


def conv_flops(model: keras.Model, channels: Callable[[keras.layers.Layer], tuple[int, int]] | None = None) -> int:
    """FLOPs of one image through the model's convolutions (depthwise too) and Dense layers, counting a
    multiply-add as 2. `channels(layer)` gives (input channels, output channels) to count instead of the
    layer's own: pruning asks what a model with fewer channels would cost without building it.

    Convolutions dominate a detector's cost; BatchNormalization folds into them at deployment and
    element-wise layers are a rounding error, so they are left out (as in TAO's reports)."""
    total = 0
    for layer in model.layers:
        if not isinstance(layer, (keras.layers.Conv2D, keras.layers.DepthwiseConv2D, keras.layers.Dense)):
            continue
        cin, cout = channels(layer) if channels else (int(layer.input.shape[-1]), int(layer.output.shape[-1]))
        if isinstance(layer, keras.layers.Dense):
            total += 2 * cin * cout
            continue
        kh, kw = layer.kernel_size
        _, oh, ow, _ = layer.output.shape
        per_position = (cin * layer.depth_multiplier if isinstance(layer, keras.layers.DepthwiseConv2D)
                        else cin // layer.groups * cout)
        total += 2 * int(oh) * int(ow) * kh * kw * per_position
    return total


def param_count(model: keras.Model) -> int:
    return int(sum(np.prod(w.shape) for w in model.weights))
