from kfp import dsl
from mlflow import MlflowClient

from qatpipe.tracking.mlflow_runs import MlflowTracker
from qatpipe.tracking.records import StageRecord
from qatpipe_kfp.log_stage.component import log_stage


def test_logs_the_record_as_a_nested_run(local_mlflow, tmp_path):
    parent = MlflowTracker(local_mlflow).start_pipeline_run("exp", "p", {})
    (tmp_path / "metrics.json").write_text("{}")
    StageRecord(stage="evaluate_fp32", metrics={"map50": 0.7}, history={"loss": [[1, 2.0], [2, 1.0]]},
                artifacts=["metrics.json"]).write(tmp_path)
    log_stage.python_func(parent_run_id=parent, stage_output=dsl.Artifact(uri=str(tmp_path)))
    client = MlflowClient(local_mlflow)
    (child,) = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent}'")
    assert child.info.run_name == "evaluate_fp32" and child.data.metrics["map50"] == 0.7
    assert len(client.get_metric_history(child.info.run_id, "loss")) == 2


def test_the_prepared_data_set_becomes_dataset_inputs(local_mlflow, tmp_path):
    """log-prepare-data: the train and val splits (dataset.json) are MLflow dataset inputs of the stage run and
    of the pipeline run, with the digests of their files."""
    import json

    parent = MlflowTracker(local_mlflow).start_pipeline_run("exp", "p", {})
    (tmp_path / "dataset.json").write_text(json.dumps({
        "source": "spec", "train": "s3://data/kitti/train", "val": "s3://data/kitti/val", "classes": ["car"],
        "counts": {split: {"images": 3, "objects": {"car": 4}} for split in ("train", "val")},
        "digests": {"train": "aaaaaaaaaaaaaaaa", "val": "bbbbbbbbbbbbbbbb"}}))
    StageRecord(stage="prepare_data", artifacts=["dataset.json"]).write(tmp_path)
    log_stage.python_func(parent_run_id=parent, stage_output=dsl.Artifact(uri=str(tmp_path)))
    client = MlflowClient(local_mlflow)
    (child,) = client.search_runs([client.get_run(parent).info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent}'")
    for run_id in (parent, child.info.run_id):
        inputs = client.get_run(run_id).inputs.dataset_inputs
        assert {(i.dataset.name, i.dataset.digest, i.dataset.source_type, i.tags[0].value) for i in inputs} == {
            ("kitti/train", "aaaaaaaaaaaaaaaa", "s3", "training"), ("kitti/val", "bbbbbbbbbbbbbbbb", "s3", "evaluation")}
