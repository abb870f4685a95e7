"""qat.start: where each of the pipeline's retrains starts (stages/retrain_plan.plan_retrain), the FP32 baseline
handed on under TAO's order, and the FP32 control's own stage name through the training paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qatpipe.spec import bundled_spec_path, load_spec
from qatpipe.stages.retrain import hand_on
from qatpipe.stages.retrain_plan import FINETUNE_FP32, plan_retrain
from qatpipe.tracking.records import StageRecord

PRUNED, RETRAINED, BASELINE = Path("/p/pruned.keras"), Path("/r/model.keras"), Path("/b/model.keras")


def _spec(*sets: str):
    """The full recipe (the default's before the quick run): two FP32 trainings after pruning."""
    return load_spec(bundled_spec_path("full"), list(sets))


@pytest.mark.parametrize("start", ["pruned", "fp32", "baseline"])
@pytest.mark.parametrize("qat", [False, True])
def test_the_first_retrain_starts_from_the_pruned_model(start, qat):
    plan = plan_retrain(_spec(f"qat.start={start}", "qat.finetune_epochs=3"), qat, PRUNED)
    assert (plan.source, plan.epochs, plan.hands_on) == (PRUNED, 8, False)  # retrain.epochs of the full spec
    assert plan.stage_name == ("retrain_qat" if qat else "retrain_fp32")


def test_tao_order_retrains_qat_from_the_pruned_model_and_hands_the_fp32_retrain_on():
    spec = _spec("qat.start=pruned", "qat.finetune_epochs=3")  # finetune_epochs only counts for start fp32
    qat = plan_retrain(spec, True, PRUNED, RETRAINED)
    assert (qat.source, qat.epochs, qat.stage_name) == (PRUNED, 8, "retrain_qat")
    baseline = plan_retrain(spec, False, PRUNED, RETRAINED)
    assert baseline.hands_on and (baseline.source, baseline.stage_name) == (RETRAINED, FINETUNE_FP32)


def test_fp32_order_fine_tunes_the_retrained_model_as_long_in_qat_and_in_fp32():
    for sets, epochs in ((["qat.finetune_epochs=3"], 3), ([], 8), (["retrain.epochs=null", "train.epochs=5"], 5)):
        spec = _spec("qat.start=fp32", *sets)
        qat, baseline = plan_retrain(spec, True, PRUNED, RETRAINED), plan_retrain(spec, False, PRUNED, RETRAINED)
        assert (qat.source, qat.epochs, qat.stage_name) == (RETRAINED, epochs, "retrain_qat"), sets
        assert (baseline.source, baseline.epochs, baseline.stage_name) == (RETRAINED, epochs, FINETUNE_FP32), sets
        assert not baseline.hands_on


def test_baseline_order_fine_tunes_the_baseline_briefly_in_qat_and_makes_the_baseline_as_fp32_does():
    spec = _spec("qat.start=baseline", "qat.finetune_epochs=5", "qat.epochs=3",
                 "qat.learning_rate={max_lr: 1.0e-4, min_lr: 1.0e-7}")
    qat = plan_retrain(spec, True, PRUNED, RETRAINED, BASELINE)
    assert (qat.source, qat.epochs, qat.stage_name) == (BASELINE, 3, "retrain_qat")
    trained = qat.applied(spec)
    assert (trained.retrain.epochs, trained.train.learning_rate.max_lr, trained.train.learning_rate.min_lr) == \
        (3, 1.0e-4, 1.0e-7)
    for baseline in (None, BASELINE):  # the FP32 baseline itself is fine-tuned as under start fp32
        fp32 = plan_retrain(spec, False, PRUNED, RETRAINED, baseline)
        assert (fp32.source, fp32.epochs, fp32.stage_name, fp32.learning_rate) == (RETRAINED, 5, FINETUNE_FP32, None)
    default = _spec()  # the full spec's order, with its own short recipe: 2 epochs at a tenth of train's peak
    applied = plan_retrain(default, True, PRUNED, RETRAINED, BASELINE).applied(default)
    assert (applied.retrain.epochs, applied.train.learning_rate.max_lr) == (2, 2.0e-4)
    for start in ("fp32", "pruned"):  # the baseline given to every QAT task counts only under start baseline
        assert plan_retrain(_spec(f"qat.start={start}"), True, PRUNED, RETRAINED, BASELINE).source != BASELINE


def test_finetune_epochs_0_makes_the_fp32_retrain_the_baseline_and_qat_fine_tunes_it():
    """The quick default's order: one FP32 training after pruning, handed on as the baseline."""
    spec = _spec("qat.finetune_epochs=0")
    baseline = plan_retrain(spec, False, PRUNED, RETRAINED)
    assert baseline.hands_on and (baseline.source, baseline.stage_name) == (RETRAINED, FINETUNE_FP32)
    qat = plan_retrain(spec, True, PRUNED, RETRAINED, RETRAINED)  # the pipeline hands finetune-fp32's model on
    assert (qat.source, qat.epochs, qat.stage_name) == (RETRAINED, 2, "retrain_qat")
    quick = load_spec(bundled_spec_path("default"))
    assert plan_retrain(quick, False, PRUNED, RETRAINED).hands_on
    assert plan_retrain(quick, False, PRUNED).epochs == quick.retrain.epochs


@pytest.mark.parametrize("start", ["pruned", "fp32"])
def test_finetune_epochs_0_is_refused_outside_the_baseline_order(start):
    from qatpipe.errors import SpecError

    with pytest.raises(SpecError, match="finetune_epochs 0.*needs start: baseline"):
        _spec(f"qat.start={start}", "qat.finetune_epochs=0")


def test_baseline_order_without_the_baseline_is_refused():
    from qatpipe.errors import QatpipeError

    with pytest.raises(QatpipeError, match="qat.start is baseline.*finetune-fp32"):
        plan_retrain(_spec("qat.start=baseline"), True, PRUNED, RETRAINED)


def test_the_fine_tunings_and_only_they_train_under_qat_finetune_learning_rate():
    spec = _spec("qat.start=fp32", "qat.finetune_learning_rate={max_lr: 2.0e-4, min_lr: 1.0e-6}",
                 "qat.finetune_epochs=3")
    for qat in (False, True):
        trained = plan_retrain(spec, qat, PRUNED, RETRAINED).applied(spec)
        assert (trained.retrain.epochs, trained.train.learning_rate.max_lr, trained.train.learning_rate.min_lr) == \
            (3, 2.0e-4, 1.0e-6)
        first = plan_retrain(spec, qat, PRUNED).applied(spec)  # the FP32 retrain of the pruned model: train's
        assert (first.retrain.epochs, first.train.learning_rate) == (8, spec.train.learning_rate)
    tao = _spec("qat.start=pruned", "qat.finetune_learning_rate={max_lr: 2.0e-4}")
    assert plan_retrain(tao, True, PRUNED, RETRAINED).applied(tao).train.learning_rate == tao.train.learning_rate
    unset = _spec("qat.start=fp32")  # no schedule of its own: train.learning_rate's
    assert plan_retrain(unset, True, PRUNED, RETRAINED).applied(unset).train.learning_rate == unset.train.learning_rate
    assert spec.train.learning_rate.max_lr == 2.0e-3  # the spec applied is a copy


def test_a_bad_fine_tuning_schedule_is_refused_naming_its_key():
    from qatpipe.errors import SpecError

    with pytest.raises(SpecError, match=r"qat.finetune_learning_rate: .*min_lr \(0.01\) > max_lr \(0.001\)"):
        _spec("qat.finetune_learning_rate={min_lr: 1.0e-2, max_lr: 1.0e-3}")
    with pytest.raises(SpecError, match=r"qat.finetune_learning_rate.warmup: unknown key"):
        _spec("qat.finetune_learning_rate={max_lr: 1.0e-3, warmup: 2}")


def test_an_unknown_start_is_refused_by_the_spec():
    from qatpipe.errors import QatpipeError

    with pytest.raises(QatpipeError, match="qat.start"):
        _spec("qat.start=unpruned")


def test_hand_on_copies_the_retrain_and_records_that_nothing_was_trained(tmp_path):
    retrained = tmp_path / "retrain"
    retrained.mkdir()
    (retrained / "model.keras").write_bytes(b"weights")
    (retrained / "train_summary.json").write_text(json.dumps({"params": 7, "epochs": 8}))
    StageRecord("retrain_fp32", metrics={"final_loss": 1.0}).write(retrained)

    summary = hand_on(retrained, tmp_path / "baseline")
    assert summary == {"params": 7, "epochs": 8}
    assert (tmp_path / "baseline" / "model.keras").read_bytes() == b"weights"
    record = StageRecord.read(tmp_path / "baseline")
    assert record.stage == FINETUNE_FP32 and record.params == {"trained": False}
    assert not record.metrics  # the FP32 retrain's figures are logged once, under its own stage
    assert StageRecord.read(retrained).stage == "retrain_fp32"  # the source is left as it was


@pytest.mark.slow
def test_the_fp32_control_trains_under_its_own_stage_name(trained_tiny, tmp_path):
    from qatpipe.stages.scale_out import run_training_stage

    spec, model = trained_tiny
    spec = spec.model_copy(deep=True)
    spec.qat.start, spec.retrain.epochs = "fp32", 1
    summary = run_training_stage("retrain", spec, tmp_path / "control", pruned_model=model, stage_name=FINETUNE_FP32)
    record = StageRecord.read(tmp_path / "control")
    assert summary["epochs"] == 1 and record.stage == FINETUNE_FP32
    assert record.params["qat.start"] == "fp32" and record.params["qat.enabled"] is False


def test_the_stage_name_reaches_horovod_and_cluster_commands():
    from qatpipe.cli import build_parser
    from qatpipe.stages.scale_out import _command

    command = _command("retrain", Path("s.yaml"), Path("out"), Path("m.keras"), FINETUNE_FP32)
    assert command == ["retrain", "-e", "s.yaml", "-r", "out", "-m", "m.keras", "--stage-name", FINETUNE_FP32]
    assert build_parser().parse_args(command).stage_name == FINETUNE_FP32
    assert "--stage-name" not in _command("retrain", Path("s.yaml"), Path("out"), Path("m.keras"))


@pytest.mark.parametrize("flags", [["--baseline"], ["--baseline", "--qat", "--finetune"]])
def test_the_cli_baseline_flag_is_qat_alone_and_refused_before_anything_is_read(flags, tmp_path, caplog):
    from qatpipe.cli import main

    argv = ["retrain", "-e", "tiny", "-m", str(tmp_path / "missing.keras"), "-r", str(tmp_path / "out"), *flags]
    assert main(argv) == 2
    assert "--baseline is QAT's fine-tuning of the FP32 baseline" in caplog.text
    assert not [path for path in (tmp_path / "out").glob("*") if path.name != ".qatpipe.lock"]  # nothing trained


def test_the_cli_finetune_of_a_spec_without_fp32_fine_tuning_is_refused_before_any_data_is_made(tmp_path, caplog,
                                                                                                monkeypatch):
    from qatpipe.cli import main

    monkeypatch.chdir(tmp_path)  # the spec's .qatpipe-cache, where a generated data set would land
    argv = ["retrain", "-e", "default", "-m", "missing.keras", "-r", "out", "--finetune"]
    assert main(argv) == 2
    assert "--finetune: qat.finetune_epochs is 0 in this spec" in caplog.text
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("*.jpg"))  # no synthetic set was made
