"""Validation during training (TAO's `validation_period_during_training`) and the best-epoch checkpoint.

`Validator` scores the model in memory on the val set (a fixed sample of `train.val_images` of it,
stages/train.py's `validation_samples`) as the `evaluate` stage scores a saved one (on all of it): the same
`predict` (decoder), pycocotools and learning check, and in the same pass the compiled Keras losses against the
val set's encoded targets. `ValidateEveryN` runs it every `train.validation_interval` epochs and after the last,
puts `val_*` numbers into the epoch's logs (training_log.csv, TensorBoard, MLflow history) and offers the
weights to `BestCheckpoint`, which keeps the best val mAP@0.5 epoch's weights in `best/` so a resumed run
still has them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf
import tf_keras as keras

from qatpipe.errors import QatpipeError
from qatpipe.fileio import replacing, write_json

log = logging.getLogger("qatpipe.train")

BEST_DIR = "best"
BEST_FILE = "best.json"
SCORE = "val_map50"  # what `keep: best` maximises


@dataclass
class Validation:
    """One validation: `epoch` counts from 1; `metrics` are the `val_*` numbers of the epoch's log row."""

    epoch: int
    metrics: dict[str, float]
    diagnostics: dict
    seconds: float

    @property
    def score(self) -> float:
        return self.metrics[SCORE]


class Validator:
    """Scores a tf_keras detector in memory on `samples` (validation's val images), exactly as `evaluate` would."""

    def __init__(self, spec, arch, samples):
        from qatpipe.data.pipeline import eval_targets
        from qatpipe.metrics.coco import GroundTruth

        self.spec, self.arch, self.samples = spec, arch, samples
        self.ground_truth = [GroundTruth(s.boxes, s.classes) for s in samples]
        self.targets = eval_targets(samples, spec, arch)  # batched as `predict` batches the images

    def __call__(self, model, epoch: int) -> Validation:
        from qatpipe.inference import predict
        from qatpipe.metrics.coco import evaluate_detections
        from qatpipe.metrics.diagnostics import learning_check

        started = time.perf_counter()
        losses = _LossMeter(model, self.arch.output_names, iter(self.targets))
        detections = predict(losses.forward, self.samples, self.spec, self.arch)
        scores = evaluate_detections(self.ground_truth, detections, self.spec.dataset.classes,
                                     max_detections=self.spec.model.decoder.max_detections)
        check = learning_check(self.spec, self.ground_truth, detections, scores.map50)
        metrics = {**losses.means(), "val_map50": scores.map50, "val_map": scores.map,
                   "val_class_agnostic_map50": check.class_agnostic_map50}
        if check.class_accuracy is not None:
            metrics["val_class_accuracy"] = check.class_accuracy
        return Validation(epoch, metrics, check.to_dict(), round(time.perf_counter() - started, 3))


class _LossMeter:
    """A `predict` forward pass that also averages the compiled losses over the batches, as `model.evaluate`
    does: each output's loss and the total (with the regularisation losses), weighted by batch size."""

    def __init__(self, model, output_names, targets):
        self.model, self.output_names, self.targets = model, output_names, targets
        self.sums: dict[str, float] = {}
        self.images = 0

    def forward(self, batch) -> dict[str, np.ndarray]:
        outputs = dict(zip(self.output_names, self.model(batch, training=False)))
        targets = next(self.targets)
        count = int(batch.shape[0])
        values = {f"val_{name}_loss": float(loss(targets[name], outputs[name]))
                  for name, loss in self.model.loss.items()}
        regularisation = float(tf.add_n(self.model.losses)) if self.model.losses else 0.0
        values["val_loss"] = sum(values.values()) + regularisation
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * count
        self.images += count
        return {name: output.numpy() for name, output in outputs.items()}

    def means(self) -> dict[str, float]:
        return {key: total / self.images for key, total in self.sums.items()}


class BestCheckpoint:
    """The weights of the best validated epoch so far (highest val mAP@0.5; a tie goes to the later epoch, so a
    score stuck at 0 or saturated at 1 keeps the most trained weights), in `folder`: weights-EPOCH.npz and
    best.json naming it, written in that order, so the json always names complete weights."""

    def __init__(self, folder: Path, resumed_at: int = 0):
        """`resumed_at`: the epochs the run's checkpoint already holds (0: a fresh run). A record of a later
        epoch belongs to an attempt whose epochs are trained again, and is dropped (with it, a fresh run
        forgets an earlier run's record)."""
        self.folder = Path(folder)
        path = self.folder / BEST_FILE
        self.record: dict | None = json.loads(path.read_text()) if path.is_file() else None
        if self.record and self.record["epoch"] > resumed_at:
            path.unlink()
            self.record = None

    def offer(self, validation: Validation, model) -> bool:
        """Keep `model`'s weights when `validation` beats the best so far; True when it does."""
        if self.record and validation.score < self.record[SCORE]:
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        weights = f"weights-{validation.epoch:04d}.npz"
        with replacing(self.folder / weights) as tmp, open(tmp, "wb") as handle:
            np.savez(handle, *model.get_weights())  # a file object: np.savez would append .npz to a name
        self.record = {"epoch": validation.epoch, SCORE: validation.score, "weights": weights,
                       "metrics": validation.metrics, "diagnostics": validation.diagnostics}
        write_json(self.folder / BEST_FILE, self.record)
        for old in self.folder.glob("weights-*.npz"):
            if old.name != weights:
                old.unlink()
        return True

    def restore(self, model) -> None:
        """Load the best weights into `model` (the same architecture that wrote them)."""
        path = self.folder / self.record["weights"]
        with np.load(path) as saved:
            weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        current = model.get_weights()
        if [w.shape for w in weights] != [w.shape for w in current]:
            raise QatpipeError(f"{path}: the best epoch's weights do not fit this model; use a new results "
                               "directory (or delete the old one) to start over")
        model.set_weights(weights)


class ValidateEveryN(keras.callbacks.Callback):
    """Validates every `interval` epochs and after the last one; adds the `val_*` numbers to the epoch's logs
    (callbacks after it see them) and offers the weights to `best`. Rank 0 only under Horovod: it validates
    after the epoch's collective averaging, while the other ranks wait at the next step's all-reduce."""

    def __init__(self, validator: Validator, interval: int, epochs: int, best: BestCheckpoint):
        super().__init__()
        self.validator, self.interval, self.epochs, self.best = validator, interval, epochs, best
        self.last: Validation | None = None

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        if done % self.interval and done != self.epochs:
            return
        validation = self.validator(self.model, done)
        if logs is not None:
            logs.update(validation.metrics)
        improved = self.best.offer(validation, self.model)
        self.last = validation
        record = self.best.record
        log.info("epoch %d/%d validation: val loss %.4f  mAP@0.5 %.4f  mAP@[.5:.95] %.4f  (%s; %.1f s)", done,
                 self.epochs, validation.metrics["val_loss"], validation.score, validation.metrics["val_map"],
                 "best so far" if improved else f"best {record[SCORE]:.4f} at epoch {record['epoch']}",
                 validation.seconds)


__all__ = ["Validator", "Validation", "ValidateEveryN", "BestCheckpoint", "BEST_DIR", "SCORE"]
