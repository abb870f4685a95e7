"""`qatpipe run --local`: the whole pipeline on this machine through kfp.local, the README's main job.

Each stage runs in its own Python subprocess (SubprocessRunner, no venv: the current environment has
qatpipe). Outputs land under OUTPUT/kfp; kfp.local's cache (OUTPUT/kfp-cache) makes a re-run into the same
OUTPUT reuse every finished stage. MLflow goes to $MLFLOW_TRACKING_URI, or a SQLite store in OUTPUT. The terminal
shows the tasks and the stages' logs; kfp.local's whole output goes to OUTPUT/run.log (console.py).
runner="docker" runs each stage in its image instead, and MLflow in the MLflow image (container_run.py).
"""

import contextlib
import json
import logging
import os
import re
import shlex
import time
import warnings
from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.fileio import folder_lock, write_json
from qatpipe_pipelines.console import filtered_stdout
from qatpipe_pipelines.run_folder import PIPELINE_ROOT, SUMMARY_FILE, RunFolder

log = logging.getLogger(__name__)

STAGE_LOG_FILE = "stage_log.jsonl"
RUN_LOG_FILE = "run.log"  # everything kfp.local printed, appended run after run (the terminal shows less)
DEFAULT_OUTPUT = Path("results/pipeline")  # `qatpipe run --local`'s and `make main`'s
MLFLOW_STORE = "mlflow.db"  # the SQLite MLflow store in the output folder, unless $MLFLOW_TRACKING_URI names one
RUNNERS = ("subprocess", "docker")
_ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")  # kfp.local colours its task names


class PipelineFailed(QatpipeError):
    """A stage failed: names the stage, the reason, and how to resume."""


def run_local(output_dir: str | Path, spec_uri: str = "default", overrides: list[str] | None = None,
              run_name: str = "", runner: str = "subprocess") -> dict:
    """Run the pipeline locally into `output_dir`; returns (and writes) its summary.json. One run at a time
    per folder: a second one fails at once, naming the folder and the first one's pid. runner: "subprocess"
    (each stage a Python process here) or "docker" (each stage in its image: container_run.py)."""
    if runner not in RUNNERS:
        raise QatpipeError(f"runner {runner!r}: one of {', '.join(RUNNERS)}")
    out = Path(output_dir).resolve()
    with folder_lock(out):
        if runner == "subprocess":
            return _run_locked(out, spec_uri, list(overrides or []), run_name)
        return _run_in_containers(out, spec_uri, list(overrides or []), run_name)


def _run_in_containers(out: Path, spec_uri: str, overrides: list[str], run_name: str) -> dict:
    """Each stage in its image through kfp.local's DockerRunner; MLflow from the MLflow image unless
    $MLFLOW_TRACKING_URI names a server (which the containers, on the host's network, must reach)."""
    from qatpipe.tracking.mlflow_runs import TRACKING_URI_ENV
    from qatpipe_kfp.settings import IMAGES
    from qatpipe_pipelines import container_run

    with contextlib.ExitStack() as stack:
        stack.enter_context(container_run.engine_socket())
        client = container_run.docker_client()
        container_run.check_images(client, IMAGES)
        tracking_uri = os.environ.get(TRACKING_URI_ENV)
        if not tracking_uri:
            tracking_uri = stack.enter_context(container_run.mlflow_server(client, IMAGES["mlflow"], out))
        stack.enter_context(_environment({TRACKING_URI_ENV: tracking_uri}))
        logs = stack.enter_context(container_run.container_logs(out))
        stack.enter_context(container_run.exit_status_kept())
        try:
            home = container_run.home_env(out)
            return _run_locked(out, spec_uri, overrides, run_name, images=IMAGES,
                               runner=lambda env: container_run.docker_runner(out, {**env, **home}))
        except PipelineFailed as exc:
            raise PipelineFailed(f"{exc} Every container's output: {logs}") from None


