"""Faults that must leave nothing broken (issue 34), each fed for real: a second run into a busy results folder,
corrupt checkpoints, an MLflow server killed and restarted, a full disk, links out of the data folder and a
file name that tries to forge a log line."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import SMALL_IMAGES, kitti_line, write_kitti
from qatpipe.errors import DataError, QatpipeError

# ------------------------------------------------------------------ one run per output folder

HOLDER = textwrap.dedent("""
    import sys, time
    from qatpipe.fileio import folder_lock
    with folder_lock(sys.argv[1]):
        print("locked", flush=True)
        open(sys.argv[1] + "/first.txt", "w").write("the first run's result")
        time.sleep(float(sys.argv[2]))
""")


@contextlib.contextmanager
def _holder(folder: Path, seconds: float = 60):
    """A process holding `folder`'s lock, as a running `qatpipe run` / `train` does."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), str(seconds)], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert process.stdout.readline().strip() == "locked"
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_a_second_run_into_a_busy_folder_is_refused_naming_the_folder_and_pid(tmp_path, monkeypatch, caplog):
    from qatpipe.cli import main
    from qatpipe_pipelines.local_run import run_local

    monkeypatch.chdir(tmp_path)  # where a run that started would write its data cache
    out = tmp_path / "results"
    with _holder(out) as first, caplog.at_level(logging.INFO):
        assert main(["run", "--local", "--spec", "tiny", "--output", str(out)]) == 2
        assert main(["train", "-e", "tiny", "-r", str(out)]) == 2
        assert main(["data", "synth", "--out", str(out), "--train", "2", "--val", "1"]) == 2
        with pytest.raises(QatpipeError, match=f"in use by another qatpipe run \\(pid {first.pid}"):
            run_local(out, "tiny")
        assert first.poll() is None  # the first run goes on, its files untouched
        assert (out / "first.txt").read_text() == "the first run's result"
    refusals = [r.getMessage() for r in caplog.records if "in use by another qatpipe run" in r.getMessage()]
    assert len(refusals) == 3 and all(str(out) in m and f"pid {first.pid}" in m for m in refusals)
    # refused before any stage or data work: the refusals are all qatpipe logged, and nothing was written, in the
    # folder or beside it
    assert [r.getMessage() for r in caplog.records if r.name.startswith("qatpipe")] == refusals
    assert sorted(p.name for p in out.iterdir()) == [".qatpipe.lock", "first.txt"]  # nothing of the refused runs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_a_killed_runs_lock_does_not_block(tmp_path):
    from qatpipe.fileio import folder_lock

    with _holder(tmp_path) as first:
        first.send_signal(signal.SIGKILL)
        first.wait()
    with folder_lock(tmp_path):  # the lock died with its process; the file left behind is no claim
        pass


def test_a_failed_block_leaves_no_lock_nor_a_folder_it_made_and_empty(tmp_path):
    """The lock file lives while a run holds the folder; a failed run also takes away the folders it made, when
    empty, and nothing else: not a folder that was there, nor anything written."""
    from qatpipe.fileio import LOCK_FILE, folder_lock

    def fail(folder: Path, write: str | None = None) -> None:
        with pytest.raises(RuntimeError), folder_lock(folder):
            if write:
                (folder / write).write_text("a result")
            raise RuntimeError("the stage failed")

    fail(tmp_path / "new" / "run")
    assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    fail(tmp_path / "there" / "run")
    assert [p.name for p in tmp_path.joinpath("there").iterdir()] == []  # the folder that was there stays
    fail(tmp_path / "wrote", "partial.txt")
    assert [p.name for p in (tmp_path / "wrote").iterdir()] == ["partial.txt"]
    with folder_lock(tmp_path / "done") as folder:
        assert (folder / LOCK_FILE).read_text().startswith(f"{os.getpid()} ")
        (folder / "result.txt").write_text("done")
    assert [p.name for p in (tmp_path / "done").iterdir()] == ["result.txt"]


