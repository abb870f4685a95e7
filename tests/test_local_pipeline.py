"""The whole pipeline through kfp.local (each stage a subprocess), tracked in a real MLflow server."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from qatpipe.cli import main
from qatpipe.errors import TrackingError
from qatpipe.tracking.mlflow_runs import PARENT_TAG, STAGE_TAG
from qatpipe_pipelines.local_run import PipelineFailed, run_local

HEAVY_STAGES = {"prepare-data", "train", "evaluate-unpruned", "prune", "retrain-fp32", "retrain-qat", "export-fp32",
                "export-qat", "ptq", "evaluate-fp32", "evaluate-ptq", "evaluate-qat"}
# nested MLflow runs: one per stage record
STAGE_RUNS = {"prepare_data", "train", "evaluate_unpruned", "prune", "retrain_fp32", "retrain_qat", "export_fp32",
              "export_qat", "ptq", "evaluate_fp32", "evaluate_ptq", "evaluate_qat"}


def _pipeline_runs(client: MlflowClient, experiment: str):
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], "tags.`qatpipe.kind` = 'pipeline'",
                              order_by=["attributes.start_time ASC"])


def _children(client: MlflowClient, parent) -> dict:
    runs = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.info.run_id}'")
    return {run.data.tags[STAGE_TAG]: run for run in runs}


@pytest.mark.slow
def test_local_pipeline_tiny_spec_then_rerun_reuses_stages(tmp_path, mlflow_server, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out = tmp_path / "run"
    summary = run_local(out, "tiny", ["tracking.experiment=pipeline-test"])

    assert json.loads((out / "summary.json").read_text()) == summary
    assert list(summary["variants"]) == ["fp32", "ptq", "qat"]  # all three scored in ONNX Runtime
    fp32 = summary["variants"]["fp32"]
    assert set(fp32) == {"map50", "map", "latency_ms_p50", "throughput", "size_mb", "params", "gflops"}
    assert fp32["map50"] > 0.3 and 0 < fp32["map"] < fp32["map50"]
    for variant in ("ptq", "qat"):  # INT8 models that still detect; the accuracy comparison is bench/'s job
        row = summary["variants"][variant]
        assert row["map50"] > 0.5 * fp32["map50"] and row["size_mb"] < 0.5 * fp32["size_mb"], variant
    pruning = summary["pruning"]
    assert pruning["flops_after"] < pruning["flops_before"] and pruning["params_after"] == fp32["params"]
    assert pruning["unpruned_map50"] > 0.3
    assert pruning["fp32_map50_change"] == pytest.approx(fp32["map50"] - pruning["unpruned_map50"], abs=1e-4)
    assert summary["gate_passed"] is None  # no validation gate before the deployment stages land
    assert summary["mlflow"]["experiment"] == "pipeline-test"
    assert summary["mlflow"]["tracking_uri"] == mlflow_server
    assert {name for name, o in summary["stages"].items() if o["status"] == "done"} >= HEAVY_STAGES | {"compare"}

    client = MlflowClient(mlflow_server)
    (parent,) = _pipeline_runs(client, "pipeline-test")
    assert parent.info.run_id == summary["mlflow"]["run_id"]
    assert parent.info.status == "FINISHED"  # closed by the exit handler
    assert parent.data.params["train.epochs"] == "20"
    assert parent.data.metrics["variant.fp32.map50"] == pytest.approx(fp32["map50"])
    assert parent.data.metrics["variant.qat.map50"] == pytest.approx(summary["variants"]["qat"]["map50"])
    assert parent.data.metrics["pruning.flops_ratio"] == pytest.approx(pruning["flops_ratio"])
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")} >= {
        "comparison/summary.json", "comparison/comparison.png"}
    children = _children(client, parent)
    assert set(children) == STAGE_RUNS
    losses = client.get_metric_history(children["train"].info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, 21))  # per-epoch loss, epochs 1..20
    assert losses[-1].value < losses[0].value
    assert children["evaluate_fp32"].data.metrics["map50"] == pytest.approx(fp32["map50"])
    assert "model.keras" in {a.path for a in client.list_artifacts(children["train"].info.run_id)}
    assert children["retrain_qat"].data.params["qat.enabled"] == "True"
    assert len(client.get_metric_history(children["retrain_qat"].info.run_id, "loss")) == 3  # retrain.epochs
    qat_files = {a.path for a in client.list_artifacts(children["export_qat"].info.run_id)}
    assert {"model.onnx", "model.cache", "model_implicit.onnx", "model_scales.json"} <= qat_files

    # `qatpipe compare` reads the same table back from MLflow
    assert main(["compare", "--tracking-uri", mlflow_server, "--experiment", "pipeline-test",
                 "-o", str(tmp_path / "chart.png")]) == 0
    assert f"{fp32['map50']:.4f}" in capsys.readouterr().out
    assert (tmp_path / "chart.png").stat().st_size > 1000

    # a re-run into the same folder reuses every finished stage, and is tracked as a new pipeline run
    again = run_local(out, "tiny", ["tracking.experiment=pipeline-test"])
    assert again["variants"] == summary["variants"]
    assert not HEAVY_STAGES & set(again["stages"])  # served from kfp.local's cache, not executed
    assert again["mlflow"]["run_id"] != summary["mlflow"]["run_id"]
    second = _pipeline_runs(client, "pipeline-test")[-1]
    assert set(_children(client, second)) == STAGE_RUNS


def test_failed_stage_names_itself_and_how_to_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the local SQLite store
    out = tmp_path / "run"
    missing = tmp_path / "no-such-data"
    with pytest.raises(PipelineFailed) as caught:
        run_local(out, "tiny", [f"dataset.train={missing}/train", f"dataset.val={missing}/val"])
    message = str(caught.value)
    assert message.startswith("pipeline stage prepare-data failed: ")
    assert f"{missing}/train: dataset.train: dataset folder not found" in message
    assert f"re-run `qatpipe run --local --spec tiny --output {out}" in message
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (parent,) = _pipeline_runs(client, "qatpipe")
    assert parent.info.status == "FAILED"


def test_unreachable_tracking_server_stops_before_any_stage(tmp_path, monkeypatch, closed_port_uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", closed_port_uri)
    with pytest.raises(TrackingError, match=f"MLflow at {closed_port_uri}: connecting failed after 3 attempt"):
        run_local(tmp_path / "run", "tiny")
    assert not (tmp_path / "run" / "kfp").exists()


def test_bad_spec_fails_before_the_pipeline_starts(tmp_path):
    from qatpipe.errors import SpecError

    with pytest.raises(SpecError, match="train.epochz"):
        run_local(tmp_path / "run", "tiny", ["train.epochz=3"])
