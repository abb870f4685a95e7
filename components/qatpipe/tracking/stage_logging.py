"""A stage's tracking record into this pipeline run's MLflow tree: at the stage's end, in its own process, and
again at the pipeline's end by log-stages for the stages that did not run in this run (served from the cache).

The record's run is tagged with the digest of its tracking.json (RECORD_TAG), so log-stages logs only what is not
there yet. Without KFP's MLflow plugin that run is a nested run of qatpipe's parent run (MlflowTracker.log_stage);
under the plugin it is the plugin's run of the stage's task (tracking/kfp_plugin.py), or, when that cannot be
found, a nested run of qatpipe's own under the plugin's parent.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from qatpipe.tracking.records import RECORD_FILE, StageRecord

log = logging.getLogger(__name__)

FAILURE_TAG = "qatpipe.failure"  # on the run of a stage that failed: the reason


def record_digest(folder: str | Path) -> str:
    """The digest of a stage's tracking.json (16 hex digits): what its run is tagged with."""
    return hashlib.sha256((Path(folder) / RECORD_FILE).read_bytes()).hexdigest()[:16]


def log_record(tracker, parent_run_id: str, task_name: str, folder: str | Path) -> tuple[str, bool]:
    """Log the record in `folder` (of the task `task_name`, a stage table row's name) under the parent run,
    unless its run holds it already; returns (the run's id, whether it was logged now). A prepared data set (a
    folder with dataset.json) also becomes dataset inputs of the parent and the stage run."""
    from qatpipe.data.prepare import MANIFEST, read_manifest
    from qatpipe.tracking import kfp_plugin
    from qatpipe.tracking.mlflow_runs import RECORD_TAG

    record = StageRecord.read(folder)
    digest = record_digest(folder)
    plugin_run = tracker.call(f"finding KFP's MLflow run of {task_name}", lambda: kfp_plugin.task_run(
        tracker.client, parent_run_id, task_name)) if kfp_plugin.present() else None
    if plugin_run is not None:
        if plugin_run.data.tags.get(RECORD_TAG) == digest:
            return plugin_run.info.run_id, False
        run_id = tracker.log_into_run(plugin_run, record, folder, digest)
    else:
        if kfp_plugin.present():
            log.warning("KFP's MLflow plugin has no run named %r under %s: %s logged as a run of its own",
                        task_name, parent_run_id, record.stage)
        finished = tracker.finished_stage_run(parent_run_id, record.stage)
        if finished is not None and finished.data.tags.get(RECORD_TAG) == digest:
            return finished.info.run_id, False
        run_id = tracker.log_stage(parent_run_id, record, folder, digest)
    if (Path(folder) / MANIFEST).is_file():  # the prepared data set: MLflow dataset inputs
        tracker.log_datasets([parent_run_id, run_id], read_manifest(folder))
    return run_id, True


def open_store_early() -> threading.Thread | None:
    """Open this process's MLflow store in a background thread while the stage works, so that logging its record
    at the end does not wait for `import mlflow` and the store's set-up (about 2 s a stage on a 2-core CPU; MLflow
    keeps one store per URI in a process). Nothing without $MLFLOW_TRACKING_URI; a failure here is left to the
    stage's end, which retries and warns."""
    from qatpipe.tracking.mlflow_runs import TRACKING_URI_ENV

    if not os.environ.get(TRACKING_URI_ENV, "").strip():
        return None

    def open_store() -> None:
        try:
            from qatpipe.tracking.mlflow_runs import MlflowTracker

            MlflowTracker.from_env(attempts=1).client.search_experiments(max_results=1)
        except Exception as exc:  # the stage's end opens it again, and says what fails
            log.debug("MLflow: opening the store early failed: %s", exc)

    thread = threading.Thread(target=open_store, name="qatpipe-mlflow-open", daemon=True)
    thread.start()
    return thread


def log_at_stage_end(task_name: str, folder: str | Path) -> str | None:
    """At the end of a stage that ran: its record into this run's MLflow tree (the parent found as training
    finds it, tracking/live.py: no task input, so the stage stays cacheable). Never fails: tracking off, no
    parent run yet (a stage that ends before start-tracking made it) or MLflow trouble leave it to log-stages,
    with a warning for trouble. Returns the run's id, or None."""
    try:
        from qatpipe.tracking.live import parent_run_from_kfp
        from qatpipe.tracking.mlflow_runs import MlflowTracker

        tracker = MlflowTracker.from_env(attempts=2, backoff_s=1.0)
        if tracker is None:
            return None
        parent = parent_run_from_kfp()
        if not parent:
            log.info("MLflow: no pipeline run found for %s yet; log-stages logs its record", task_name)
            return None
        run_id, _ = log_record(tracker, parent, task_name, folder)
        return run_id
    except Exception as exc:  # the stage's results stand; log-stages tries again at the pipeline's end
        log.warning("MLflow: %s's record not logged now (%s); log-stages logs it at the pipeline's end",
                    task_name, exc)
        return None


def log_failure(task_name: str, reason: str) -> None:
    """A stage that failed: its run under this run's parent, FAILED, tagged with the reason (FAILURE_TAG). Under
    KFP's MLflow plugin the task's run is only tagged (the launcher closes it); a training's live run is tagged
    and left to finish-tracking or the retry that resumes it. Best effort, like log_at_stage_end."""
    try:
        from qatpipe.tracking import kfp_plugin
        from qatpipe.tracking.live import parent_run_from_kfp
        from qatpipe.tracking.mlflow_runs import LIVE_TAG, MlflowTracker

        tracker = MlflowTracker.from_env(attempts=1)
        if tracker is None:
            return
        parent = parent_run_from_kfp()
        if not parent:
            return
        stage = task_name.replace("-", "_")
        plugin_run = kfp_plugin.task_run(tracker.client, parent, task_name) if kfp_plugin.present() else None
        live = next((run for run in tracker.stage_runs(parent, stage) if run.info.status == "RUNNING"
                     and run.data.tags.get(LIVE_TAG) == "true"), None)
        if plugin_run is not None or live is not None:
            tracker.set_tags((plugin_run or live).info.run_id, {FAILURE_TAG: reason[:5000]})
            return
        run_id = tracker.start_stage_run(parent, stage, {FAILURE_TAG: reason[:5000]})
        tracker.finish(run_id, "FAILED")
    except Exception as exc:
        log.warning("MLflow: %s's failure not logged (%s)", task_name, exc)


__all__ = ["FAILURE_TAG", "log_at_stage_end", "log_failure", "log_record", "open_store_early", "record_digest"]
