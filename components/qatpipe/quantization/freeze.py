"""Late QAT: BatchNormalization statistics and activation ranges stop moving after the first epochs of the QAT
retrain (qat.bn_update_epochs, qat.range_update_epochs), so that its last epochs train against the numbers the
exported model computes with: BatchNormalization's moving statistics (which TensorRT folds into the convolution)
and fixed int8 scales. PyTorch's QAT recipe does the same (freeze_bn_stats, disable_observer)."""

from __future__ import annotations

import logging

import tf_keras as keras

from qatpipe.quantization.layers import quantized_layers

log = logging.getLogger("qatpipe.qat")


class FreezeLate(keras.callbacks.Callback):
    """At the start of epoch `bn_update_epochs` (0-based: after that many epochs; a resumed run at or past it
    too) every trainable BatchNormalization normalises with its moving statistics and stops updating them, its
    scale and offset still training; at epoch `range_update_epochs` every activation range stops following its
    moving average. None: never. The training step is traced again after each change (both are read when it is
    traced); on every process of a Horovod run alike (whose epoch-end averaging of the statistics across processes
    leaves them as they are, up to the last bit of a division)."""

    def __init__(self, bn_update_epochs: int | None, range_update_epochs: int | None):
        super().__init__()
        self.bn_update_epochs, self.range_update_epochs = bn_update_epochs, range_update_epochs
        self.frozen_bn: list = []
        self.bn_frozen = self.ranges_frozen = False

    def on_train_begin(self, logs=None):
        epochs = self.params.get("epochs")
        for key, value in (("bn_update_epochs", self.bn_update_epochs), ("range_update_epochs",
                                                                          self.range_update_epochs)):
            if value is not None and epochs is not None and value >= epochs:
                log.warning("qat.%s: %d, but the QAT retrain has %d epochs: nothing is frozen", key, value, epochs)

    def on_epoch_begin(self, epoch, logs=None):
        changed = []
        if self.bn_update_epochs is not None and epoch >= self.bn_update_epochs and not self.bn_frozen:
            self.frozen_bn = [layer for layer in _layers(self.model)  # model.freeze_bn's run that way already
                              if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable]
            for layer in self.frozen_bn:
                layer.call = _inference_call(layer)
            self.bn_frozen = True
            changed.append(f"{len(self.frozen_bn)} BatchNormalization layers use their moving statistics")
        if self.range_update_epochs is not None and epoch >= self.range_update_epochs and not self.ranges_frozen:
            ranges = [r for layer in quantized_layers(self.model) for r in layer.activation_ranges()]
            for quantizer in ranges:
                quantizer.frozen = True
            self.ranges_frozen = True
            changed.append(f"{len(ranges)} activation ranges stay as they are")
        if changed:
            self.model.train_function = self.model.make_train_function(force=True)
            log.info("QAT from epoch %d: %s", epoch + 1, "; ".join(changed))

    def on_train_end(self, logs=None):
        """The model leaves training as it came: the layers' own call, ranges that track, no frozen step."""
        for layer in self.frozen_bn:
            del layer.call
        for layer in quantized_layers(self.model):
            for quantizer in layer.activation_ranges():
                quantizer.frozen = False
        if self.bn_frozen or self.ranges_frozen:
            self.model.train_function = None  # a later fit traces its step again


def freeze_late(settings) -> list[FreezeLate]:
    """The callback for `settings` (a QatSpec), in a list; none where neither key is set."""
    if settings.bn_update_epochs is None and settings.range_update_epochs is None:
        return []
    return [FreezeLate(settings.bn_update_epochs, settings.range_update_epochs)]


def _inference_call(layer):
    """`layer`'s own call, always in inference mode (its moving statistics, left as they are)."""
    call = type(layer).call

    def inference(inputs, training=None, **kwargs):
        return call(layer, inputs, training=False, **kwargs)

    return inference


def _layers(model) -> list:
    """Every layer of `model`, nested models' included."""
    found = []
    for layer in model.layers:
        found += _layers(layer) if isinstance(layer, keras.Model) else [layer]
    return found
