"""Apply the placement rules: a float tf_keras model -> its QAT twin (same layers, names and weights, with
quantized wrappers where the rules say), then calibrate its activation ranges on a few batches."""

from __future__ import annotations

import logging
from typing import Iterable

import numpy as np
import tf_keras as keras

from qatpipe.errors import SpecError
from qatpipe.graph.keras_graph import rebuild
from qatpipe.quantization.layers import quantized_layers
from qatpipe.quantization.rules import Placement, default_rules, plan

log = logging.getLogger(__name__)


def _is_relu(layer) -> bool:
    if type(layer) is keras.layers.ReLU:
        return layer.max_value is None and not layer.negative_slope and not layer.threshold
    return type(layer) is keras.layers.Activation and layer.get_config()["activation"] == "relu"


def quantize_model(model: keras.Model, settings, rules=None) -> keras.Model:
    """The QAT model for `settings` (a QatSpec). `rules` defaults to rules.default_rules(settings).

    settings.relu6 swaps ReLU for ReLU6 first, as TAO's QAT does: a bounded activation keeps the int8
    range of the next layer's input tight.
    """
    if settings.excluded_layers == "auto":  # names come from a search of the model (stages/retrain.py)
        raise SpecError("qat.excluded_layers: auto is resolved by the QAT retrain stage into layer names; give "
                        "names here")
    names = {layer.name for layer in model.layers}
    unknown = sorted(set(settings.excluded_layers) - names)
    if unknown:
        raise SpecError(f"qat.excluded_layers: no such layers in {model.name}: {', '.join(unknown)}")
    unknown = sorted(set(settings.excluded_layer_types) - {type(layer).__name__ for layer in model.layers})
    if unknown:
        raise SpecError(f"qat.excluded_layer_types: no layers of these classes in {model.name}: "
                        f"{', '.join(unknown)}")
    unknown = sorted(set(settings.quantize_outputs) - {t.node.layer.name for t in model.outputs})
    if unknown:
        raise SpecError(f"qat.quantize_outputs: not outputs of {model.name}: {', '.join(unknown)}")
    placements = plan(model, rules if rules is not None else default_rules(settings))
    swapped = sum(bool(settings.relu6 and layer.name not in placements and _is_relu(layer))
                  for layer in model.layers)

    def new_layer(layer):
        config = layer.get_config()
        # QAT computes in float32 whatever policy the model was trained under (a mixed_float16 model keeps
        # its policy in each layer's config): fake quant in float16 would not match TensorRT's int8
        config["dtype"] = "float32"
        return _new_layer(layer, config, placements.get(layer.name), settings)

    def new_weights(old, new):
        # the wrapper's extra weights (activation ranges) come after the float layer's: keep them at 0
        weights = old.get_weights()
        return weights + new.get_weights()[len(weights):]

    qat = rebuild(model, new_layer, new_weights)
    by_rule: dict[str, int] = {}
    for placement in placements.values():
        by_rule[placement.rule] = by_rule.get(placement.rule, 0) + 1
    log.info("QAT: %d layers quantized (%s)%s", len(placements),
             ", ".join(f"{rule}: {n}" for rule, n in sorted(by_rule.items())),
             f"; {swapped} ReLU -> ReLU6" if swapped else "")
    return qat


def _new_layer(layer, config: dict, placement: Placement | None, settings):
    if placement is not None:
        return placement.wrapper.from_config({**config, **placement.options, "ema_decay": settings.ema_decay})
    if settings.relu6 and _is_relu(layer):
        return keras.layers.ReLU(max_value=6.0, name=layer.name)
    return type(layer).from_config(config)


def calibrate(model: keras.Model, batches: Iterable[np.ndarray], max_batches: int) -> int:
    """Initialise every activation range with the largest |value| seen over up to `max_batches` batches
    (run eagerly, values unquantized). Returns the number of images seen."""
    layers = quantized_layers(model)
    for layer in layers:
        layer.set_calibrating(True)
    images = 0
    try:
        for index, batch in enumerate(batches):
            if index >= max_batches:
                break
            model(batch, training=False)
            images += len(batch)
    finally:
        for layer in layers:
            layer.set_calibrating(False)
    ranges = [float(r.amax.numpy()) for layer in layers for r in layer.activation_ranges()]
    log.info("QAT calibration: %d images, %d activation ranges (amax %.3g .. %.3g)", images, len(ranges),
             min(ranges, default=0.0), max(ranges, default=0.0))
    return images


def activation_ranges(model: keras.Model) -> dict[str, float]:
    """`layer/range` -> amax of every quantized activation, for reports."""
    return {f"{layer.name}/{r.amax.name.split('/')[-1].split(':')[0]}": float(r.amax.numpy())
            for layer in quantized_layers(model) for r in layer.activation_ranges()}
