"""Pre-emption: the train component killed after a checkpoint (SIGKILL, as a node loss leaves it), then retried
as KFP retries a task (a new pod, fresh output folders, the same cache volume and KFP run): the training
continues at the next epoch with an intact log, and the Model artifact holds the model, not the checkpoints."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TASK = textwrap.dedent("""
    import sys
    from kfp import dsl
    from qatpipe_kfp.train.component import train

    spec_file, dataset, out = sys.argv[1:4]
    train.python_func(train_spec=open(spec_file).read(), dataset=dsl.Dataset(uri=dataset),
                      model=dsl.Model(uri=out + "/model"), metrics=dsl.Metrics(uri=out + "/metrics"),
                      tensorboard=dsl.Artifact(uri=out + "/tensorboard"))
""")


def _task(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TASK, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_killed_training_task_resumes_at_the_next_epoch_when_retried(tiny_spec, tmp_path):
    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.spec import spec_to_yaml

    spec = tiny_spec("train.epochs=3", "train.checkpoint_interval=1", "train.validation_interval=1")
    prepare_dataset(spec, tmp_path / "dataset")
    (tmp_path / "spec.yaml").write_text(spec_to_yaml(spec))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "QATPIPE_CACHE_DIR": str(tmp_path / "cache"),
           "QATPIPE_KFP_RUN_ID": "run-7", "PYTHONPATH": f"{root / 'components'}{os.pathsep}{root / 'pipelines'}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [str(tmp_path / "spec.yaml"), str(tmp_path / "dataset")]

    first = _task(args + [str(tmp_path / "attempt-1")], env)
    work = tmp_path / "cache" / "work" / "run-7"
    deadline = time.monotonic() + 300
    while not any("ckpt-1" in state.read_text() for state in work.glob("*/checkpoints/checkpoint")):
        # the state file names a checkpoint once it is whole: what a resume reads
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 5 minutes"
        time.sleep(0.05)
    assert first.poll() is None, "the training ended before it could be killed"
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert not (tmp_path / "attempt-1" / "model" / "model.keras").exists()  # the task died unfinished

    second = _task(args + [str(tmp_path / "attempt-2")], env)  # the retry: a new pod, the same volume
    _, errors = second.communicate(timeout=600)
    assert second.returncode == 0, errors[-3000:]
    model = tmp_path / "attempt-2" / "model"
    summary = json.loads((model / "train_summary.json").read_text())
    assert 1 <= summary["resumed_from_epoch"] < 3 and summary["epochs"] == 3
    assert "resuming in" in errors and "resuming from" in errors
    with (model / "training_log.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["epoch"]) for row in rows] == [0, 1, 2]  # every epoch once: none lost, none twice
    assert all(row["loss"] and row["val_map50"] for row in rows)
    # the Model artifact: the model and its records; the resume state stayed on the volume and is gone now
    assert (model / "model.keras").is_file() and not (model / "checkpoints").exists()
    # TensorBoard's event files in their own artifact, not in the Model every later stage downloads
    assert not (model / "tensorboard").exists()
    assert any((tmp_path / "attempt-2" / "tensorboard").rglob("events.out.tfevents.*"))
    assert summary["model"] == str(model / "model.keras")
    assert not any(work.iterdir())
