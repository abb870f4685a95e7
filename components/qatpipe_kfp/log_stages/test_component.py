"""log-stages and the stage's own logging at its end (runtime.stage(record=...)), against a SQLite MLflow store."""

import json
import os

import pytest
from mlflow import MlflowClient

from qatpipe.errors import TrackingError
from qatpipe.tracking.live import PARENT_RUN_ENV
from qatpipe.tracking.mlflow_runs import PARENT_TAG, RECORD_TAG, RUN_FOLDER_ENV, STAGE_TAG, MlflowTracker
from qatpipe.tracking.records import StageRecord
from qatpipe.tracking.stage_logging import FAILURE_TAG, record_digest
from qatpipe_kfp.log_stages.component import log_all, log_stages_component
from qatpipe_kfp.runtime import stage


@pytest.fixture
def local_run(local_mlflow, tmp_path, monkeypatch):
    """A pipeline run as `qatpipe run --local` makes it: the stages find it through the run's output folder."""
    monkeypatch.setenv(RUN_FOLDER_ENV, str(tmp_path / "run"))
    monkeypatch.setenv(PARENT_RUN_ENV, "")  # found afresh; restored after the test
    for name in ("QATPIPE_KFP_RUN_ID", "QATPIPE_KFP_RUN_ID_V2", "KFP_MLFLOW_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    return MlflowTracker(local_mlflow).start_pipeline_run("exp", "p", {})


def _client() -> MlflowClient:
    """The test's store: named, not mlflow's global tracking URI, which an earlier test may have set."""
    return MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def _children(parent: str) -> dict:
    client = _client()
    runs = client.search_runs([client.get_run(parent).info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent}'")
    return {run.data.tags[STAGE_TAG]: run for run in runs}


def _stage_output(folder, stage_name, **record):
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text("{}")
    StageRecord(stage=stage_name, artifacts=["metrics.json"], **record).write(folder)
    return folder


def test_a_stage_logs_its_record_when_it_ends_and_log_stages_only_the_cached_ones(local_run, tmp_path):
    ran = _stage_output(tmp_path / "evaluate", "evaluate_fp32", metrics={"map50": 0.7},
                        history={"loss": [[1, 2.0], [2, 1.0]]})
    with stage("evaluate-fp32", record=ran):  # the record is on disk when the body ends, as a stage writes it
        pass
    (logged,) = _children(local_run).values()
    assert logged.info.status == "FINISHED" and logged.data.metrics["map50"] == 0.7
    assert logged.data.tags[RECORD_TAG] == record_digest(ran)
    # a stage served from the cache did not run: only its record, from an earlier run
    cached = _stage_output(tmp_path / "prune", "prune", metrics={"flops_ratio": 0.5})
    log_all(local_run, {"evaluate-fp32": str(ran), "prune": str(cached)})
    children = _children(local_run)
    assert set(children) == {"evaluate_fp32", "prune"}
    assert children["evaluate_fp32"].info.run_id == logged.info.run_id  # not logged twice
    assert children["prune"].data.metrics["flops_ratio"] == 0.5 and children["prune"].info.status == "FINISHED"
    assert len(_client().get_metric_history(logged.info.run_id, "loss")) == 2


def test_the_prepared_data_set_becomes_dataset_inputs(local_run, tmp_path):
    """prepare-data's record: the train and val splits (dataset.json) are MLflow dataset inputs of the stage run
    and of the pipeline run, with the digests of their files."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    (folder / "dataset.json").write_text(json.dumps({
        "source": "spec", "train": "s3://data/kitti/train", "val": "s3://data/kitti/val", "classes": ["car"],
        "counts": {split: {"images": 3, "objects": {"car": 4}} for split in ("train", "val")},
        "digests": {"train": "aaaaaaaaaaaaaaaa", "val": "bbbbbbbbbbbbbbbb"}}))
    StageRecord(stage="prepare_data", artifacts=["dataset.json"]).write(folder)
    log_stages_component({"prepare-data": "dataset"}).python_func(
        parent_run_id=local_run, prepare_data=type("Folder", (), {"path": str(folder)})())
    child = _children(local_run)["prepare_data"]
    client = _client()
    for run_id in (local_run, child.info.run_id):
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert {(i.dataset.name, i.dataset.digest, i.dataset.source_type, i.tags[0].value) for i in inputs} == {
            ("kitti/train", "aaaaaaaaaaaaaaaa", "s3", "training"), ("kitti/val", "bbbbbbbbbbbbbbbb", "s3", "evaluation")}


def test_a_failed_stage_is_logged_with_its_reason(local_run, tmp_path):
    with pytest.raises(ValueError), stage("ptq", record=tmp_path / "never-written"):
        raise ValueError("calibration set is empty")
    (failed,) = _children(local_run).values()
    assert failed.info.status == "FAILED" and failed.data.tags[STAGE_TAG] == "ptq"
    assert failed.data.tags[FAILURE_TAG] == "ValueError: calibration set is empty"
    # a retry that succeeds replaces it
    done = _stage_output(tmp_path / "ptq", "ptq", metrics={"map50": 0.6})
    with stage("ptq", record=done):
        pass
    (logged,) = _children(local_run).values()
    assert logged.info.status == "FINISHED" and logged.data.metrics["map50"] == 0.6


def _closed_port_uri() -> str:
    import socket

    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_mlflow_trouble_never_fails_a_finished_stage(local_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _closed_port_uri())
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv(PARENT_RUN_ENV, local_run)  # found earlier; the server is gone now
    folder = _stage_output(tmp_path / "prune", "prune")
    with stage("prune", record=folder):  # its logging setup writes to stderr
        pass
    assert "WARNING qatpipe.tracking.stage_logging: MLflow: prune's record not logged now" in capsys.readouterr().err
    # ... where MLflow trouble fails log-stages (KFP retries it) once every record was tried
    with pytest.raises(TrackingError, match="the records of prune could not be logged"):
        log_all(local_run, {"prune": str(folder)})


def test_tracking_off_logs_nothing_and_fails_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    folder = _stage_output(tmp_path / "prune", "prune")
    with stage("prune", record=folder):
        pass
    log_all("", {"prune": str(folder)})


def test_inputs_follow_the_rows():
    made = log_stages_component({"prepare-data": "dataset", "ptq-partial": "onnx_model"})
    assert list(made.component_spec.inputs) == ["parent_run_id", "prepare_data", "ptq_partial"]
    assert "ptq-partial's `onnx_model` output" in made.component_spec.inputs["ptq_partial"].description
    with pytest.raises(ValueError, match="no distinct identifiers"):
        log_stages_component({"a-b": "x", "a_b": "y"})
