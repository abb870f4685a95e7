"""TAO's soft-start annealing learning-rate schedule."""

from __future__ import annotations

import math

import tensorflow as tf
import tf_keras as keras


def soft_start_annealing_lr(progress: float, min_lr: float, max_lr: float, soft_start: float,
                            annealing_point: float) -> float:
    """Learning rate at `progress` in [0, 1] of training (pure Python; the reference for the TF version).

    Log-linear ramp min_lr -> max_lr over [0, soft_start], max_lr until annealing_point, then log-linear
    decay back to min_lr at the end.
    """
    lo, hi = math.log(min_lr), math.log(max_lr)
    if progress < soft_start:
        return math.exp(lo + (hi - lo) * progress / soft_start)
    if progress < annealing_point:
        return max_lr
    span = max(1.0 - annealing_point, 1e-9)
    return math.exp(hi + (lo - hi) * min((progress - annealing_point) / span, 1.0))


@keras.utils.register_keras_serializable(package="qatpipe")
class SoftStartAnnealingSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The schedule keyed on the optimizer's step, so a resumed job continues where it stopped."""

    def __init__(self, total_steps: int, min_lr: float, max_lr: float, soft_start: float, annealing_point: float):
        self.total_steps = int(total_steps)
        self.min_lr, self.max_lr = float(min_lr), float(max_lr)
        self.soft_start, self.annealing_point = float(soft_start), float(annealing_point)

    def __call__(self, step):
        progress = tf.cast(step, tf.float32) / float(max(self.total_steps, 1))
        lo, hi = math.log(self.min_lr), math.log(self.max_lr)
        ramp = tf.exp(lo + (hi - lo) * progress / max(self.soft_start, 1e-9))
        span = max(1.0 - self.annealing_point, 1e-9)
        decay = tf.exp(hi + (lo - hi) * tf.minimum((progress - self.annealing_point) / span, 1.0))
        return tf.where(
            progress < self.soft_start, ramp, tf.where(progress < self.annealing_point, self.max_lr, decay)
        )

    def get_config(self):
        return {
            "total_steps": self.total_steps, "min_lr": self.min_lr, "max_lr": self.max_lr,
            "soft_start": self.soft_start, "annealing_point": self.annealing_point,
        }