def test_horovod_processes_share_their_launchers_lock(tmp_path, monkeypatch):
    """`--gpus N` re-runs the command as N processes under the launcher, which holds the folder."""
    from qatpipe.cli import build_parser
    from qatpipe.cli.common import holding

    args = build_parser().parse_args(["train", "-e", "tiny", "-r", str(tmp_path)])
    with _holder(tmp_path):
        monkeypatch.setenv("HOROVOD_SIZE", "2")
        with holding(args):
            pass
        monkeypatch.delenv("HOROVOD_SIZE")
        with pytest.raises(QatpipeError, match="in use"), holding(args):
            pass


# ------------------------------------------------------------------ resume past a bad checkpoint


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).bytes(max(64, path.stat().st_size)))


def _outputs(model_path: Path, images: np.ndarray) -> list[np.ndarray]:
    import tf_keras as keras

    return [np.asarray(o) for o in keras.models.load_model(model_path, compile=False)(images, training=False)]


@pytest.mark.slow
def test_resume_skips_corrupt_newest_checkpoints(tiny_spec, tmp_path, caplog):
    from qatpipe.stages.train import train

    spec = tiny_spec("train.epochs=2", "train.checkpoint_interval=1", "model.backbone.width=0.0625",
                     "train.validation_interval=0", *SMALL_IMAGES)
    uninterrupted = tmp_path / "uninterrupted"
    train(spec, uninterrupted)
    size = spec.dataset.image_size
    images = np.random.default_rng(1).uniform(0, 1, (2, size.height, size.width, 3)).astype(np.float32)
    expected = _outputs(uninterrupted / "model.keras", images)

    # killed while writing epoch 2's checkpoint: its data file cut short, or its index garbled
    faults = {"truncated data": lambda c: _truncate(next(c.glob("ckpt-2.data-*"))),
              "garbled index and state": lambda c: (_garble(c / "ckpt-2.index"), _garble(c / "checkpoint"))}
    for name, fault in faults.items():
        run = tmp_path / name.replace(" ", "_")
        shutil.copytree(uninterrupted, run)
        (run / "model.keras").unlink()
        (run / "train_summary.json").unlink()
        fault(run / "checkpoints")
        caplog.clear()
        with caplog.at_level(logging.INFO):
            summary = train(spec, run)
        assert summary["resumed_from_epoch"] == 1 and summary["epochs_run"] == 1, name
        assert f"checkpoint '{run / 'checkpoints' / 'ckpt-2'}' cannot be read, skipped" in caplog.text, name
        assert "resuming from 'ckpt-1'" in caplog.text, name
        # epoch 2 trained again from epoch 1's checkpoint: what the uninterrupted run computed
        for got, want in zip(_outputs(run / "model.keras", images), expected):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
        assert "ckpt-2" in (run / "checkpoints" / "checkpoint").read_text()  # saved again, whole

    # none readable: one error naming the folder and how to start over, and nothing written
    run = tmp_path / "none"
    shutil.copytree(uninterrupted, run)
    (run / "model.keras").unlink()
    for index in (run / "checkpoints").glob("ckpt-*.index"):
        _garble(index)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(QatpipeError, match=rf"{run / 'checkpoints'}: none of its 2 checkpoint\(s\) can be read "
                                           rf"\(newest: ckpt-2\)\. To start this training over, move or delete"):
        train(spec, run)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_newest_readable_checkpoint_without_training(tmp_path, caplog):
    """The choice itself, on checkpoints of a small tf.train.Checkpoint (no model to train)."""
    import tensorflow as tf

    from qatpipe.training.checkpoints import newest_readable

    folder = tmp_path / "checkpoints"
    assert newest_readable(folder) is None  # nothing to resume: a fresh start
    value = tf.Variable(np.arange(1000, dtype=np.float32))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(v=value), folder, max_to_keep=5)
    for number in (1, 2, 3):
        value.assign_add(tf.ones(1000))
        manager.save(checkpoint_number=number)
    assert newest_readable(folder) == str(folder / "ckpt-3")
    _truncate(next(folder.glob("ckpt-3.data-*")))
    _garble(folder / "ckpt-2.index")
    with caplog.at_level(logging.WARNING):
        assert newest_readable(folder) == str(folder / "ckpt-1")
    assert "'ckpt-3'" in caplog.text and "'ckpt-2'" in caplog.text
    assert tf.train.get_checkpoint_state(str(folder)).model_checkpoint_path.endswith("ckpt-1")
    restored = tf.Variable(np.zeros(1000, np.float32))
    tf.train.Checkpoint(v=restored).restore(newest_readable(folder)).assert_consumed()
    np.testing.assert_array_equal(restored.numpy(), np.arange(1000) + 1)


