"""qatpipe under KFP's MLflow plugin (KFP 2.17+, KEP-12862), against a real `mlflow server` on loopback.

No KFP backend runs here, so this test plays the plugin's part as its code does it (not checked on a cluster):
the API server's parent run of the KFP run (tags kfp.*), the driver's run per task (run name = the task's name,
tag mlflow.parentRunId; a cached task's closed at once, FINISHED, with its input parameters), $KFP_MLFLOW_CONFIG
in every pod and, under injectUserEnvVars, $MLFLOW_RUN_ID = the task's run; the launcher closing a task's run
when its command exits. qatpipe's own code runs as it does in the pods: start-tracking, a stage's end, log-stages,
finish-tracking.
"""

from __future__ import annotations

import json
import uuid

import pytest
from kfp import dsl
from mlflow import MlflowClient

from qatpipe.spec import bundled_spec_path
from qatpipe.tracking.kfp_plugin import CONFIG_ENV, INJECTED_RUN_ENV
from qatpipe.tracking.live import PARENT_RUN_ENV
from qatpipe.tracking.mlflow_runs import (JOINED_TAG, KFP_RUN_TAG, KIND_TAG, PARENT_TAG, RECORD_TAG, STAGE_TAG,
                                          MlflowTracker)
from qatpipe.tracking.records import StageRecord
from qatpipe.tracking.stage_logging import record_digest
from qatpipe_kfp.finish_tracking.component import finish_tracking
from qatpipe_kfp.log_stages.component import log_all
from qatpipe_kfp.runtime import stage
from qatpipe_kfp.start_tracking.component import start_tracking

KFP_RUN = "1f2e3d4c-kfp-run"


class _Plugin:
    """What KFP's API server, driver and launcher do in MLflow for one KFP run."""

    def __init__(self, client: MlflowClient, uri: str, monkeypatch):
        self.client, self.uri, self.monkeypatch = client, uri, monkeypatch
        self.experiment = client.create_experiment(f"kfp-plugin-{uuid.uuid4().hex[:8]}")  # one server per session
        self.parent = client.create_run(self.experiment, run_name="qatpipe-run", tags={
            "kfp.pipeline_run_id": KFP_RUN, "kfp.pipeline_run_url": f"https://kfp.example.com/#/runs/{KFP_RUN}"
        }).info.run_id

    def task_run(self, name: str, cached_inputs: dict | None = None) -> str:
        """The driver's run of task `name`; a cached task's is closed at once with its input parameters."""
        run_id = self.client.create_run(self.experiment, run_name=name, tags={PARENT_TAG: self.parent}).info.run_id
        if cached_inputs is not None:
            for key, value in cached_inputs.items():
                self.client.log_param(run_id, key, value)
            self.client.set_terminated(run_id, "FINISHED")
        return run_id

    def in_pod(self, task_run: str | None) -> None:
        """A task's pod: the plugin's config, and its run when injectUserEnvVars injects it."""
        self.monkeypatch.setenv(CONFIG_ENV, json.dumps({
            "endpoint": self.uri, "workspace": "", "parentRunId": self.parent, "experimentId": self.experiment,
            "authType": "none", "timeout": "30s", "injectUserEnvVars": task_run is not None}))
        self.monkeypatch.setenv("MLFLOW_TRACKING_URI", self.uri)
        self.monkeypatch.setenv(PARENT_RUN_ENV, "")  # a fresh process
        if task_run is None:
            self.monkeypatch.delenv(INJECTED_RUN_ENV, raising=False)
        else:
            self.monkeypatch.setenv(INJECTED_RUN_ENV, task_run)
            self.monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", self.experiment)

    def launcher_closes(self, run_id: str) -> None:
        self.client.set_terminated(run_id, "FINISHED")


def _output(folder, stage_name, **record):
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text("{}")
    StageRecord(stage=stage_name, artifacts=["metrics.json"], **record).write(folder)
    return folder


