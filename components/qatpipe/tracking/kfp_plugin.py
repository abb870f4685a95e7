"""KFP's MLflow plugin (KFP 2.17+, KEP-12862), as qatpipe finds it from inside a task's pod.

Where a KFP API server runs the plugin, it creates the MLflow parent run of each KFP run, and its driver a nested
run per task (run name = the task's name, tag mlflow.parentRunId), before the pod starts, cached tasks included
(closed at once). The pod sees the plugin's settings as JSON in $KFP_MLFLOW_CONFIG (parentRunId, experimentId,
endpoint, ...) and, only under injectUserEnvVars, its task run as $MLFLOW_RUN_ID. qatpipe then nests under that
tree instead of starting its own: start-tracking adopts the parent, each stage logs into its task's run.

Facts from the plugin's code (KFP 2.17), not from a running cluster: where a task's run cannot be found, a stage
falls back to a nested run of its own under the plugin's parent (tracking/stage_logging.py).
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)

CONFIG_ENV = "KFP_MLFLOW_CONFIG"
INJECTED_RUN_ENV = "MLFLOW_RUN_ID"  # the task's own run, under injectUserEnvVars: true
PARENT_TAG = "mlflow.parentRunId"
OWN_RUN_TAG = "qatpipe.kind"  # on the runs qatpipe makes itself (mlflow_runs.KIND_TAG): never a plugin's task run


def config() -> dict:
    """The plugin's settings ($KFP_MLFLOW_CONFIG), {} without the plugin; unreadable JSON is warned about and
    read as no plugin (qatpipe then tracks as it would without it)."""
    text = os.environ.get(CONFIG_ENV, "").strip()
    if not text:
        return {}
    try:
        found = json.loads(text)
    except ValueError as exc:
        log.warning("$%s is not JSON (%s): KFP's MLflow plugin ignored", CONFIG_ENV, exc)
        return {}
    return found if isinstance(found, dict) else {}


def injected_run() -> str:
    """$MLFLOW_RUN_ID: the task's run the plugin made ("" when not injected)."""
    return os.environ.get(INJECTED_RUN_ENV, "").strip()


def present() -> bool:
    return bool(config().get("parentRunId") or injected_run())


def parent_run(client) -> str:
    """The plugin's parent run: $KFP_MLFLOW_CONFIG's parentRunId, else the parent of the injected task run;
    "" without the plugin. `client` is an MlflowClient (read only for the second)."""
    found = str(config().get("parentRunId") or "").strip()
    if found:
        return found
    injected = injected_run()
    if not injected:
        return ""
    return client.get_run(injected).data.tags.get(PARENT_TAG, "")


def task_run(client, parent_run_id: str, task_name: str, experiment_id: str | None = None):
    """The plugin's run of task `task_name` under `parent_run_id`, or None.

    This task's own run is $MLFLOW_RUN_ID when injected (used when its parent is `parent_run_id` and its name is
    `task_name`: log-stages, for instance, also looks up other tasks' runs). Otherwise the child run of the parent
    with that run name: the driver names it after the task (qatpipe's display names are the stage table's names,
    unique in the DAG), never one qatpipe made itself. Several (a retried task): the newest."""
    injected = injected_run()
    if injected:
        run = client.get_run(injected)
        if run.data.tags.get(PARENT_TAG) == parent_run_id and run.info.run_name == task_name:
            return run
    if experiment_id is None:
        experiment_id = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs([experiment_id], f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=1000)
    # compared here, not in the filter: a name may hold a quote
    named = [run for run in runs if run.info.run_name == task_name and OWN_RUN_TAG not in run.data.tags]
    return named[0] if named else None


__all__ = ["CONFIG_ENV", "INJECTED_RUN_ENV", "config", "injected_run", "parent_run", "present", "task_run"]
