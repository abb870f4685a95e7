"""log-stage: log one stage's tracking record (its tracking.json) as a nested MLflow run.

Kept apart from the stages so their KFP cache keys hold no per-run id: a cached stage is still logged to
the new run's parent."""

from qatpipe_kfp.settings import component
from kfp.dsl import Artifact, Input


@component
def log_stage(parent_run_id: str, stage_output: Input[Artifact]):
    """Log one stage's tracking record (its tracking.json) as a nested MLflow run under the parent run.

    Kept apart from the stages so that their KFP cache keys hold no per-run id: a cached stage is still logged to
    the new run's parent.

    Args:
        parent_run_id: The MLflow parent run id (start-tracking's output). Empty, or no tracking server configured:
            nothing is logged.
        stage_output: A stage's output folder with its tracking.json. For a prepared data set (a folder with
            dataset.json) its train and val splits are also logged as dataset inputs of the parent and nested runs.
    """
    import json
    from pathlib import Path

    from qatpipe.data.prepare import MANIFEST, read_manifest
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe.tracking.records import RECORD_FILE, StageRecord
    from qatpipe_kfp.runtime import log, stage

    try:  # named after the stage it logs (log-train, log-evaluate-fp32), like its task in the KFP UI
        name = "log-" + json.loads((Path(stage_output.path) / RECORD_FILE).read_text())["stage"].replace("_", "-")
    except Exception:  # unreadable: StageRecord.read below reports it inside the stage
        name = "log-stage"
    with stage(name):
        record = StageRecord.read(stage_output.path)
        tracker = MlflowTracker.from_env()
        if not parent_run_id or tracker is None:
            log.info("tracking is off; %s not logged", record.stage)
            return
        run_id = tracker.log_stage(parent_run_id, record, stage_output.path)
        if (Path(stage_output.path) / MANIFEST).is_file():  # the prepared data set: MLflow dataset inputs
            tracker.log_datasets([parent_run_id, run_id], read_manifest(stage_output.path))
