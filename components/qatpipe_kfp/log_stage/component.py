"""log-stage: log one stage's tracking record (its tracking.json) as a nested MLflow run.

Kept apart from the stages so their KFP cache keys hold no per-run id: a cached stage is still logged to
the new run's parent."""

from qatpipe_kfp.settings import component
from kfp.dsl import Artifact, Input


@component
def log_stage(parent_run_id: str, stage_output: Input[Artifact]):
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe.tracking.records import StageRecord
    from qatpipe_kfp.runtime import log, stage

    record = StageRecord.read(stage_output.path)
    with stage(f"log-{record.stage}"):
        tracker = MlflowTracker.from_env()
        if not parent_run_id or tracker is None:
            log.info("tracking is off; %s not logged", record.stage)
            return
        tracker.log_stage(parent_run_id, record, stage_output.path)
