"""What every component body does around its stage function: logging, spec loading, failure reports."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

STAGE_LOG_ENV = "QATPIPE_STAGE_LOG"  # set by `qatpipe run --local`: JSON lines of stage outcomes
CACHE_DIR_ENV = "QATPIPE_CACHE_DIR"  # set by the pipeline when a PVC holds the dataset cache
CACHE_PVC_ENV = "QATPIPE_CACHE_PVC"  # ... and that PVC's claim name, which MPIJobs mount as their shared volume
# the credentials Secret's keys (the pipeline's SECRET_KEYS_TO_ENV), forwarded by name to MPIJob processes
CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "MLFLOW_TRACKING_URI",
                   "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                   "MLFLOW_S3_ENDPOINT_URL")

log = logging.getLogger("qatpipe")


def _spec_views():
    """resolve-spec's outputs: the full spec, a view per row of qatpipe.spec.STAGE_SECTIONS, the registry name.
    Its return annotation names this type, so a new view is a new output without an edit there."""
    from typing import NamedTuple

    from qatpipe.spec import STAGE_SECTIONS, spec_output_name

    return NamedTuple("SpecViews", [("spec", str), *((spec_output_name(view), str) for view in STAGE_SECTIONS),
                                    ("registry_name", str)])


SpecViews = _spec_views()


def spec_views_doc() -> str:
    """The Returns section of resolve-spec's docstring (KFP shows it as the outputs' descriptions)."""
    from qatpipe.spec import SETTING_SECTIONS, STAGE_SECTIONS, spec_output_name

    more = {view: "".join(f"; under {setting} also {', '.join(extra)}" for v, extra, setting, _ in SETTING_SECTIONS
                          if v == view) for view in STAGE_SECTIONS}
    lines = ["", "    Returns:", "        spec: The full resolved spec, as YAML."]
    lines += [f"        {spec_output_name(view)}: The {view} view (sections {', '.join(sections)}{more[view]}), "
              "as YAML." for view, sections in STAGE_SECTIONS.items()]
    lines.append("        registry_name: The name of the MLflow registered model (tracking.registered_model).")
    return "\n".join(lines) + "\n"


def setup_logging() -> None:
    from qatpipe.logconfig import configure_logging

    configure_logging(force=True)


@contextlib.contextmanager
def stage(name: str, record=None):
    """Run one stage: log its start and end; on failure say which stage, why, and how to resume.

    record: the output (an artifact, or its folder) that holds the stage's tracking.json, the one the stage
    table's `logs` names: at the end it is logged to this pipeline run's MLflow tree, and a failure is logged
    as a FAILED run with its reason (tracking/stage_logging.py; never failing the stage, and nothing without
    MLFLOW_TRACKING_URI). A stage served from KFP's cache is logged by log-stages instead."""
    setup_logging()
    started = time.perf_counter()
    log.info("stage %s: started", name)
    if record is not None:  # MLflow's import and store set-up overlap the stage's work
        from qatpipe.tracking.stage_logging import open_store_early

        open_store_early()
    try:
        yield
    except Exception as exc:
        from qatpipe.errors import QatpipeError

        from qatpipe.fileio import os_error_line

        reason = str(exc) if isinstance(exc, QatpipeError) else \
            os_error_line(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, (QatpipeError, OSError)):
            log.error("stage %s: unexpected error\n%s", name, traceback.format_exc())
        log.error("stage %s failed: %s. Fix the cause and re-run the pipeline: finished stages are reused "
                  "(KFP caching).", name, reason)
        _record(name, "failed", time.perf_counter() - started, reason)
        if record is not None:
            from qatpipe.tracking.stage_logging import log_failure

            log_failure(name, reason)
        raise
    seconds = time.perf_counter() - started
    if record is not None:
        from qatpipe.tracking.stage_logging import log_at_stage_end

        if log_at_stage_end(name, getattr(record, "path", record)):
            log.info("stage %s: record logged to MLflow in %.1f s", name, time.perf_counter() - started - seconds)
    log.info("stage %s: done in %.1f s", name, seconds)
    _record(name, "done", seconds)
    if _in_kfp_executor():
        atexit.register(_leave_without_teardown)