def _run_locked(out: Path, spec_uri: str, overrides: list[str], run_name: str, runner=None,
                images: dict[str, str] | None = None) -> dict:
    """runner: None (each stage a subprocess here) or a function of the stages' environment that makes the
    kfp.local runner to use instead (container_run.docker_runner's)."""
    import kfp.local

    from qatpipe.spec_sources import load_spec_uri
    from qatpipe.tracking.mlflow_runs import RUN_FOLDER_ENV, TRACKING_URI_ENV, MlflowTracker
    from qatpipe_kfp.runtime import STAGE_LOG_ENV
    from qatpipe_pipelines.qat_pipeline import build_pipeline

    spec_uri = _absolute_if_local(spec_uri)
    spec = load_spec_uri(spec_uri, overrides)  # a bad spec fails here, before any subprocess starts

    local_store = f"sqlite:///{out / MLFLOW_STORE}"
    tracking_uri = os.environ.get(TRACKING_URI_ENV) or local_store
    tracker = MlflowTracker(tracking_uri)
    tracker.check()
    # its artifacts go beside a local store, not into the current directory
    experiment = tracker.experiment_id(spec.tracking.experiment, artifact_location=(out / "mlartifacts").as_uri()
                                       if tracking_uri == local_store else None)
    # an earlier run of this folder that could not close its MLflow run (killed, or MLflow was down then)
    _close_stale_runs(tracker, experiment, out, "superseded by a re-run of its output folder")

    stage_log = out / STAGE_LOG_FILE
    stage_log.unlink(missing_ok=True)
    # the stages' environment: inherited by subprocesses, given to containers by their runner (kfp.local keys
    # its cache on the tasks' own variables: the MLflow server's port, new each run, must not be one of them)
    stage_env = {TRACKING_URI_ENV: tracking_uri, STAGE_LOG_ENV: str(stage_log), RUN_FOLDER_ENV: str(out)}
    kfp.local.init(runner=runner(stage_env) if runner else kfp.local.SubprocessRunner(use_venv=False),
                   pipeline_root=str(out / PIPELINE_ROOT), enable_caching=True, cache_root=str(out / "kfp-cache"),
                   raise_on_error=True)
    qat_pipeline = build_pipeline(network_retries=0, placement=False, code_version=code_version(),
                                  local_images=images)
    started = time.time()
    log.info("running the pipeline locally into %s (spec %s; kfp.local's whole output in %s)", out, spec_uri,
             RUN_LOG_FILE)
    # the stage subprocesses inherit these
    with _environment(stage_env), filtered_stdout(out / RUN_LOG_FILE), \
            warnings.catch_warnings():
        # kfp.local warns, per task, that the image parameter is not a Python image: locally it runs no image
        warnings.filterwarnings("ignore", message="You may be attemping to run a task that uses custom",
                                category=RuntimeWarning)
        # ... and that display names (log-stages, evaluate-fp32) are a KFP UI matter
        warnings.filterwarnings("ignore", message=r".*settings \['display_name'\] have no effect",
                                category=UserWarning)
        try:
            qat_pipeline(spec_uri=spec_uri, spec_overrides=overrides, run_name=run_name or out.name)
        except BaseException as exc:
            # the exit handler closes the run as FAILED; where it could not (MLflow down, interrupted), do it here
            _close_stale_runs(tracker, experiment, out, "the pipeline failed")
            if isinstance(exc, RuntimeError):
                raise PipelineFailed(_failure_message(stage_log, exc, out, spec_uri, overrides,
                                                     containers=runner is not None,
                                                     stages=_display_names(qat_pipeline))) from None
            raise

    summary = _collect_summary(out, started)
    summary["stages"] = _stage_outcomes(stage_log)
    summary["wall_seconds"] = round(time.time() - started, 1)
    write_json(out / SUMMARY_FILE, summary)
    return summary


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _absolute_if_local(spec_uri: str) -> str:
    """Stages run in other processes: a relative spec path must not depend on their working directory."""
    if "://" in spec_uri:
        return spec_uri
    path = Path(spec_uri)
    return str(path.resolve()) if path.exists() else spec_uri


