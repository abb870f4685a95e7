from kfp import dsl
from mlflow import MlflowClient

from qatpipe.tracking.mlflow_runs import KFP_RUN_TAG, MlflowTracker
from qatpipe_kfp.finish_tracking.component import finish_tracking


def _status(state):
    return dsl.PipelineTaskFinalStatus(state=state, pipeline_job_resource_name="job", pipeline_task_name="exit",
                                       error_code=None, error_message=None)


def test_closes_the_tagged_parent_run_with_the_pipeline_outcome(local_mlflow):
    tracker = MlflowTracker(local_mlflow)
    ok = tracker.start_pipeline_run("exp", "ok", {}, tags={KFP_RUN_TAG: "run-ok"})
    bad = tracker.start_pipeline_run("exp", "bad", {}, tags={KFP_RUN_TAG: "run-bad"})
    finish_tracking.python_func(kfp_run_id="run-ok", status=_status("SUCCEEDED"))
    finish_tracking.python_func(kfp_run_id="run-bad", status=_status("FAILED"))
    client = MlflowClient(local_mlflow)
    assert client.get_run(ok).info.status == "FINISHED"
    assert client.get_run(bad).info.status == "FAILED"
    assert client.get_run(bad).data.tags["qatpipe.pipeline_state"] == "FAILED"