# ------------------------------------------------------------------ MLflow state after failures


def _mlflow_server(store: Path, port: int) -> subprocess.Popen:
    import urllib.request

    process = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                "--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}",
                                "--default-artifact-root", (store / "artifacts").as_uri(), "--workers", "1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process
        except OSError:
            assert process.poll() is None, "mlflow server exited"
            time.sleep(0.3)
    raise AssertionError("mlflow server did not start in 90 s")


def _kill(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)  # the server and its gunicorn/uvicorn workers, as a crash would
    process.wait()


@pytest.mark.slow
def test_a_run_left_running_by_a_dead_mlflow_is_closed_by_the_next_run_of_its_folder(tmp_path, monkeypatch):
    from conftest import _free_port
    from qatpipe.errors import TrackingError
    from qatpipe.tracking.mlflow_runs import RUN_FOLDER_ENV, MlflowTracker
    from qatpipe_pipelines.local_run import _close_stale_runs

    port, folder = _free_port(), tmp_path / "results"
    uri = f"http://127.0.0.1:{port}"
    server = _mlflow_server(tmp_path, port)
    try:
        tracker = MlflowTracker(uri, attempts=1)
        experiment = tracker.experiment_id("faults")
        monkeypatch.setenv(RUN_FOLDER_ENV, str(folder))
        first = tracker.start_pipeline_run("faults", "results", {}, tags={"qatpipe.kfp_run_id": "run-1"})
        stage = tracker.start_stage_run(first, "train")
        monkeypatch.delenv(RUN_FOLDER_ENV)
        other = tracker.start_pipeline_run("faults", "elsewhere", {})  # another folder's run is not touched

        _kill(server)  # the server dies mid-run: the pipeline's exit handler cannot close its run
        with pytest.raises(TrackingError, match=f"MLflow at {uri}"):
            tracker.finish_pipeline_run("run-1", "FAILED", "FAILED")
        _close_stale_runs(tracker, experiment, folder, "the pipeline failed")  # warns, does not raise

        server = _mlflow_server(tmp_path, port)  # restarted; the folder is run again
        assert tracker.client.get_run(first).info.status == "RUNNING"
        _close_stale_runs(tracker, experiment, folder, "superseded by a re-run of its output folder")
        assert tracker.client.get_run(first).info.status == "FAILED"
        assert tracker.client.get_run(stage).info.status == "FAILED"
        assert tracker.client.get_run(first).data.tags["qatpipe.pipeline_state"] == \
            "superseded by a re-run of its output folder"
        assert tracker.client.get_run(other).info.status == "RUNNING"
    finally:
        _kill(server)