@pytest.mark.parametrize("injected", [True, False], ids=["injectUserEnvVars", "config-only"])
def test_qatpipe_nests_under_the_plugins_runs(mlflow_server, tmp_path, monkeypatch, injected):
    client = MlflowClient(mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "")  # the plugin's experiment is in its config
    plugin = _Plugin(client, mlflow_server, monkeypatch)
    for name in ("QATPIPE_KFP_RUN_ID", "QATPIPE_KFP_RUN_ID_V2", "QATPIPE_RUN_FOLDER"):
        monkeypatch.delenv(name, raising=False)

    # start-tracking adopts the plugin's parent run: qatpipe's tags and the spec's params, no second tree
    start_run = plugin.task_run("start-tracking")
    plugin.in_pod(start_run if injected else None)
    link = dsl.Markdown(uri=str(tmp_path / "link"))
    parent = start_tracking.python_func(spec=bundled_spec_path("tiny").read_text(), run_name="ignored",
                                        kfp_run_id=KFP_RUN, link=link)
    plugin.launcher_closes(start_run)
    assert parent == plugin.parent
    adopted = client.get_run(parent)
    assert adopted.data.tags[KIND_TAG] == "pipeline" and adopted.data.tags[JOINED_TAG] == "true"
    assert adopted.data.tags[KFP_RUN_TAG] == KFP_RUN and adopted.data.params["train.batch_size"] == "8"
    assert adopted.data.tags["kfp.pipeline_run_id"] == KFP_RUN  # the plugin's own tags stay

    # a stage that runs logs its record into its task's run, which the launcher closes after it
    prune_run = plugin.task_run("prune")
    plugin.in_pod(prune_run if injected else None)
    pruned = _output(tmp_path / "pruned", "prune", metrics={"flops_ratio": 0.5}, params={"prune.threshold": 0.1})
    with stage("prune", record=pruned):
        pass
    logged = client.get_run(prune_run)
    assert logged.info.status == "RUNNING"  # the launcher's to close
    assert logged.data.metrics["flops_ratio"] == 0.5 and logged.data.tags[STAGE_TAG] == "prune"
    assert logged.data.tags[RECORD_TAG] == record_digest(pruned)
    assert [a.path for a in client.list_artifacts(prune_run)] == ["metrics.json"]
    plugin.launcher_closes(prune_run)

    # a cached stage: the driver made its run, closed, with the task's input parameters; no pod ran
    data_run = plugin.task_run("prepare-data", cached_inputs={"data_fingerprint": "abc"})
    dataset = _output(tmp_path / "dataset", "prepare_data", params={"source": "spec"}, metrics={"train.images": 6})
    (dataset / "dataset.json").write_text(json.dumps({
        "source": "spec", "train": "s3://data/kitti/train", "val": "s3://data/kitti/val", "classes": ["car"],
        "counts": {split: {"images": 3, "objects": {"car": 4}} for split in ("train", "val")},
        "digests": {"train": "aaaaaaaaaaaaaaaa", "val": "bbbbbbbbbbbbbbbb"}}))
    # log-stages adds qatpipe's record to the cached task's run, and leaves the one logged at its end
    log_run = plugin.task_run("log-stages")
    plugin.in_pod(log_run if injected else None)
    log_all(parent, {"prepare-data": str(dataset), "prune": str(pruned)})
    plugin.launcher_closes(log_run)
    cached = client.get_run(data_run)
    assert cached.info.status == "FINISHED" and cached.data.metrics["train.images"] == 6
    assert cached.data.params == {"data_fingerprint": "abc", "source": "spec"}
    assert cached.data.tags[RECORD_TAG] == record_digest(dataset) and cached.data.tags[STAGE_TAG] == "prepare_data"
    assert {i.dataset.name for i in client.get_run(data_run).inputs.dataset_inputs} == {"kitti/train", "kitti/val"}
    assert len(client.get_metric_history(prune_run, "flops_ratio")) == 1  # not logged twice
    children = client.search_runs([plugin.experiment], f"tags.`{PARENT_TAG}` = '{parent}'")
    # the plugin's task runs only: qatpipe made no run of its own
    assert sorted(run.info.run_name for run in children) == ["log-stages", "prepare-data", "prune", "start-tracking"]

    # finish-tracking (the exit handler) leaves the plugin's parent to KFP, and its own task run to the launcher
    finish_run = plugin.task_run("finish-tracking")
    plugin.in_pod(finish_run if injected else None)
    finish_tracking.python_func(kfp_run_id=KFP_RUN, status=dsl.PipelineTaskFinalStatus(
        state="SUCCEEDED", pipeline_job_resource_name="", pipeline_task_name="", error_code=None,
        error_message=None))
    assert client.get_run(parent).info.status == "RUNNING"
    assert client.get_run(finish_run).info.status == "RUNNING"
    assert client.get_run(parent).data.tags["qatpipe.pipeline_state"] == "SUCCEEDED"


def test_a_task_run_the_plugin_did_not_make_falls_back_to_a_run_of_qatpipes_own(mlflow_server, tmp_path,
                                                                                   monkeypatch):
    """The driver names a task's run after the task; should that name not be found (a KFP that names it
    otherwise), the record still lands in the plugin's tree, as a nested run of its own."""
    client = MlflowClient(mlflow_server)
    plugin = _Plugin(client, mlflow_server, monkeypatch)
    plugin.in_pod(None)
    monkeypatch.delenv("QATPIPE_RUN_FOLDER", raising=False)
    folder = _output(tmp_path / "ptq", "ptq", metrics={"map50": 0.6})
    with stage("ptq", record=folder):
        pass
    (child,) = client.search_runs([plugin.experiment], f"tags.`{PARENT_TAG}` = '{plugin.parent}'")
    assert child.info.run_name == "ptq" and child.data.tags[KIND_TAG] == "stage"
    assert child.info.status == "FINISHED" and child.data.metrics["map50"] == 0.6
    tracker = MlflowTracker(mlflow_server)
    assert tracker.finished_stage_run(plugin.parent, "ptq").info.run_id == child.info.run_id
