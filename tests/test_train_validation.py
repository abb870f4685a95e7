"""Validation during training: val loss and mAP per epoch in training_log.csv (numbers `evaluate` agrees with),
the best epoch's weights as model.keras, kept across a resume; the training itself unchanged."""

from __future__ import annotations

import csv
import json
import logging
import re

import numpy as np
import pytest
import tf_keras as keras

from conftest import SMALL_IMAGES, Preempted, PreemptAfter
from qatpipe.errors import QatpipeError
from qatpipe.stages.train import train
from qatpipe.tracking.records import StageRecord
from qatpipe.training.validation import BestCheckpoint, Validation

VAL_COLUMNS = ("val_loss", "val_output_cov_loss", "val_output_bbox_loss", "val_map50", "val_map",
               "val_class_agnostic_map50", "val_class_accuracy")


def read_log(run):
    with open(run / "training_log.csv") as handle:
        return list(csv.DictReader(handle))


def weights_of(path):
    return keras.models.load_model(path, compile=False).get_weights()


class _RecordWeights(keras.callbacks.Callback):
    """The weights each epoch ended with (after its validation), by epoch counted from 1."""

    def __init__(self):
        super().__init__()
        self.by_epoch = {}

    def on_epoch_end(self, epoch, logs=None):
        self.by_epoch[epoch + 1] = self.model.get_weights()


class _Blind(keras.callbacks.Callback):
    """From epoch `start` on, each epoch starts with the coverage head switched off (zero kernel, bias -20):
    nothing reaches the decoder's threshold, so those epochs score mAP 0 and cannot be the best."""

    def __init__(self, start):
        super().__init__()
        self.start = start

    def on_epoch_begin(self, epoch, logs=None):
        if epoch + 1 >= self.start:
            layer = self.model.get_layer("conv_cov")
            kernel, bias = layer.get_weights()
            layer.set_weights([np.zeros_like(kernel), np.full_like(bias, -20.0)])


@pytest.mark.slow
def test_every_epoch_is_validated_and_the_best_weights_survive_a_resume(tiny_spec, tmp_path):
    spec = tiny_spec("train.epochs=5", *SMALL_IMAGES)
    run, weights = tmp_path / "run", _RecordWeights()
    with pytest.raises(Preempted):  # killed after epoch 3 (validated, checkpointed)
        train(spec, run, extra_callbacks=[weights, PreemptAfter(3)])
    before = json.loads((run / "best" / "best.json").read_text())
    assert 1 <= before["epoch"] <= 3

    # after the resume every epoch starts blind: the best must be one of the epochs before the interruption
    summary = train(spec, run, extra_callbacks=[weights, _Blind(start=4)])
    rows = read_log(run)
    assert [int(row["epoch"]) for row in rows] == [0, 1, 2, 3, 4]
    for row in rows:
        for column in VAL_COLUMNS[:-1]:
            float(row[column])  # a number in every row: no NA, no empty cell
    map50 = [float(row["val_map50"]) for row in rows]
    assert map50[3:] == [0.0, 0.0] and max(map50[:3]) > 0
    # class accuracy among found objects: none found in the blind epochs, so no value
    assert [row["val_class_accuracy"] == "" for row in rows] == [False, False, False, True, True]
    best_epoch = int(np.argmax(map50)) + 1
    assert best_epoch == before["epoch"]
    assert summary["kept"] == "best" and summary["kept_epoch"] == summary["best_epoch"] == best_epoch
    assert summary["best_val_map50"] == pytest.approx(max(map50), abs=1e-12)
    assert summary["validation"]["val_map50"] == summary["best_val_map50"]
    for kept, recorded in zip(weights_of(run / "model.keras"), weights.by_epoch[best_epoch], strict=True):
        np.testing.assert_array_equal(kept, recorded)
    assert sorted(p.name for p in (run / "best").iterdir()) == ["best.json", f"weights-{best_epoch:04d}.npz"]

    assert summary["diagnostics"]["epoch"] == best_epoch and "findings" in summary["diagnostics"]
    saved = json.loads((run / "train_summary.json").read_text())
    assert (saved["kept"], saved["best_epoch"]) == ("best", best_epoch)
    record = StageRecord.read(run)  # the per-epoch numbers become MLflow metric history, stepped by epoch
    assert record.history["val_map50"] == [[epoch, value] for epoch, value in enumerate(map50, start=1)]
    assert record.metrics["best_epoch"] == best_epoch and record.tags["qatpipe.kept"] == "best"
    assert record.metrics["best_val_map50"] == summary["best_val_map50"]