def _in_kfp_executor() -> bool:
    """Whether this process is KFP's executor running a component (`python -m kfp.dsl.executor_main`, as KFP's
    launcher and kfp.local run it), not a test or the CLI calling a component's function."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "kfp.dsl.executor_main"


def _leave_without_teardown() -> None:
    """At the exit of an executor whose stage succeeded, once KFP has written its outputs: flush the logs and end
    the process, skipping the interpreter's teardown of TensorFlow (about 1 s a task on a 2-core CPU). The first
    handler atexit runs; after an uncaught exception (sys.last_value) it does nothing, so the failure's exit
    code stands."""
    if getattr(sys, "last_value", None) is not None:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(0)


def _record(name: str, status: str, seconds: float, reason: str | None = None) -> None:
    path = os.environ.get(STAGE_LOG_ENV)
    if not path:
        return
    entry = {"stage": name, "status": status, "seconds": round(seconds, 2)}
    if reason:
        entry["reason"] = reason
    # the whole line in one write() to a file opened for appending: concurrent stages' lines never interleave
    # (a full disk may still cut one short: the reader skips it, naming it)
    line = (json.dumps(entry) + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:  # the stage's own outcome stands; only its line in the run's summary is missing
        log.warning("%r: cannot record stage %s as %s: %s", path, name, status, exc.strerror or exc)


def load_stage_spec(text: str):
    """A stage's spec from the YAML the pipeline passes; the dataset cache moves to the PVC when one is mounted."""
    from qatpipe.spec import load_spec_text

    spec = load_spec_text(text, source="pipeline spec")
    cache_dir = os.environ.get(CACHE_DIR_ENV)
    if cache_dir:
        spec.dataset.cache_dir = cache_dir
    return spec


def training_work_root() -> Path | None:
    """Where train / retrain keep their resume state: this KFP run's folder on the cache volume, so a retried
    task (a new pod) finds its checkpoints; None without the volume or the run id (then a temporary one)."""
    from qatpipe.tracking.live import kfp_run_id

    cache_dir, run_id = os.environ.get(CACHE_DIR_ENV), kfp_run_id()
    return Path(cache_dir) / "work" / run_id if cache_dir and run_id else None


def training_resume_uri(checkpoint_uri: str) -> str | None:
    """Where train / retrain mirror their resume state without the cache volume: `checkpoint_uri` (s3://, the
    pipeline parameter) / this KFP run's id, so a retried task finds it; None when not asked for, or when the
    cache volume holds it already."""
    from qatpipe.storage import is_s3_uri
    from qatpipe.errors import QatpipeError
    from qatpipe.tracking.live import kfp_run_id

    if not checkpoint_uri:
        return None
    if not is_s3_uri(checkpoint_uri):
        raise QatpipeError(f"checkpoint_uri {checkpoint_uri!r}: an s3://bucket/prefix is needed")
    if training_work_root() is not None:
        log.info("checkpoint_uri %s not used: the resume state lives on the cache volume", checkpoint_uri)
        return None
    run_id = kfp_run_id()
    if not run_id:
        log.warning("checkpoint_uri %s not used: this pod has no KFP run id to key the resume state by",
                    checkpoint_uri)
        return None
    return f"{checkpoint_uri.rstrip('/')}/{run_id}"


def cluster_settings(training_image: str, credentials_secret: str, node_selector: dict, tolerations: list,
                     mpijob_api_version: str, launcher: str = "mpijob"):
    """Where a train / retrain MPIJob or TrainJob runs: this pod's image, Secret, placement, and its dataset-cache PVC as
    the job's shared volume."""
    from qatpipe.stages.scale_out import ClusterSettings
    from qatpipe_kfp.settings import TRAINING_IMAGE

    return ClusterSettings(
        image=training_image or TRAINING_IMAGE, shared_pvc=os.environ.get(CACHE_PVC_ENV, ""),
        shared_mount=os.environ.get(CACHE_DIR_ENV, ""), api_version=mpijob_api_version,
        secret_env=credentials_secret or None, secret_env_keys=list(CREDENTIAL_KEYS),
        node_selector=dict(node_selector or {}), tolerations=list(tolerations or []), launcher=launcher,
    )


def write_metrics(metrics_artifact, values: dict[str, float]) -> None:
    """KFP Metrics (shown in the run comparison) plus the same figures as a file: local caching needs every
    output artifact to exist on disk."""
    for key, value in values.items():
        if value is not None:
            metrics_artifact.log_metric(key, float(value))
    Path(metrics_artifact.path).parent.mkdir(parents=True, exist_ok=True)
    Path(metrics_artifact.path).write_text(json.dumps(values, indent=2) + "\n")


def write_text(artifact, text: str) -> None:
    Path(artifact.path).parent.mkdir(parents=True, exist_ok=True)
    Path(artifact.path).write_text(text, encoding="utf-8")


def kfp_run_url(kfp_ui_url: str, kfp_run_id: str) -> str:
    """The run's page in the KFP UI ("" when the UI's address is not known: `qatpipe submit` passes it)."""
    return f"{kfp_ui_url.rstrip('/')}/#/runs/details/{kfp_run_id}" if kfp_ui_url and kfp_run_id else ""
