"""The `qatpipe` command: clear one-line errors (exit 2) that name the file and line."""

from __future__ import annotations

import logging

import pytest

from conftest import kitti_line, write_kitti
from qatpipe.cli import main


def test_bad_label_is_reported_with_file_and_line(tmp_path, caplog):
    root = write_kitti(tmp_path / "ds", {"000001": kitti_line() + "\n" + kitti_line("car", 10, 20, 500, 60)})
    with caplog.at_level(logging.ERROR):
        code = main(["train", "-e", "tiny", "-r", str(tmp_path / "run"), "--set", f"dataset.train={root}",
                     "--set", f"dataset.val={root}"])
    assert code == 2
    assert f"{root / 'labels' / '000001.txt'}:2: box 10.0 20.0 500.0 60.0 lies outside" in caplog.text
    assert "Traceback" not in caplog.text


def test_missing_dataset_names_the_spec_key(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        code = main(["train", "-e", "tiny", "-r", str(tmp_path / "run"),
                     "--set", f"dataset.train={tmp_path / 'nowhere'}"])
    assert code == 2
    assert f"{tmp_path / 'nowhere'}: dataset.train: dataset folder not found" in caplog.text


def test_missing_model_file(tmp_path, caplog, tiny_dataset):
    with caplog.at_level(logging.ERROR):
        code = main(["evaluate", "-e", "tiny", "-m", str(tmp_path / "m.keras"),
                     "--set", f"dataset.val={tiny_dataset / 'val'}"])
    assert code == 2
    assert "m.keras: model file not found" in caplog.text


def test_spec_show_and_bad_override(capsys, caplog):
    assert main(["spec", "show", "-e", "tiny", "--set", "train.epochs=9"]) == 0
    assert "epochs: 9" in capsys.readouterr().out
    with caplog.at_level(logging.ERROR):
        assert main(["spec", "show", "-e", "tiny", "--set", "train.epochs=-1"]) == 2
    assert "--set train.epochs=-1: train.epochs: must be >= 1 (got -1)" in caplog.text


def test_a_mistyped_override_is_named_with_the_nearest_key(caplog):
    """Issue 58: the override is blamed, not the bundled spec file it was applied to, and the key it meant named."""
    with caplog.at_level(logging.ERROR):
        assert main(["spec", "show", "-e", "default", "--set", "train.epoch=5"]) == 2
    assert "--set train.epoch=5: train.epoch: unknown key (did you mean train.epochs?)" in caplog.text
    assert "default.yaml" not in caplog.text


def test_bad_prune_settings_are_one_line_without_pydantic_text(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        assert main(["prune", "-m", str(tmp_path / "m.keras"), "-o", str(tmp_path / "out"),
                     "--target-flops-ratio", "2"]) == 2
    assert "prune settings: target_flops_ratio: must be <= 1 (got 2.0)" in caplog.text
    assert "pydantic" not in caplog.text and "\n" not in caplog.records[-1].getMessage()


def test_synth_refuses_to_overwrite(tmp_path, caplog):
    assert main(["data", "synth", "--out", str(tmp_path), "--train", "2", "--val", "1", "--height", "96",
                 "--width", "160"]) == 0
    before = sorted(p.read_bytes() for p in (tmp_path / "train" / "labels").iterdir())
    with caplog.at_level(logging.ERROR):
        assert main(["data", "synth", "--out", str(tmp_path), "--train", "2", "--val", "1", "--seed", "5"]) == 2
    assert sorted(p.read_bytes() for p in (tmp_path / "train" / "labels").iterdir()) == before


@pytest.mark.parametrize("argv", [["train"], ["evaluate", "-e", "tiny"]])
def test_missing_arguments_exit_with_usage(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


@pytest.mark.parametrize("command", [["train", "-r", "x"], ["retrain", "-m", "pruned.keras", "-r", "x"]])
def test_gpus_below_one_is_refused_before_anything_runs(command, capsys):
    argv = [command[0], "-e", "tiny", *command[1:], "--gpus", "0"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "argument --gpus: 0: need at least 1" in capsys.readouterr().err


def test_compile_mpijob_needs_the_shared_volume(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        assert main(["compile", "-o", str(tmp_path / "p.yaml"), "--mpijob"]) == 2
    assert "--mpijob needs --cache-pvc" in caplog.text and not (tmp_path / "p.yaml").exists()