def test_val_targets_keep_every_object_beyond_the_training_batch_limit(tiny_spec):
    """dataset.max_boxes_per_image bounds a training batch; validation, like evaluate, takes crowded val images
    whole (it used to refuse them)."""
    from qatpipe.data.pipeline import eval_targets
    from qatpipe.data.splits import load_split
    from qatpipe.models import get_architecture

    spec = tiny_spec()
    samples = load_split(spec, "val")
    most = max(len(s.classes) for s in samples)
    assert most > 1
    arch = get_architecture(spec)
    expected = [b for b in eval_targets(samples, spec, arch)]
    spec.dataset.max_boxes_per_image = 1
    for batch, want in zip(eval_targets(samples, spec, arch), expected, strict=True):
        assert set(batch) == set(want) == set(arch.output_names)
        for name in want:
            np.testing.assert_array_equal(batch[name].numpy(), want[name].numpy())


def test_validation_during_training_scores_a_fixed_sample_and_evaluate_the_whole_val_set(tiny_spec, tmp_path,
                                                                                         monkeypatch, caplog):
    """train.val_images: every validation (each epoch, each training stage, any train.seed) scores the same
    seeded sample of that many val images; evaluate scores every val image."""
    import logging

    import qatpipe.inference
    import qatpipe.stages.evaluate
    from qatpipe.data.splits import load_split
    from qatpipe.fileio import save_keras_model
    from qatpipe.models import get_architecture
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.train import _validator, validation_samples

    def names(samples):
        return [sample.image_path.name for sample in samples]

    scored = []  # the images each predict call decoded, validation's and evaluate's

    def recording(real):
        def predict(forward, samples, *args, **kwargs):
            scored.append(names(samples))
            return real(forward, samples, *args, **kwargs)
        return predict

    monkeypatch.setattr(qatpipe.inference, "predict", recording(qatpipe.inference.predict))  # Validator's import
    monkeypatch.setattr(qatpipe.stages.evaluate, "predict", recording(qatpipe.stages.evaluate.predict))

    spec = tiny_spec("train.val_images=10", "model.backbone.width=0.125", *SMALL_IMAGES)
    everything = names(load_split(spec, "val"))
    arch = get_architecture(spec)
    with caplog.at_level(logging.INFO, logger="qatpipe.stages.train"):
        validator = _validator(spec, arch)
    assert f"scores 10 of the {len(everything)} dataset.val images" in caplog.text
    sample = names(validator.samples)
    assert len(sample) == 10 < len(everything) and set(sample) < set(everything)
    # another training stage's spec (a retrain; another train.seed) draws the same images; null or a count
    # above the split's size: all of them
    assert names(validation_samples(tiny_spec("train.val_images=10", "train.seed=7"))) == sample
    assert names(validation_samples(tiny_spec("train.val_images=null"))) == everything
    assert names(validation_samples(tiny_spec("train.val_images=1000"))) == everything

    model = arch.build_model()
    model.compile(loss=arch.losses())
    for epoch in (1, 2):  # two epochs' validations
        validator(model, epoch)
    evaluate(spec, save_keras_model(model, tmp_path / "model.keras"), tmp_path / "eval")
    assert scored == [sample, sample, everything]
    assert StageRecord.read(tmp_path / "eval").params["val_images"] == len(everything)


