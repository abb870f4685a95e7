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
