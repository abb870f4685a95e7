"""Distillation during training: a frozen teacher's outputs as soft targets beside the task's targets.

`Distillation(teacher, terms, weight, output_names)` holds the teacher and one term per output
(DetectorArchitecture.distill_losses: nothing here knows an architecture). `wrap(model)` gives the model
`stages/train.py` compiles and fits: the same functional graph on the same layers (so the same weights, trainable
variables, checkpoint and saved model), whose `compute_loss` adds `weight` x the distillation loss to the task
loss. Keras' own `train_step` calls it inside its gradient tape, so mixed precision's loss scaling and Horovod's
gradient averaging (both inside the optimizer's `minimize`) take the total as they take the task loss, and
there is no second training loop.

The teacher runs in inference mode (`training=False`: BatchNormalization's moving statistics) on the batch the
model trains on, augmentation included, under stop_gradient. It is held outside Keras' object tracking, so its
weights are in no checkpoint, variable list (Horovod's broadcasts and averages) or saved model; train time only.

Logged per epoch: `loss` stays the task loss (what `val_loss` measures, comparable with a run without
distillation) and `distill_loss` is the distillation loss before its weight; the optimizer minimises
loss + weight x distill_loss.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf
import tf_keras as keras

DISTILL_METRIC = "distill_loss"


class Distillation:
    """A frozen `teacher` (a tf_keras model with the student's outputs, in `output_names` order) and the terms
    (output name -> term(teacher, student) -> scalar) whose sum, times `weight`, joins the task loss."""

    def __init__(self, teacher, terms: dict[str, Callable], weight: float, output_names: tuple[str, ...]):
        if weight <= 0:
            raise ValueError(f"distillation weight must be positive, got {weight}")
        missing = [name for name in output_names if name not in terms]
        if missing:
            raise ValueError(f"no distillation term for the outputs {missing}")
        teacher.trainable = False
        self.teacher, self.terms, self.weight = teacher, dict(terms), float(weight)
        self.output_names = tuple(output_names)
        self.tracker = keras.metrics.Mean(name=DISTILL_METRIC)

    def loss(self, images, student_outputs):
        """The distillation loss (before its weight) of `student_outputs` (the model's outputs, a list in
        output order or one tensor) on `images`: the teacher runs on the same images, in inference mode."""
        teacher = {name: tf.stop_gradient(tf.cast(output, tf.float32)) for name, output in
                   zip(self.output_names, _outputs(self.teacher(images, training=False)))}
        student = {name: tf.cast(output, tf.float32) for name, output in
                   zip(self.output_names, _outputs(student_outputs))}
        return tf.add_n([term(teacher, student) for term in self.terms.values()])

    def wrap(self, model) -> "DistillingModel":
        """`model` (functional) as the model that trains against the teacher: the same layers and outputs."""
        return DistillingModel(model.inputs, model.outputs, name=model.name, distillation=self)


class DistillingModel(keras.Model):
    """A functional model whose training loss adds its distillation's (Keras' documented hook for a loss that
    reads the inputs: `compute_loss`); the default `train_step`, `fit`, callbacks and checkpoints stay."""

    def __init__(self, inputs, outputs, distillation: Distillation, **kwargs):
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        # a plain object: Keras tracks a Layer, Metric or variable set as an attribute (and would then save and
        # broadcast the teacher's weights), not what such an object holds
        self.distillation = distillation

    def get_config(self):
        """The plain functional config of the model alone (what precision.cast_model rebuilds): no teacher."""
        return keras.Model(self.inputs, self.outputs, name=self.name).get_config()

    @property
    def metrics(self):
        return [*super().metrics, self.distillation.tracker]  # reset each epoch by fit, logged as distill_loss

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        loss = super().compute_loss(x, y, y_pred, sample_weight)
        distillation = self.distillation
        distill = distillation.loss(x, y_pred)
        distillation.tracker.update_state(distill)
        return distill * distillation.weight if loss is None else loss + distill * distillation.weight


def _outputs(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


__all__ = ["DISTILL_METRIC", "Distillation", "DistillingModel"]
