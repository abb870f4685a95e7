"""Real (tiny) training runs: mAP rises above chance; a pre-empted run resumes where it stopped."""

from __future__ import annotations

import csv
import json
import logging
import os

import pytest
import tf_keras as keras

from conftest import SMALL_IMAGES, Preempted, PreemptAfter
from qatpipe.errors import QatpipeError
from qatpipe.stages.evaluate import evaluate
from qatpipe.stages.train import train

pytestmark = pytest.mark.slow


def test_tiny_training_learns_to_detect(trained_tiny, tmp_path):
    """The session's tiny detector (conftest's trained_tiny: the tiny spec for 6 epochs, which the export, engine
    and pruning tests use too) wrote its files and learnt. The tiny spec's full 20 epochs and mAP@0.5 > 0.3 after
    them are checked by test_local_pipeline.py, whose train stage is that training (evaluate-unpruned's mAP)."""
    spec, model = trained_tiny
    run = model.parent
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["epochs_run"] == spec.train.epochs == 6 and summary["images_per_second"] > 0
    for name in ("model.keras", "spec.yaml", "train_summary.json", "training_log.csv"):
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").rglob("events.out.tfevents.*"))
    with open(run / "training_log.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["epoch"]) for r in rows] == list(range(spec.train.epochs))
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])

    result = evaluate(spec, model, tmp_path / "eval")
    # chance is ~0: an untrained DetectNet_v2 fires nowhere (coverage bias prior) or everywhere (val mAP@0.5 0.015
    # after one epoch in test_local_pipeline's run). After these 6 epochs, measured with train.seed 42 (the
    # fixture's), 1 and 2: 0.219, 0.260, 0.210
    assert result["map50"] > 0.1, result
    assert 0 < result["map"] < result["map50"]
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert saved["map50"] == pytest.approx(result["map50"])
    assert set(saved["per_class"]) == {"car", "pedestrian", "cyclist"}
    assert (tmp_path / "eval" / "pr_curves.png").stat().st_size > 5000


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_preempted_training_resumes_from_the_checkpoint(tiny_spec, tmp_path, caplog):
    spec = tiny_spec("train.epochs=4", "train.checkpoint_interval=2", "model.backbone.width=0.125", *SMALL_IMAGES)
    run = tmp_path / "run"
    with pytest.raises(Preempted):  # killed after epoch 3; the last checkpoint is epoch 2
        train(spec, run, extra_callbacks=[PreemptAfter(3)])
    assert not (run / "model.keras").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("ckpt-*.index")) == ["ckpt-2.index"]

    with caplog.at_level(logging.INFO):
        summary = train(spec, run)
    assert "resuming from" in caplog.text and "at epoch 2/4" in caplog.text
    assert summary["resumed_from_epoch"] == 2 and summary["epochs_run"] == 2
    with open(run / "training_log.csv") as handle:  # epoch 2 was trained twice, logged once
        assert [int(r["epoch"]) for r in csv.DictReader(handle)] == [0, 1, 2, 3]

    summary_bytes, model_mtime = (run / "train_summary.json").read_bytes(), (run / "model.keras").stat().st_mtime_ns
    again = train(spec, run)  # a finished run is neither trained nor rewritten
    assert again == summary
    assert (run / "train_summary.json").read_bytes() == summary_bytes
    assert (run / "model.keras").stat().st_mtime_ns == model_mtime
    assert oct((run / "train_summary.json").stat().st_mode & 0o777) == oct(0o666 & ~_umask())

    (run / "model.keras").unlink()  # stopped after the last checkpoint, before the export
    assert train(spec, run)["epochs_run"] == 0 and (run / "model.keras").is_file()


def test_resume_refuses_a_different_experiment(tiny_spec, tmp_path):
    run = tmp_path / "run"
    train(tiny_spec("train.epochs=2", "model.backbone.width=0.0625", *SMALL_IMAGES), run)
    with pytest.raises(QatpipeError, match="whose model.backbone differs"):
        train(tiny_spec("train.epochs=3", "model.backbone.width=0.125", *SMALL_IMAGES), run)
    with pytest.raises(QatpipeError, match="whose train.batch_size, train.seed differs"):
        train(tiny_spec("train.epochs=3", "model.backbone.width=0.0625", "train.seed=1", "train.batch_size=4",
                        *SMALL_IMAGES), run)
    with pytest.raises(QatpipeError, match="the checkpoint is at epoch 2, beyond train.epochs=1"):
        train(tiny_spec("train.epochs=1", "model.backbone.width=0.0625", *SMALL_IMAGES), run)


def test_failed_start_leaves_no_claim_on_the_directory(tiny_spec, tmp_path):
    from qatpipe.errors import DataError

    run = tmp_path / "run"
    with pytest.raises(DataError, match="dataset.train: dataset folder not found"):
        train(tiny_spec(f"dataset.train={tmp_path / 'missing'}"), run)
    assert not (run / "spec.yaml").exists()
    # any other spec may start here
    train(tiny_spec("train.epochs=1", "model.backbone.width=0.0625", *SMALL_IMAGES), run)
    (tmp_path / "file").write_text("x")
    with pytest.raises(QatpipeError, match="cannot create the results directory"):
        train(tiny_spec(), tmp_path / "file" / "run")


def test_checkpoints_from_before_the_coverage_normalizer_resume_only_under_tao_mean(tiny_spec, tmp_path):
    """A spec.yaml written before model.loss.coverage_normalizer existed trained with TAO's mean (`cells`)."""
    import yaml

    from qatpipe.stages.train import _check_resume_compatible

    old = tiny_spec().to_dict()
    del old["model"]["loss"]["coverage_normalizer"]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(QatpipeError, match="model.loss differs"):
        _check_resume_compatible(tmp_path, tiny_spec())  # the default: objects
    _check_resume_compatible(tmp_path, tiny_spec("model.loss.coverage_normalizer=cells"))

    # and one written before model.loss.class_weight existed trained without the class term
    old = tiny_spec().to_dict()
    del old["model"]["loss"]["class_weight"]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(QatpipeError, match="model.loss differs"):
        _check_resume_compatible(tmp_path, tiny_spec())  # the default: 1
    _check_resume_compatible(tmp_path, tiny_spec("model.loss.class_weight=0"))
