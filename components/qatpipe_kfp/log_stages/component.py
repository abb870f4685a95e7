"""log-stages: at the pipeline's end, the tracking records of the stages this run did not log at their end
(served from KFP's cache, or MLflow was down then) into this run's MLflow tree.

A stage that runs logs its own record when it ends (runtime.stage, tracking/stage_logging.py); a cached stage
does not run, yet belongs in the new run. Its inputs are the stage table's logged outputs, so the component is
made when the pipeline is built (`log_stages_component`): KFP reads a lightweight component's inputs from its
function's literal signature and ships that function's source, so the source is generated from the rows."""

from __future__ import annotations

import hashlib
import linecache

from kfp.dsl import Artifact, Input

from qatpipe_kfp.settings import component

COMPONENT_NAME = "log-stages"
_DESCRIPTION = ("Log the tracking records of the stages this run did not log at their end (served from KFP's "
                "cache) into this pipeline run's MLflow tree.")


def log_stages_component(logged: dict[str, str]):
    """The log-stages component for `logged`: task name -> the output that holds its tracking.json (the stage
    table's rows with `logs`); its input per task is that name as an identifier (prepare-data -> prepare_data)."""
    inputs = {name: name.replace("-", "_") for name in logged}
    if len(set(inputs.values())) != len(inputs) or not all(arg.isidentifier() for arg in inputs.values()):
        raise ValueError(f"log-stages: stage names that are no distinct identifiers: {sorted(logged)}")
    source = "\n".join([
        "def log_stages(parent_run_id: str, " + ", ".join(f"{arg}: Input[Artifact]" for arg in inputs.values())
        + "):",
        f'    """{_DESCRIPTION}',
        "",
        "    Args:",
        "        parent_run_id: The MLflow parent run id (start-tracking's output). Empty, or no tracking server "
        "configured: nothing is logged.",
        *(f"        {arg}: {name}'s `{logged[name]}` output, with its tracking.json." for name, arg in inputs.items()),
        '    """',
        "    from qatpipe_kfp.log_stages.component import log_all",
        "",
        "    log_all(parent_run_id, {" + ", ".join(f"{name!r}: {arg}.path" for name, arg in inputs.items()) + "})",
        "",
    ])
    # KFP ships the function's source, read back through inspect.getsource: linecache holds the generated text
    filename = f"<qatpipe log-stages {hashlib.sha256(source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    # dont_inherit: not this module's `from __future__ import annotations` (KFP reads the annotations as types)
    exec(compile(source, filename, "exec", dont_inherit=True), {"Artifact": Artifact, "Input": Input}, namespace)
    return component(namespace["log_stages"])


def log_all(parent_run_id: str, folders: dict[str, str]) -> None:
    """log-stages' body: each task's record (`folders`: task name -> its output folder) unless this run holds it;
    every record is tried, then the task fails (and KFP retries it) when any could not be logged."""
    from qatpipe.errors import TrackingError
    from qatpipe.tracking.mlflow_runs import MlflowTracker
    from qatpipe.tracking.stage_logging import log_record
    from qatpipe_kfp.runtime import log, stage

    with stage("log-stages"):
        tracker = MlflowTracker.from_env()
        if not parent_run_id or tracker is None:
            log.info("tracking is off; no stage records logged")
            return
        logged_now, failed = [], []
        for name, folder in folders.items():
            try:
                _, now = log_record(tracker, parent_run_id, name, folder)
            except TrackingError as exc:
                log.error("MLflow: %s's record not logged: %s", name, exc)
                failed.append(name)
                continue
            if now:
                logged_now.append(name)
        log.info("stage records logged now: %s; %d were logged at their stage's end",
                 ", ".join(logged_now) or "none", len(folders) - len(logged_now) - len(failed))
        if failed:
            raise TrackingError(f"MLflow: the records of {', '.join(failed)} could not be logged")