@pytest.mark.slow
def test_validation_scores_as_evaluate_does_and_leaves_the_training_alone(tiny_spec, tmp_path):
    import tensorflow as tf

    from qatpipe.data.pipeline import eval_dataset, eval_targets
    from qatpipe.data.splits import load_split
    from qatpipe.models import get_architecture
    from qatpipe.stages.evaluate import evaluate

    overrides = ("train.epochs=3", "model.backbone.width=0.125", "train.keep=last", *SMALL_IMAGES)
    spec = tiny_spec(*overrides, "train.validation_interval=2")
    summary = train(spec, tmp_path / "validated")
    train(tiny_spec(*overrides, "train.validation_interval=0"), tmp_path / "plain")

    rows, plain = read_log(tmp_path / "validated"), read_log(tmp_path / "plain")
    for row, other in zip(rows, plain, strict=True):  # the same batches and augmentation, the same steps
        assert {k: v for k, v in row.items() if not k.startswith("val_")} == other
    assert all(row[column] == "" for column in VAL_COLUMNS for row in rows[:1])  # epoch 1: not validated
    assert not any(key.startswith("val_") for key in plain[0])
    history = StageRecord.read(tmp_path / "validated").history
    assert [step for step, _ in history["val_map50"]] == [2, 3]

    last = {key: float(value) for key, value in rows[-1].items()}
    assert summary["kept"] == "last" and summary["kept_epoch"] == 3
    assert summary["validation"] == {key: last[key] for key in summary["validation"]}
    evaluation = evaluate(spec, tmp_path / "validated" / "model.keras", tmp_path / "eval")
    assert (evaluation["map50"], evaluation["map"]) == (last["val_map50"], last["val_map"])
    assert evaluation["diagnostics"]["class_accuracy"] == last["val_class_accuracy"]

    # Keras's own evaluation of the compiled losses on the val set's targets
    arch = get_architecture(spec)
    model = keras.models.load_model(tmp_path / "validated" / "model.keras", compile=False)
    model.compile(loss=arch.losses())
    samples = load_split(spec, "val")
    assert summary["val_images"] == len(samples)  # fewer than train.val_images: all of them, as evaluate scores
    losses = model.evaluate(tf.data.Dataset.zip((eval_dataset(samples, spec), eval_targets(samples, spec, arch))),
                            return_dict=True, verbose=0)
    for key in ("loss", "output_cov_loss", "output_bbox_loss"):
        assert last[f"val_{key}"] == pytest.approx(losses[key], rel=1e-5), key
    assert float(rows[1]["val_loss"]) != pytest.approx(losses["loss"], rel=1e-3)  # and it is the last epoch's


@pytest.mark.slow
def test_qat_retraining_validates_the_quantized_model_and_freezes_late(trained_tiny, tmp_path, caplog):
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.retrain import retrain

    spec, model = trained_tiny
    spec = spec.model_copy(deep=True)
    spec.qat.enabled, spec.retrain.epochs, spec.qat.calibration_batches = True, 2, 2
    # its second epoch with BatchNormalization's statistics and the ranges frozen (test_qat.py: what that does)
    spec.qat.bn_update_epochs, spec.qat.range_update_epochs = 1, 1
    with caplog.at_level(logging.INFO, "qatpipe.qat"):
        summary = retrain(spec, model, tmp_path / "qat")
    assert re.search(r"QAT from epoch 2: [1-9]\d* BatchNormalization layers use their moving statistics; [1-9]\d* "
                     r"activation ranges stay as they are", caplog.text)
    rows = read_log(tmp_path / "qat")
    assert len(rows) == 2 and all(float(row["val_map50"]) > 0 for row in rows)
    assert summary["kept"] == "best" and summary["best_val_map50"] == max(float(row["val_map50"]) for row in rows)
    evaluation = evaluate(spec, summary["model"], tmp_path / "eval")  # the saved QAT model, loaded back
    assert evaluation["map50"] == summary["best_val_map50"]
    assert evaluation["map"] == summary["validation"]["val_map"]


def test_best_checkpoint_keeps_the_best_epoch_across_instances(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    def offer(best, epoch, score):
        model.set_weights([np.full_like(w, epoch) for w in model.get_weights()])
        return best.offer(Validation(epoch, {"val_map50": score}, {"findings": []}, 0.0), model)

    best = BestCheckpoint(tmp_path / "best")
    assert offer(best, 1, 0.3) and not offer(best, 2, 0.2) and offer(best, 3, 0.3)  # a tie goes to the later
    assert best.record["epoch"] == 3 and offer(best, 4, 0.5)
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["best.json", "weights-0004.npz"]

    resumed = BestCheckpoint(tmp_path / "best", resumed_at=5)  # a run resumed after epoch 5 reads it back
    assert (resumed.record["epoch"], resumed.record["val_map50"]) == (4, 0.5)
    resumed.restore(model)
    assert all((w == 4).all() for w in model.get_weights())
    assert not offer(resumed, 6, 0.1) and resumed.record["epoch"] == 4

    with pytest.raises(QatpipeError, match="do not fit this model"):
        resumed.restore(keras.Sequential([keras.Input((3,)), keras.layers.Dense(5)]))
    # resumed at epoch 3: the record of epoch 4 came from an attempt whose epoch 4 is trained again
    assert BestCheckpoint(tmp_path / "best", resumed_at=3).record is None
    assert not (tmp_path / "best" / "best.json").exists()
    offer(BestCheckpoint(tmp_path / "best"), 2, 0.9)
    assert BestCheckpoint(tmp_path / "best", resumed_at=0).record is None  # a new run forgets an old record
