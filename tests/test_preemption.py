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

from conftest import SMALL_IMAGES

TASK = textwrap.dedent("""
    import sys
    from kfp import dsl
    from qatpipe_kfp.train.component import train

    spec_file, dataset, out, checkpoint_uri = sys.argv[1:5]
    train.python_func(train_spec=open(spec_file).read(), dataset=dsl.Dataset(uri=dataset),
                      model=dsl.Model(uri=out + "/model"), metrics=dsl.Metrics(uri=out + "/metrics"),
                      tensorboard=dsl.Artifact(uri=out + "/tensorboard"), checkpoint_uri=checkpoint_uri)
""")


def _task(args: list[str], env: dict, checkpoint_uri: str = "") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TASK, *args, checkpoint_uri], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


EPOCHS = 2  # killed after the first checkpoint, the retry trains the second


def _check_resumed(errors: str, attempt: Path) -> None:
    """The retry's Model artifact: the training continued after the checkpoint, every epoch logged once, the
    model without its resume state, TensorBoard in its own artifact."""
    model = attempt / "model"
    summary = json.loads((model / "train_summary.json").read_text())
    assert 1 <= summary["resumed_from_epoch"] < EPOCHS and summary["epochs"] == EPOCHS
    assert "resuming from" in errors
    with (model / "training_log.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["epoch"]) for row in rows] == list(range(EPOCHS))  # every epoch once: none lost, none twice
    assert all(row["loss"] and row["val_map50"] for row in rows)
    assert (model / "model.keras").is_file() and not (model / "checkpoints").exists()
    assert not (model / "tensorboard").exists()
    assert any((attempt / "tensorboard").rglob("events.out.tfevents.*"))
    assert summary["model"] == str(model / "model.keras")


@pytest.mark.slow
def test_a_killed_training_task_resumes_at_the_next_epoch_when_retried(tiny_spec, tmp_path):
    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.spec import spec_to_yaml

    spec = tiny_spec(f"train.epochs={EPOCHS}", "train.checkpoint_interval=1", "train.validation_interval=1",
                     *SMALL_IMAGES)
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
    assert "resuming in" in errors
    _check_resumed(errors, tmp_path / "attempt-2")
    # the resume state stayed on the volume and is gone now
    assert not any(work.iterdir())


@pytest.fixture
def s3(monkeypatch):
    """moto's S3 server on loopback (no S3 here), with a bucket; the task processes reach it through the
    environment, as a pod reaches MinIO through the credentials Secret."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket="ckpt")
    yield env, client
    server.stop()


def _keys(client) -> list[str]:
    return [obj["Key"] for obj in client.list_objects_v2(Bucket="ckpt").get("Contents", [])]


@pytest.mark.slow
def test_without_the_cache_volume_a_retry_resumes_from_the_s3_checkpoint_uri(tiny_spec, tmp_path, s3):
    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.spec import spec_to_yaml

    s3_env, client = s3
    spec = tiny_spec(f"train.epochs={EPOCHS}", "train.checkpoint_interval=1", "train.validation_interval=1",
                     *SMALL_IMAGES)
    prepare_dataset(spec, tmp_path / "dataset")
    (tmp_path / "spec.yaml").write_text(spec_to_yaml(spec))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **s3_env, "TF_USE_LEGACY_KERAS": "1", "QATPIPE_KFP_RUN_ID": "run-9",
           "PYTHONPATH": f"{root / 'components'}{os.pathsep}{root / 'pipelines'}"}
    for key in ("MLFLOW_TRACKING_URI", "QATPIPE_CACHE_DIR", "S3_ENDPOINT_URL", "AWS_PROFILE"):
        env.pop(key, None)
    args = [str(tmp_path / "spec.yaml"), str(tmp_path / "dataset")]

    first = _task(args + [str(tmp_path / "attempt-1")], env, "s3://ckpt/resume")
    deadline = time.monotonic() + 300
    while not any(key.endswith("/checkpoints/checkpoint") for key in _keys(client)):
        assert first.poll() is None, first.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint mirrored within 5 minutes"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)  # the pod is lost: its local work folder with it
    first.wait()
    mirrored = _keys(client)
    assert all(key.startswith("resume/run-9/qatpipe-train-") for key in mirrored)  # keyed by run and job
    assert not any("/tensorboard/" in key for key in mirrored)

    second = _task(args + [str(tmp_path / "attempt-2")], env, "s3://ckpt/resume")  # the retry: a new pod
    _, errors = second.communicate(timeout=600)
    assert second.returncode == 0, errors[-3000:]
    assert "restored from s3://ckpt/resume/run-9/" in errors
    _check_resumed(errors, tmp_path / "attempt-2")
    assert _keys(client) == []  # the model is kept: the mirror is gone


def test_a_checkpoint_uri_that_is_not_s3_is_refused(monkeypatch):
    from qatpipe.errors import QatpipeError
    from qatpipe_kfp.runtime import training_resume_uri

    monkeypatch.delenv("QATPIPE_CACHE_DIR", raising=False)
    monkeypatch.setenv("QATPIPE_KFP_RUN_ID", "run-1")
    monkeypatch.delenv("QATPIPE_KFP_RUN_ID_V2", raising=False)
    assert training_resume_uri("") is None
    assert training_resume_uri("s3://b/p/") == "s3://b/p/run-1"
    with pytest.raises(QatpipeError, match="checkpoint_uri '/mnt/ckpt': an s3://bucket/prefix is needed"):
        training_resume_uri("/mnt/ckpt")
