"""Training curves in MLflow while a training stage runs: loss (each head's too), learning rate, throughput and
val mAP per epoch, as stepped metrics (step = epochs done, as training_log.csv's history is logged), from rank 0.

The training process finds the pipeline's MLflow run through $QATPIPE_MLFLOW_PARENT_RUN, which the KFP
task sets (`parent_run_from_kfp`) from KFP's MLflow plugin ($KFP_MLFLOW_CONFIG), the KFP run id in its pod's
labels, or in the local run from its output folder: none becomes a task input, so stages stay cacheable (every
stage finds it so to log its record at its end, tracking/stage_logging.py). The stage run is opened live
(MlflowTracker.live_stage_run; under the plugin its injected task run, $MLFLOW_RUN_ID); the stage's end adds the
model's record and closes it. A resumed
training continues the same run and steps. Tracking trouble never stops training: after one failed call the
curves stop, with a warning, and the stage's record brings the whole history from training_log.csv at the end.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "QATPIPE_MLFLOW_PARENT_RUN"
# Where KFP puts the run id on a task's pod (the pipeline sets these from the pod's labels): Argo-based
# backends label pods pipeline/runid, newer ones pipelines.kubeflow.org/run_id.
KFP_RUN_ID_ENVS = ("QATPIPE_KFP_RUN_ID", "QATPIPE_KFP_RUN_ID_V2")


def kfp_run_id() -> str:
    """This task's KFP run id, from its pod's labels ("" outside a KFP pod)."""
    return next((os.environ[name].strip() for name in KFP_RUN_ID_ENVS if os.environ.get(name, "").strip()), "")


def parent_run_from_kfp() -> str:
    """Set $QATPIPE_MLFLOW_PARENT_RUN for this process and its children from KFP's MLflow plugin's parent run,
    the pod's KFP run id, or under `qatpipe run --local` from its output folder (the one pipeline run of that
    folder still RUNNING: the run holds the folder's lock), when tracking is on; returns it ("" when there is
    none)."""
    from qatpipe.tracking import kfp_plugin
    from qatpipe.tracking.mlflow_runs import KFP_RUN_TAG, RUN_FOLDER_ENV, MlflowTracker

    if os.environ.get(PARENT_RUN_ENV):
        return os.environ[PARENT_RUN_ENV]
    run_id, folder = kfp_run_id(), os.environ.get(RUN_FOLDER_ENV, "").strip()
    tracker = MlflowTracker.from_env(attempts=1)
    if not (run_id or folder or kfp_plugin.present()) or tracker is None:
        return ""
    try:
        plugin_parent = kfp_plugin.parent_run(tracker.client) if kfp_plugin.present() else ""
        if plugin_parent:
            os.environ[PARENT_RUN_ENV] = plugin_parent
            return plugin_parent
        runs = tracker.pipeline_runs_tagged(KFP_RUN_TAG, run_id) if run_id else \
            tracker.running_pipeline_runs_of(folder)
    except Exception as exc:  # live curves are a convenience: log-stages still logs the record
        log.warning("MLflow: finding the pipeline run failed (%s): no live curves, the record is logged by "
                    "log-stages", exc)
        return ""
    if not runs:
        return ""
    os.environ[PARENT_RUN_ENV] = runs[0].info.run_id
    return runs[0].info.run_id


def live_curves(stage: str, steps_per_epoch: int, images_per_step: int):
    """The Keras callback that logs `stage`'s curves to MLflow, or None when there is no parent run."""
    import tf_keras as keras

    from qatpipe.tracking.mlflow_runs import MlflowTracker

    parent = os.environ.get(PARENT_RUN_ENV, "").strip()
    tracker = MlflowTracker.from_env(attempts=2, backoff_s=1.0) if parent else None
    if tracker is None:
        return None

    class LiveCurves(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.run_id, self.failed, self.logged_steps = None, False, set()

        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if self.failed:
                return
            seconds = time.perf_counter() - self.started
            lr = self.model.optimizer.learning_rate
            values = {**{key: float(value) for key, value in (logs or {}).items()},
                      "lr": float(lr(self.model.optimizer.iterations)) if callable(lr) else float(lr),
                      "images_per_second": steps_per_epoch * images_per_step / max(seconds, 1e-9)}
            try:
                if self.run_id is None:
                    self.run_id = _plugin_task_run(tracker, parent) or tracker.live_stage_run(parent, stage)
                    # a resumed training may redo an epoch an earlier attempt logged before it was stopped:
                    # one point per step, the first
                    self.logged_steps = {m.step for m in tracker.client.get_metric_history(self.run_id, "loss")}
                    log.info("MLflow: live curves of %s in run %s", stage, self.run_id)
                if epoch + 1 in self.logged_steps:
                    return
                tracker.log_metrics(self.run_id, {}, {key: [[epoch + 1, value]] for key, value in values.items()})
            except Exception as exc:
                self.failed = True
                log.warning("MLflow: live curves of %s stop (%s); the whole history is logged when the stage "
                            "ends", stage, exc)

    return LiveCurves()


def _plugin_task_run(tracker, parent: str) -> str:
    """This task's run made by KFP's MLflow plugin ($MLFLOW_RUN_ID under the parent), "" without one (an MPIJob's
    processes do not get it: they log to a live run of their own)."""
    from qatpipe.tracking import kfp_plugin

    injected = kfp_plugin.injected_run()
    if injected and tracker.client.get_run(injected).data.tags.get("mlflow.parentRunId") == parent:
        return injected
    return ""


__all__ = ["KFP_RUN_ID_ENVS", "PARENT_RUN_ENV", "kfp_run_id", "live_curves", "parent_run_from_kfp"]
