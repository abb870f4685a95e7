"""finish-tracking: the exit handler closes the MLflow parent run as FINISHED or FAILED.

An exit task may not depend on other tasks, so it finds the parent run by the KFP run id tag."""

from kfp import dsl

from qatpipe_kfp.settings import component


@component
def finish_tracking(kfp_run_id: str, status: dsl.PipelineTaskFinalStatus):
    """Close the MLflow parent run of this pipeline run with the pipeline's final state (the exit handler).

    An exit task may not depend on other tasks, so the parent run is found by its KFP run id tag. Without a
    tracking server it does nothing.

    Args:
        kfp_run_id: The KFP run id the parent run is tagged with (the pipeline passes its job id placeholder).
        status: The pipeline's final status, filled in by KFP: SUCCEEDED closes the run as FINISHED, CANCELED as
            KILLED, any other state as FAILED.
    """
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe_kfp.runtime import log, stage

    with stage("finish-tracking"):
        tracker = MlflowTracker.from_env()
        if tracker is None:
            return
        outcome = {"SUCCEEDED": "FINISHED", "CANCELED": "KILLED", "CANCELLED": "KILLED"}.get(status.state, "FAILED")
        closed = tracker.finish_pipeline_run(kfp_run_id, outcome, status.state)
        if closed:
            log.info("MLflow run %s closed as %s (pipeline %s)", closed, outcome, status.state)
