"""MLflow tracking against a real `mlflow server` on loopback, and against one that is not there."""

from __future__ import annotations

import json
import time
import types

import pytest

from qatpipe.errors import TrackingError
from qatpipe.tracking import mlflow_runs
from qatpipe.tracking.mlflow_runs import INJECTED_RUN_ENV, KFP_RUN_TAG, PARENT_TAG, MlflowTracker, redact_uri
from qatpipe.tracking.records import StageRecord, history_from_csv


def _record(folder):
    (folder / "model.keras").write_bytes(b"weights")
    (folder / "training_log.csv").write_text("epoch,loss,lr\n0,2.0,NA\n1,1.5,NA\n2,1.2,NA\n")
    record = StageRecord(stage="train", params={"train.epochs": 3, "model.backbone.depth": 10},
                         metrics={"params": 12345.0}, history=history_from_csv(folder / "training_log.csv"),
                         artifacts=["model.keras", "training_log.csv"])
    record.write(folder)
    return StageRecord.read(folder)


def test_parent_and_stage_runs(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    tracker = MlflowTracker(mlflow_server)
    tracker.check()
    parent = tracker.start_pipeline_run("test-runs", "pipeline-1", {"train.epochs": 3, "dataset.classes": ["a"]},
                                        tags={KFP_RUN_TAG: "kfp-1"})
    child = tracker.log_stage(parent, _record(tmp_path), tmp_path)

    client = tracker.client
    child_run = client.get_run(child)
    assert child_run.data.tags[PARENT_TAG] == parent
    assert child_run.info.status == "FINISHED"
    assert child_run.data.params["train.epochs"] == "3"
    losses = client.get_metric_history(child, "loss")
    assert [(m.step, m.value) for m in sorted(losses, key=lambda m: m.step)] == [(1, 2.0), (2, 1.5), (3, 1.2)]
    assert "lr" not in child_run.data.metrics  # "NA" values are skipped, not logged as garbage
    assert sorted(a.path for a in client.list_artifacts(child)) == ["model.keras", "training_log.csv"]
    downloaded = client.download_artifacts(child, "model.keras", str(tmp_path / "dl"))
    assert open(downloaded, "rb").read() == b"weights"
    assert client.get_run(parent).data.params["dataset.classes"] == "['a']"

    note = "exact form (no VNNI/AMX) - speeds are not TensorRT's"
    tracker.log_variants(parent, {"fp32": {"engine": "onnxruntime cpu fp32", "map50": 0.9, "map": 0.6,
                                           "latency_ms_p50": None, "cpu_int8": None},
                                  "qat": {"engine": "onnxruntime cpu int8", "map50": 0.9, "cpu_int8": note}})
    # the engine label and the CPU's int8 note as tags (qatpipe.engine.fp32), read back with the figures
    assert tracker.read_variants(parent) == {"fp32": {"engine": "onnxruntime cpu fp32", "map50": 0.9, "map": 0.6},
                                             "qat": {"engine": "onnxruntime cpu int8", "map50": 0.9,
                                                     "cpu_int8": note}}
    assert client.get_run(parent).data.tags["qatpipe.engine.fp32"] == "onnxruntime cpu fp32"
    assert client.get_run(parent).data.tags["qatpipe.cpu_int8.qat"] == note
    compared = tmp_path / "compare"
    StageRecord(stage="compare").write(compared)
    tracker.log_comparison(parent, {"fp32": {"map50": 0.9}}, compared,
                           comparisons={"qat-fp32.map50_diff": -0.01, "qat-fp32.map50_ci95_lo": -0.03})
    assert tracker.read_comparisons(parent) == {"qat-fp32.map50_diff": -0.01, "qat-fp32.map50_ci95_lo": -0.03}
    assert client.get_run(parent).data.metrics["comparison.qat-fp32.map50_diff"] == -0.01
    assert tracker.latest_pipeline_run("test-runs") == parent

    assert tracker.finish_pipeline_run("kfp-1", "FINISHED", "SUCCEEDED") == parent
    assert client.get_run(parent).info.status == "FINISHED"


def test_joins_the_run_the_kfp_backend_injects(mlflow_server, monkeypatch):
    """KFP's MLflow plugin makes a root run per pipeline run and injects each task's nested run (the whole
    hand-off: test_kfp_mlflow_plugin.py)."""
    tracker = MlflowTracker(mlflow_server)
    experiment = tracker.experiment_id("test-injected")
    root = tracker.client.create_run(experiment, run_name="kfp-pipeline-run").info.run_id
    task_run = tracker.client.create_run(experiment, run_name="start-tracking",
                                         tags={PARENT_TAG: root}).info.run_id
    monkeypatch.setenv(INJECTED_RUN_ENV, task_run)
    parent = tracker.start_pipeline_run("ignored", "p", {"a": 1}, tags={KFP_RUN_TAG: "kfp-injected"})
    assert parent == root
    assert tracker.client.get_run(root).data.params == {"a": "1"}
    # the backend owns the run: the exit handler must not close it
    assert tracker.finish_pipeline_run("kfp-injected", "FINISHED", "SUCCEEDED") is None
    assert tracker.client.get_run(root).info.status == "RUNNING"


def test_retried_tasks_do_not_duplicate_runs(mlflow_server, tmp_path, monkeypatch):
    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    tracker = MlflowTracker(mlflow_server)
    first = tracker.start_pipeline_run("test-retries", "p", {"a": 1}, tags={KFP_RUN_TAG: "kfp-retry"})
    assert tracker.start_pipeline_run("test-retries", "p", {"a": 1}, tags={KFP_RUN_TAG: "kfp-retry"}) == first
    record = _record(tmp_path)
    child = tracker.log_stage(first, record, tmp_path)
    assert tracker.log_stage(first, record, tmp_path) == child
    half_logged = tracker.start_stage_run(first, "evaluate")  # a task that died while logging
    redone = tracker.log_stage(first, StageRecord(stage="evaluate", metrics={"map50": 0.5}), tmp_path)
    assert redone != half_logged
    assert tracker.client.get_run(half_logged).info.lifecycle_stage == "deleted"


class _CountingClient:
    """The tracker's MlflowClient, counting the calls made through it: one per attempt of `MlflowTracker.call`."""

    def __init__(self, client):
        self._client, self.calls = client, []

    def __getattr__(self, name):
        method = getattr(self._client, name)

        def counted(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return counted


def _counted(tracker: MlflowTracker, monkeypatch) -> tuple[_CountingClient, list]:
    """Count the tracker's client calls and its backoff sleeps (recorded, not slept)."""
    client = _CountingClient(tracker.client)
    tracker.client = client
    sleeps = []  # the tracker module's own clock only: MLflow's and urllib3's sleeps are theirs
    monkeypatch.setattr(mlflow_runs, "time", types.SimpleNamespace(sleep=sleeps.append, time=time.time))
    return client, sleeps


def test_a_permanent_error_is_not_retried_nor_blamed_on_the_network(mlflow_server, monkeypatch):
    tracker = MlflowTracker(mlflow_server, attempts=3, backoff_s=5.0)
    client, sleeps = _counted(tracker, monkeypatch)
    with pytest.raises(TrackingError) as caught:
        tracker.read_variants("f" * 32)
    assert client.calls == ["get_run"] and sleeps == []  # one attempt, no backoff
    assert "attempt" not in str(caught.value) and "server is up" not in str(caught.value)


def test_unreachable_server_fails_clearly_and_keeps_results(closed_port_uri, tmp_path, monkeypatch):
    record = _record(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    uri = closed_port_uri.replace("http://", "http://alice:s3cret@")
    tracker = MlflowTracker(uri, attempts=2, backoff_s=0.1)
    client, sleeps = _counted(tracker, monkeypatch)
    with pytest.raises(TrackingError) as caught:
        tracker.log_stage("0" * 32, record, tmp_path)
    message = str(caught.value)
    assert "failed after 2 attempt(s)" in message and closed_port_uri.split("//")[1] in message
    assert "s3cret" not in message and "local results are kept" in message
    # exactly `attempts` tries of the first call, one backoff between them, then it gave up
    assert len(client.calls) == 2 and len(set(client.calls)) == 1 and sleeps == [0.1]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing written is lost


def test_a_store_mlflow_cannot_open_is_one_error_naming_it(tmp_path):
    """A plain folder is MLflow's retired file store, which it refuses to open: a TrackingError, not its own."""
    with pytest.raises(TrackingError, match=f"^MLflow at {tmp_path}: cannot open the store: .*file"):
        MlflowTracker(str(tmp_path))


def test_a_stage_opens_the_store_in_the_background_only_with_a_tracking_uri(tmp_path, monkeypatch):
    """runtime.stage opens MLflow's store while the stage works (open_store_early): a thread that opens the
    tracking URI's store (an SQLite file here is made by it), and nothing without a tracking URI."""
    from qatpipe.tracking.stage_logging import open_store_early

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert open_store_early() is None
    store = tmp_path / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    thread = open_store_early()
    thread.join(timeout=120)
    assert not thread.is_alive() and thread.daemon and store.is_file()


def test_redact_uri():
    assert redact_uri("https://user:pw@mlflow.example.com/path") == "https://***@mlflow.example.com/path"
    assert redact_uri("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_stage_record_round_trip_and_bad_file(tmp_path):
    record = StageRecord(stage="evaluate", metrics={"map50": 0.5}, artifacts=["metrics.json"])
    record.write(tmp_path)
    assert StageRecord.read(tmp_path) == record
    (tmp_path / "tracking.json").write_text(json.dumps({"stage": "x", "unknown": 1}))
    with pytest.raises(Exception, match="unreadable tracking record"):
        StageRecord.read(tmp_path)
    with pytest.raises(Exception, match="no tracking record"):
        StageRecord.read(tmp_path / "missing")


def test_a_failed_pipeline_closes_the_live_runs_its_trainings_left(mlflow_server, monkeypatch):
    monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
    tracker = MlflowTracker(mlflow_server)
    parent = tracker.start_pipeline_run("test-live-close", "p", {}, tags={KFP_RUN_TAG: "kfp-live-close"})
    live = tracker.live_stage_run(parent, "retrain_qat")  # the training failed for good: never logged
    assert tracker.finish_pipeline_run("kfp-live-close", "FAILED", "FAILED") == parent
    assert tracker.client.get_run(live).info.status == "FAILED"
    assert tracker.client.get_run(parent).info.status == "FAILED"

