"""The loss forms an architecture's `distill_losses()` builds its distillation terms from (training/
distillation.py runs them): a frozen FP32 teacher's outputs are the soft targets of the model being trained.

Every term is 0 exactly where the student's output equals the teacher's, and each follows the output's kind:

- probabilities (a sigmoid per class, a softmax over classes): KL(teacher || student), Hinton et al.'s
  knowledge distillation at temperature 1 and what Model Optimizer's QAD and YOLOv6's QAT distillation put on
  the logits. KL rather than cross-entropy: the same gradient, but 0 at student = teacher instead of the
  teacher's entropy, so the logged term is the gap itself. The outputs are probabilities already, so no
  temperature.
- regression (box offsets): the architecture's own box loss (L1, smooth L1) with the teacher's boxes as the
  target and the teacher's confidence as the mask: cells or priors where the teacher sees no object, most of
  the grid, weigh next to nothing instead of dominating, and the term has the task term's scale.
"""

from __future__ import annotations

import tensorflow as tf

EPSILON = 1e-7  # probabilities are clipped to [EPSILON, 1] before the log, as the task losses clip them


def _log(p):
    return tf.math.log(tf.clip_by_value(p, EPSILON, 1.0))


def binary_kl(teacher, student):
    """Element-wise KL(Bernoulli(teacher) || Bernoulli(student)) of sigmoid probabilities."""
    return (teacher * (_log(teacher) - _log(student))
            + (1.0 - teacher) * (_log(1.0 - teacher) - _log(1.0 - student)))


def categorical_kl(teacher, student, axis: int = -1):
    """KL(teacher || student) of softmax distributions along `axis` (summed over it)."""
    return tf.reduce_sum(teacher * (_log(teacher) - _log(student)), axis=axis)


def soft_count(weights):
    """The teacher's soft count of objects (the sum of its confidences), at least 1: what a distillation term
    divides by where the task term divides by the positives."""
    return tf.maximum(tf.reduce_sum(weights), 1.0)


__all__ = ["EPSILON", "binary_kl", "categorical_kl", "soft_count"]