def test_a_torn_stage_log_line_is_skipped_and_named(tmp_path, caplog, monkeypatch):
    from qatpipe_kfp.runtime import STAGE_LOG_ENV, stage
    from qatpipe_pipelines.local_run import _stage_outcomes

    stage_log = tmp_path / "stage_log.jsonl"
    monkeypatch.setenv(STAGE_LOG_ENV, str(stage_log))
    with stage("train"):
        pass
    with pytest.raises(ValueError), stage("export"):
        raise ValueError("bad")
    with stage_log.open("a") as handle:  # a write a full disk cut short
        handle.write('{"stage": "regis')
    logging.getLogger().addHandler(caplog.handler)  # stage() re-configured logging, dropping pytest's handler
    with caplog.at_level(logging.WARNING):
        outcomes = _stage_outcomes(stage_log)
    assert outcomes["train"]["status"] == "done" and outcomes["export"]["status"] == "failed"
    assert "register" not in outcomes
    assert f"'{stage_log}':3: not a whole stage record" in caplog.text


EXECUTOR = """
import sys, types
sys.modules["__main__"].__spec__ = types.SimpleNamespace(name=sys.argv[2])  # as `python -m <name>` sets it
import atexit
atexit.register(lambda: print("teardown ran", flush=True))  # as TensorFlow's and logging's, registered before
from qatpipe_kfp.runtime import stage
with stage("prune"):
    pass
print("after the stage", flush=False)  # KFP's executor writes its outputs here, after the stage
if sys.argv[1] == "raise":
    raise RuntimeError("writing the executor output failed")
"""


@pytest.mark.parametrize("after, main, code", [("ok", "kfp.dsl.executor_main", 0),
                                               ("raise", "kfp.dsl.executor_main", 1),
                                               ("raise", "pytest", 1)])
