"""Keras callbacks: progress on the console through logging, the per-epoch CSV log, and periodic checkpoints
for resume."""

from __future__ import annotations

import csv
import io
import logging
import re
import time
from pathlib import Path

import tensorflow as tf
import tf_keras as keras

from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text

log = logging.getLogger("qatpipe.train")


def duration(seconds: float) -> str:
    """A duration as people read it: 45s, 3m05s, 1h02m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLogger(keras.callbacks.Callback):
    """Logs loss, learning rate and images/s every N steps and at each epoch end."""

    def __init__(self, steps_per_epoch: int, epochs: int, batch_size: int, every_n_steps: int):
        super().__init__()
        self.steps_per_epoch, self.epochs = steps_per_epoch, epochs
        self.batch_size, self.every = batch_size, every_n_steps
        self.images = 0
        self.train_seconds = 0.0
        self.epoch_seconds: list[float] = []  # the first includes tracing: benchmarks skip it

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch, self.epoch_start, self.window_start = epoch, time.perf_counter(), time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.every == 0 and batch + 1 < self.steps_per_epoch:
            now = time.perf_counter()
            rate = self.every * self.batch_size / max(now - self.window_start, 1e-9)
            # the epoch's ETA from its own pace so far; the stage's adds the epochs left at that pace
            per_step = (now - self.epoch_start) / (batch + 1)
            epoch_left = per_step * (self.steps_per_epoch - batch - 1)
            stage_left = epoch_left + per_step * self.steps_per_epoch * (self.epochs - self.epoch - 1)
            log.info("epoch %d/%d step %d/%d  loss %.4f  %.1f img/s  ETA epoch %s, stage %s", self.epoch + 1,
                     self.epochs, batch + 1, self.steps_per_epoch, (logs or {}).get("loss", float("nan")), rate,
                     duration(epoch_left), duration(stage_left))
            self.window_start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        seconds = time.perf_counter() - self.epoch_start
        self.images += self.steps_per_epoch * self.batch_size
        self.train_seconds += seconds
        self.epoch_seconds.append(round(seconds, 3))
        lr = self.model.optimizer.learning_rate
        lr = float(lr(self.model.optimizer.iterations)) if callable(lr) else float(lr)
        parts = "  ".join(f"{k} {v:.4f}" for k, v in logs.items() if k != "lr")
        # validation included: the mean of this run's epochs (a resumed run's first, with tracing, too)
        left = (self.epochs - epoch - 1) * sum(self.epoch_seconds) / len(self.epoch_seconds)
        log.info("epoch %d/%d done in %.1fs  %s  lr %.2e  %.1f img/s  ETA stage %s", epoch + 1, self.epochs, seconds,
                 parts, lr, self.steps_per_epoch * self.batch_size / max(seconds, 1e-9), duration(left))

    @property
    def images_per_second(self) -> float:
        return self.images / self.train_seconds if self.train_seconds else 0.0


class EpochLog(keras.callbacks.Callback):
    """training_log.csv: one row per epoch (`epoch` counts from 0, as Keras does), a column per number in the
    epoch's logs, in Keras CSVLogger's layout. Unlike CSVLogger it keeps every column it has seen, also across
    a resume, so `val_*` columns appear even when the first epoch is not validated; an epoch without a value
    (not validated that epoch) has an empty cell, never "NA". The file is rewritten whole (atomically) each
    epoch; with one row per epoch it stays small."""

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)

    def on_epoch_end(self, epoch, logs=None):
        rows = []
        if self.path.is_file():
            with self.path.open(newline="") as handle:
                rows = [row for row in csv.DictReader(handle) if int(row["epoch"]) != epoch]
        rows.append({"epoch": epoch, **{key: float(value) for key, value in (logs or {}).items()}})
        columns = sorted({key for row in rows for key in row} - {"epoch"})
        text = io.StringIO()
        writer = csv.DictWriter(text, ["epoch", *columns], restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.path, text.getvalue())


class CheckpointEveryN(keras.callbacks.Callback):
    """Saves model + optimizer + epoch counter every `interval` epochs and after the last one."""

    def __init__(self, manager: tf.train.CheckpointManager, epoch_var: tf.Variable, interval: int, epochs: int):
        super().__init__()
        self.manager, self.epoch_var, self.interval, self.epochs = manager, epoch_var, interval, epochs

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        if done % self.interval == 0 or done == self.epochs:
            self.epoch_var.assign(done)
            try:
                path = self.manager.save(checkpoint_number=done)
            except (tf.errors.OpError, OSError) as exc:  # e.g. a full disk: name the folder, not TF's traceback
                reason = re.sub(r"\{\{[^}]*\}\}\s*", "", getattr(exc, "message", None) or str(exc)).strip()
                raise QatpipeError(f"{self.manager.directory}: cannot write the epoch {done} checkpoint: "
                                   f"{reason}") from None
            log.info("checkpoint: %s (epoch %d)", path, done)