def _collect_summary(out: Path, started: float) -> dict:
    """The compare stage's summary.json from this run: its newest compare output, written since `started`."""
    from qatpipe.stages.compare import SUMMARY_FILE as COMPARE_SUMMARY

    compare = RunFolder(out).find("compare")
    path = compare / COMPARE_SUMMARY if compare else None
    if path is None or not path.is_file() or path.stat().st_mtime < started - 1:
        raise QatpipeError(f"{out / PIPELINE_ROOT}: the pipeline finished but wrote no compare/summary.json")
    return json.loads(path.read_text())


def code_version() -> str:
    """A hash of the installed qatpipe sources, bundled specs and packaged starts' cards (each holds its file's
    SHA-256). kfp.local keys its cache on a component's wrapper, arguments and environment, not on the library
    it calls; with this in every task's environment, editing the library makes a re-run execute the stages
    again instead of serving stale results."""
    import hashlib

    import qatpipe
    import qatpipe_kfp

    digest = hashlib.sha256()
    for package in (qatpipe, qatpipe_kfp):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".yaml", ".json") and "test" not in path.name:
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _close_stale_runs(tracker, experiment: str, out: Path, reason: str) -> None:
    """Close this folder's MLflow pipeline runs still marked RUNNING as FAILED; best effort when MLflow is down
    (the next run of the folder closes them)."""
    try:
        closed = tracker.close_running_pipeline_runs(experiment, str(out), "FAILED", reason)
    except QatpipeError as exc:
        log.warning("MLflow: could not close this folder's earlier runs (%s); the next run of %r closes them",
                    exc, str(out))
        return
    for run_id in closed:
        log.info("MLflow run %s of %r was left RUNNING: closed as FAILED (%s)", run_id, str(out), reason)


def _stage_outcomes(stage_log: Path) -> dict:
    """stage -> {"status": done|failed, "seconds"} for the stages this run executed; a stage that kfp.local
    served from its cache does not appear. A line a full disk or a kill cut short is skipped, and named."""
    outcomes: dict[str, dict] = {}
    if stage_log.is_file():
        for number, line in enumerate(stage_log.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            try:
                entry = json.loads(line)
                stage = entry.pop("stage")
            except (ValueError, KeyError, AttributeError):
                log.warning("%r:%d: not a whole stage record (a write cut short?), skipped: %r", str(stage_log),
                            number, line[:200])
                continue
            outcomes[stage] = entry
    return outcomes


def _display_names(pipeline) -> dict[str, str]:
    """kfp.local's task names (retrain-2) -> the stages' names (finetune-fp32), from the compiled DAGs."""
    return {key: task.task_info.name for component in pipeline.pipeline_spec.components.values()
            if component.HasField("dag") for key, task in component.dag.tasks.items()}


def _failure_message(stage_log: Path, exc: Exception, out: Path, spec_uri: str, overrides: list[str],
                     containers: bool = False, stages: dict[str, str] | None = None) -> str:
    failed = [(name, o) for name, o in _stage_outcomes(stage_log).items() if o["status"] == "failed"]
    runner = ["--runner docker"] if containers else []
    command = " ".join(["qatpipe run --local", *runner, "--spec", shlex.quote(spec_uri), "--output",
                        shlex.quote(str(out)), *(f"--set {shlex.quote(item)}" for item in overrides)])
    resume = f"Fix it and re-run `{command}`: finished stages are reused from {out / 'kfp-cache'}."
    if failed:  # the first to fail is the cause; the exit handler may fail after it (MLflow down)
        (name, outcome), later = failed[0], [other for other, _ in failed[1:]]
        also = f" (then also: {', '.join(later)})" if later else ""
        return f"pipeline stage {name} failed: {outcome.get('reason', 'see the log above')}{also}. {resume}"
    # no stage recorded a failure: its process (or container) was killed, or died before it could say why
    reason = _ANSI_CODE.sub("", str(exc))
    task = re.search(r"(?:Task|Inner task failed:) '([^']+)'", reason)
    if task:
        name = (stages or {}).get(task.group(1), task.group(1))
        return (f"pipeline stage {name} ended without a result (killed, out of memory, or its process died "
                f"before it could say why). {resume}")
    return f"pipeline failed: {reason}. {resume}"