def test_an_executor_whose_stage_succeeded_skips_the_teardown_but_keeps_a_later_failure(after, main, code):
    """A KFP executor process whose stage succeeded ends without the interpreter's teardown, its output flushed;
    an exception after the stage (KFP failing to write its outputs) still fails the process, and a process that
    is not KFP's executor (a test, the CLI) ends as Python ends it."""
    done = subprocess.run([sys.executable, "-c", EXECUTOR, after, main], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == code, done.stderr
    assert "after the stage" in done.stdout
    assert ("writing the executor output failed" in done.stderr) == (after == "raise")
    assert ("teardown ran" in done.stdout) == (code != 0 or main != "kfp.dsl.executor_main")


# ------------------------------------------------------------------ a full disk


@contextlib.contextmanager
def _full_disk(tmp_path: Path, monkeypatch, size_kb: int = 64):
    """A folder on a small tmpfs (root can mount one here and in CI); where mounting is not allowed, ENOSPC
    injected into os.write. Yields (folder, how)."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(folder)],
                             capture_output=True).returncode == 0
    try:
        if mounted:
            yield folder, "tmpfs"
        else:
            real_write = os.write

            def write(fd, data):
                if os.path.realpath(f"/proc/self/fd/{fd}").startswith(str(folder)) and len(data) > 1024:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_write(fd, data)

            monkeypatch.setattr(os, "write", write)
            yield folder, "injected"
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(folder)], check=True)  # TensorBoard may hold a file open


def test_a_full_disk_names_the_file_and_leaves_no_half_written_file(tmp_path, monkeypatch):
    from qatpipe.fileio import atomic_write_text, write_json

    with _full_disk(tmp_path, monkeypatch) as (folder, how):
        write_json(folder / "summary.json", {"kept": True})
        with pytest.raises(QatpipeError) as info:
            atomic_write_text(folder / "summary.json", "x" * 200_000)
        assert str(info.value) == f"{folder / 'summary.json'}: cannot write: No space left on device (the disk is " \
                                  f"full)", how
        assert json.loads((folder / "summary.json").read_text()) == {"kept": True}  # the old result stands
        assert sorted(p.name for p in folder.iterdir()) == ["summary.json"]  # no .part left behind


@pytest.mark.slow
def test_a_training_run_on_a_full_disk_names_the_path_and_resumes_clean(tiny_spec, tmp_path, monkeypatch, caplog):
    from qatpipe.cli import main

    spec_file = tmp_path / "spec.yaml"
    from qatpipe.spec import spec_to_yaml

    spec_file.write_text(spec_to_yaml(tiny_spec("train.epochs=1", "model.backbone.width=0.0625", *SMALL_IMAGES)))
    with _full_disk(tmp_path, monkeypatch, size_kb=8192) as (folder, how), caplog.at_level(logging.ERROR):
        (folder / "filler").write_bytes(b"\0" * (8192 - 16) * 1024)  # almost full: nothing of the run fits
        assert main(["train", "-e", str(spec_file), "-r", str(folder / "run")]) == 2, how
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].startswith(str(folder / "run")) and "(the disk is full)" in errors[0]
        assert not list((folder / "run").rglob("*.part")) and not (folder / "run" / "model.keras").exists()
        (folder / "filler").unlink()  # space freed: the same command runs through
        assert main(["train", "-e", str(spec_file), "-r", str(folder / "run")]) == 0
        assert (folder / "run" / "model.keras").is_file()


# ------------------------------------------------------------------ data stays inside its folder


def _dataset(root: Path) -> Path:
    write_kitti(root, {"000001": kitti_line("car") + "\n", "000002": kitti_line("pedestrian") + "\n"})
    return root


def test_a_label_linked_out_of_the_data_folder_is_refused_without_reading_it(tmp_path):
    from qatpipe.data.kitti import ClassMap, read_kitti_dataset

    root = _dataset(tmp_path / "data")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    label = root / "labels" / "000002.txt"
    label.unlink()
    label.symlink_to(secret)
    classes = ClassMap.create(["car", "pedestrian", "cyclist"])
    with pytest.raises(DataError) as info:
        read_kitti_dataset(root, classes, key="dataset.train")
    assert str(info.value).startswith(f"{label}: dataset.train: a link leading outside the data set folder")
    assert "root:x" not in str(info.value) and "follow_symlinks" in str(info.value)
    secret.write_text(kitti_line("car") + "\n")  # allowed when the spec says so
    assert len(read_kitti_dataset(root, classes, follow_symlinks=True)) == 2


def test_an_image_linked_to_a_valid_file_elsewhere_is_refused(tmp_path, tiny_spec):
    from qatpipe.data.splits import load_split

    root = _dataset(tmp_path / "data")
    elsewhere = tmp_path / "elsewhere.jpg"
    image = root / "images" / "000001.jpg"
    shutil.move(image, elsewhere)
    image.symlink_to(elsewhere)
    with pytest.raises(DataError, match=f"^{image}: dataset.train: a link leading outside"):
        load_split(tiny_spec(f"dataset.train={root}"), "train")
    assert len(load_split(tiny_spec(f"dataset.train={root}", "dataset.follow_symlinks=true"), "train")) == 2
    image.unlink()
    shutil.move(elsewhere, image)
    inside = root / "images" / "000002.jpg"  # a link that stays inside the folder is fine
    inside.unlink()
    inside.symlink_to(image)
    assert len(load_split(tiny_spec(f"dataset.train={root}"), "train")) == 2


def test_a_file_name_cannot_forge_a_log_line(tmp_path, caplog):
    from qatpipe.cli import main

    root = _dataset(tmp_path / "data" / "train")
    forged = "x\n12:00:00 ERROR qatpipe: forged"
    (root / "images" / f"{forged}.jpg").write_bytes(b"not an image")
    (root / "labels" / f"{forged}.txt").write_text(kitti_line("car") + "\n")
    with caplog.at_level(logging.ERROR):
        assert main(["data", "upload", "--src", str(tmp_path / "data"), "--to", "s3://bucket/x", "-e", "tiny",
                     "--set", f"dataset.train={root}", "--set", f"dataset.val={root}"]) == 2
    message = caplog.records[-1].getMessage()
    assert "\n" not in message and "x\\n12:00:00 ERROR qatpipe: forged.jpg" in message
    assert "corrupt or unreadable image" in message
