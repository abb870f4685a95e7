"""MLflow runs for a pipeline: one parent run per pipeline run, a nested run per stage (tracking/registry.py
puts the models and the registry on top of these).

Processes and pods find the parent through its run id (a pipeline value). Under KFP's MLflow plugin
(tracking/kfp_plugin.py) the plugin's parent run is joined instead of creating one, and left to KFP to close.
Every call is retried; when the server stays unreachable a TrackingError names the URI (credentials
removed) and what was being logged. Stage results are already on disk by then (tracking/records.py).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from qatpipe.errors import TrackingError
from qatpipe.tracking.lineage import source_tags
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
INJECTED_RUN_ENV = "MLFLOW_RUN_ID"  # the task's run, set by KFP's MLflow plugin (tracking/kfp_plugin.py)
PARENT_TAG = "mlflow.parentRunId"
STAGE_TAG = "qatpipe.stage"
KIND_TAG = "qatpipe.kind"  # "pipeline" on parent runs, "stage" on the nested runs qatpipe makes itself
KFP_RUN_TAG = "qatpipe.kfp_run_id"
KFP_RUN_URL_TAG = "qatpipe.kfp_run_url"  # the run's page in the KFP UI, when known
UI_URL_ENV = "QATPIPE_MLFLOW_UI_URL"  # the MLflow UI as a browser reaches it, when not the tracking URI
JOINED_TAG = "qatpipe.joined"  # the parent run belongs to the KFP backend: it opens and closes it
LIVE_TAG = "qatpipe.live"  # a stage run the training stage opened to log its curves while it trains
RECORD_TAG = "qatpipe.record"  # the digest of the tracking.json a stage run holds (log-stages skips those logged)
VARIANT_PREFIX = "variant."  # parent-run metrics: variant.<name>.<metric>
COMPARISON_PREFIX = "comparison."  # parent-run metrics: comparison.<a-b>.<metric>, differences between variants
TENSORRT_COMPARISON_PREFIX = "comparison_tensorrt."  # the same differences in TensorRT's numbers
ENGINE_TAG_PREFIX = "qatpipe.engine."  # parent-run tags: qatpipe.engine.<name> = "onnxruntime cpu int8"
# parent-run tags: qatpipe.cpu_int8.<name> = "exact form (no VNNI/AMX) - speeds are not TensorRT's"
CPU_INT8_TAG_PREFIX = "qatpipe.cpu_int8."
# the variant rows' words, as tags: row key -> tag prefix
VARIANT_TAGS = {"engine": ENGINE_TAG_PREFIX, "cpu_int8": CPU_INT8_TAG_PREFIX}
# `qatpipe run --local` names its output folder here; the parent run is tagged with it, so a re-run of the
# folder finds an earlier run that was left RUNNING
RUN_FOLDER_ENV = "QATPIPE_RUN_FOLDER"
RUN_FOLDER_TAG = "qatpipe.run_folder"
PIPELINE_STATE_TAG = "qatpipe.pipeline_state"

# MLflow's own HTTP retries default to 7 with exponential backoff (minutes of silence against a dead
# server); ours are few and logged. Users who set these variables keep their values.
_MLFLOW_HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
_PARAMS_PER_CALL = 100  # MLflow's log_batch limits
_METRICS_PER_CALL = 1000
_MAX_PARAM_CHARS = 6000

T = TypeVar("T")


_USERINFO = re.compile(r"//[^/@]*@")  # the `user:password@` of a URI


def redact_uri(uri: str) -> str:
    """Drop `user:password@` from a URI so it can be logged."""
    return _USERINFO.sub("//***@", uri)


class MlflowTracker:
    """Thin, retrying wrapper over `mlflow.MlflowClient` with the pipeline's run layout."""

    def __init__(self, tracking_uri: str, attempts: int = 3, backoff_s: float = 2.0):
        for name, value in _MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        except Exception as exc:  # a URI MLflow cannot open as a store (a plain folder: its retired file store)
            raise TrackingError(f"MLflow at {redact_uri(tracking_uri)}: cannot open the store: "
                                f"{_one_line(exc)}") from None

    @classmethod
    def from_env(cls, **kwargs) -> "MlflowTracker | None":
        """The tracker for $MLFLOW_TRACKING_URI, or None when tracking is not configured."""
        uri = os.environ.get(TRACKING_URI_ENV, "").strip()
        return cls(uri, **kwargs) if uri else None

    # ------------------------------------------------------------------ plumbing

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """fn(), retried while the failure looks transient (connection, 5xx, 429); TrackingError otherwise."""
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except Exception as exc:  # MlflowException, requests' errors, OSError from file stores
                if not _is_transient(exc):
                    raise TrackingError(f"MLflow at {redact_uri(self.tracking_uri)}: {what} failed: "
                                        f"{_one_line(exc)}") from None
                if attempt == self.attempts:
                    raise TrackingError(
                        f"MLflow at {redact_uri(self.tracking_uri)}: {what} failed after {attempt} attempt(s): "
                        f"{_one_line(exc)}. Check MLFLOW_TRACKING_URI and that the server is up; local results "
                        f"are kept."
                    ) from None
                delay = self.backoff_s * 2 ** (attempt - 1)
                log.warning("MLflow %s failed (attempt %d/%d), retrying in %.0f s: %s", what, attempt,
                            self.attempts, delay, _one_line(exc))
                time.sleep(delay)
        raise AssertionError("unreachable")

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI ($QATPIPE_MLFLOW_UI_URL, else the tracking URI; no credentials)."""
        run = self.call(f"reading run {run_id}", lambda: self.client.get_run(run_id))
        base = _USERINFO.sub("//", os.environ.get(UI_URL_ENV, "").strip() or self.tracking_uri).rstrip("/")
        return f"{base}/#/experiments/{run.info.experiment_id}/runs/{run_id}"

    def check(self) -> None:
        """Fail early, and clearly, when the server cannot be reached."""
        self.call("connecting", lambda: self.client.search_experiments(max_results=1))

    def experiment_id(self, name: str, artifact_location: str | None = None) -> str:
        def get_or_create() -> str:
            found = self.client.get_experiment_by_name(name)
            if found is not None:
                return found.experiment_id
            try:
                return self.client.create_experiment(name, artifact_location=artifact_location)
            except Exception:  # another pod created it first
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
                return found.experiment_id

        return self.call(f"opening experiment {name!r}", get_or_create)

    # ------------------------------------------------------------------ runs

    def start_pipeline_run(self, experiment: str, run_name: str, params: dict[str, Any],
                           tags: dict[str, str] | None = None, artifact_location: str | None = None) -> str:
        """The parent run's id.

        - KFP's MLflow plugin present ($KFP_MLFLOW_CONFIG's parentRunId, or $MLFLOW_RUN_ID, this task's run, whose
          parent it is): the plugin's parent run is joined (tagged, given the params); KFP opens and closes it.
        - a run tagged with this KFP run id exists (a retried start-tracking task): that run, not a second one.
        - else a new run in `experiment`.
        """
        tags = {KIND_TAG: "pipeline", **source_tags("qatpipe pipeline"), **(tags or {})}
        if os.environ.get(RUN_FOLDER_ENV):
            tags[RUN_FOLDER_TAG] = os.environ[RUN_FOLDER_ENV]
        from qatpipe.tracking import kfp_plugin

        plugin_parent = self.call("reading KFP's MLflow plugin's run", lambda: kfp_plugin.parent_run(self.client)) \
            if kfp_plugin.present() else ""
        if plugin_parent:
            run_id = plugin_parent
            self.set_tags(run_id, {**tags, JOINED_TAG: "true"})
            log.info("joining the KFP backend's MLflow run %s", run_id)
        else:
            experiment_id = self.experiment_id(experiment, artifact_location)
            kfp_run_id = tags.get(KFP_RUN_TAG)
            existing = self.find_runs([experiment_id], f"tags.`{KFP_RUN_TAG}` = '{kfp_run_id}'") if kfp_run_id \
                else []
            if existing:
                run_id = existing[0].info.run_id
                log.info("MLflow pipeline run %s exists for KFP run %s (a retry): reusing it", run_id, kfp_run_id)
            else:
                run = self.call("creating the pipeline run", lambda: self.client.create_run(
                    experiment_id, run_name=run_name, tags=tags))
                run_id = run.info.run_id
                log.info("MLflow pipeline run %s in experiment %r", run_id, experiment)
        self.log_params(run_id, params)
        return run_id

    def find_runs(self, experiment_ids: list[str], filter_string: str, max_results: int = 100) -> list:
        return self.call("searching runs", lambda: self.client.search_runs(
            experiment_ids, filter_string, max_results=max_results))

    def start_stage_run(self, parent_run_id: str, stage: str, tags: dict[str, str] | None = None) -> str:
        parent = self.call("reading the pipeline run", lambda: self.client.get_run(parent_run_id))
        run = self.call(f"creating the {stage} run", lambda: self.client.create_run(
            parent.info.experiment_id, run_name=stage,
            tags={**source_tags(f"qatpipe {stage}"), PARENT_TAG: parent_run_id, STAGE_TAG: stage, KIND_TAG: "stage",
                  **(tags or {})}))
        return run.info.run_id

    def stage_runs(self, parent_run_id: str, stage: str) -> list:
        """The runs of `stage` under the parent run, whatever their status."""
        parent = self.call("reading the pipeline run", lambda: self.client.get_run(parent_run_id))
        return self.find_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent_run_id}' "
                               f"and tags.`{STAGE_TAG}` = '{stage}'")

    def finished_stage_run(self, parent_run_id: str, stage: str):
        """The FINISHED run of `stage` under the parent, or None."""
        return next((run for run in self.stage_runs(parent_run_id, stage) if run.info.status == "FINISHED"), None)

    def live_stage_run(self, parent_run_id: str, stage: str) -> str:
        """The run a training stage logs its curves to while it trains: the one an earlier attempt of the
        stage left RUNNING (a resumed training continues its steps), else a new one tagged live. log_stage
        later completes and closes it."""
        for run in self.stage_runs(parent_run_id, stage):
            if run.info.status == "RUNNING" and run.data.tags.get(LIVE_TAG) == "true":
                return run.info.run_id
        return self.start_stage_run(parent_run_id, stage, {LIVE_TAG: "true"})

    def log_stage(self, parent_run_id: str, record: StageRecord, folder: str | Path, digest: str = "") -> str:
        """Log a stage's record (params, metrics, history, artifacts under `folder`) as a nested run, tagged with
        the record's `digest` (RECORD_TAG) when given.

        Idempotent per (parent, stage): a retried task finds the finished run of that record and stops, or
        replaces the half-logged one (or a failed attempt's, or another record's). A run the stage opened live
        (live_stage_run) is completed instead: its curves are there already, so only the history's metrics it
        lacks are added."""
        live_run = None
        for earlier in self.stage_runs(parent_run_id, record.stage):
            if earlier.info.status == "FINISHED" and earlier.data.tags.get(RECORD_TAG, digest) == digest:
                log.info("stage %s is already logged (run %s)", record.stage, earlier.info.run_id)
                return earlier.info.run_id
            if earlier.data.tags.get(LIVE_TAG) == "true" and live_run is None:
                live_run = earlier.info.run_id
                continue
            self.call("removing a half-logged run", lambda: self.client.delete_run(earlier.info.run_id))
        digested = {RECORD_TAG: digest} if digest else {}
        run_id = live_run or self.start_stage_run(parent_run_id, record.stage, {**record.tags, **digested})
        try:
            history = record.history
            if live_run:
                self.set_tags(run_id, {**record.tags, **digested})
                history = self._points_not_logged(run_id, history or {})
            self.log_params(run_id, record.params)
            self.log_metrics(run_id, record.metrics, history)
            for relative in record.artifacts:
                self.log_artifact(run_id, Path(folder) / relative)
        except TrackingError:
            self._finish_quietly(run_id, "FAILED")
            raise
        self.finish(run_id, "FINISHED")
        log.info("logged stage %s to MLflow run %s", record.stage, run_id)
        return run_id

    def log_into_run(self, run, record: StageRecord, folder: str | Path, digest: str = "") -> str:
        """Log a stage's record into an existing run (KFP's MLflow plugin's run of the stage's task), whatever
        its status, and leave that to its owner: tags (STAGE_TAG, the digest), params it does not have yet (the
        plugin logs a cached task's input parameters there, and params cannot change), metrics, artifacts."""
        run_id = run.info.run_id
        self.set_tags(run_id, {STAGE_TAG: record.stage, **record.tags})
        self.log_params(run_id, {key: value for key, value in record.params.items() if key not in run.data.params})
        self.log_metrics(run_id, record.metrics, self._points_not_logged(run_id, record.history or {}))
        for relative in record.artifacts:
            self.log_artifact(run_id, Path(folder) / relative)
        if digest:  # last: the run holds the whole record once it carries the digest
            self.set_tags(run_id, {RECORD_TAG: digest})
        log.info("logged stage %s to KFP's MLflow run %s", record.stage, run_id)
        return run_id

    def _points_not_logged(self, run_id: str, history: dict[str, list[list[float]]]) -> dict:
        """The (step, value) points of `history` whose step the run does not have yet, per metric."""
        missing = {}
        for name, points in history.items():
            logged = {m.step for m in self.call("reading a metric's history",
                                                 lambda: self.client.get_metric_history(run_id, _metric_key(name)))}
            missing[name] = [point for point in points if int(point[0]) not in logged]
        return missing

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, _param_value(value)) for key, value in sorted(params.items())]
        for start in range(0, len(items), _PARAMS_PER_CALL):
            chunk = items[start:start + _PARAMS_PER_CALL]
            self.call("logging params", lambda: self.client.log_batch(run_id, params=chunk))

    def log_metrics(self, run_id: str, metrics: dict[str, float],
                    history: dict[str, list[list[float]]] | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(_metric_key(k), float(v), now, 0) for k, v in sorted(metrics.items()) if _finite(v)]
        for name, points in sorted((history or {}).items()):
            items += [Metric(_metric_key(name), float(v), now, int(step)) for step, v in points if _finite(v)]
        for start in range(0, len(items), _METRICS_PER_CALL):
            chunk = items[start:start + _METRICS_PER_CALL]
            self.call("logging metrics", lambda: self.client.log_batch(run_id, metrics=chunk))

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            target = artifact_path or path.name
            self.call(f"uploading {path.name}/", lambda: self.client.log_artifacts(run_id, str(path), target))
        elif path.is_file():
            self.call(f"uploading {path.name}", lambda: self.client.log_artifact(run_id, str(path), artifact_path))
        else:
            log.warning("artifact %s does not exist; not uploaded", path)

    def log_datasets(self, run_ids: list[str], manifest: dict) -> None:
        """A prepared data set's train and val splits (dataset.json) as MLflow dataset inputs of the runs."""
        from qatpipe.tracking.lineage import dataset_inputs

        inputs = dataset_inputs(manifest)
        for run_id in run_ids:
            self.call("logging the data set", lambda: self.client.log_inputs(run_id, datasets=inputs))

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.call(f"setting tag {key}", lambda: self.client.set_tag(run_id, key, value))

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.call(f"closing run {run_id}", lambda: self.client.set_terminated(run_id, status))

    def finish_pipeline_run(self, kfp_run_id: str, status: str, pipeline_state: str) -> str | None:
        """Close the parent run tagged with `kfp_run_id` (unless KFP's MLflow plugin owns it), and the stage runs
        left RUNNING under it (a training that failed for good; under the plugin only qatpipe's own live runs:
        the plugin's launcher closes its task runs); returns the parent's id."""
        runs = self.call("finding the pipeline run", lambda: self.pipeline_runs_tagged(KFP_RUN_TAG, kfp_run_id)) \
            if kfp_run_id else []
        if not runs:
            log.warning("no MLflow run tagged %s=%s; nothing to close", KFP_RUN_TAG, kfp_run_id)
            return None
        closed = None
        for run in runs:  # normally one
            run_id = run.info.run_id
            self.set_tags(run_id, {PIPELINE_STATE_TAG: pipeline_state})
            joined = run.data.tags.get(JOINED_TAG) == "true"
            self._finish_running_children(run, status, only_live=joined)  # a training that never ended
            if joined:
                log.info("KFP's MLflow plugin owns MLflow run %s; leaving it open", run_id)
                continue
            self.finish(run_id, status)
            closed = run_id
        return closed

    def close_running_pipeline_runs(self, experiment_id: str, run_folder: str, status: str,
                                    reason: str) -> list[str]:
        """Close the pipeline runs of `run_folder` still RUNNING, and their stage runs left RUNNING, as `status`;
        returns the closed parents' ids. For `qatpipe run --local`, which holds the folder's lock: any such run
        is one that ended without closing its run (killed, or MLflow was down)."""
        closed = []
        for run in self.running_pipeline_runs_of(run_folder, [experiment_id]):
            if run.data.tags.get(JOINED_TAG) == "true":
                continue
            self.set_tags(run.info.run_id, {PIPELINE_STATE_TAG: reason})
            self._finish_running_children(run, status)
            self.finish(run.info.run_id, status)
            closed.append(run.info.run_id)
        return closed

    def running_pipeline_runs_of(self, run_folder: str, experiment_ids: list[str] | None = None) -> list:
        """The RUNNING pipeline runs tagged with `run_folder` (RUN_FOLDER_TAG), in these experiments or all. The
        folder is compared here, not in the filter: a path may hold a quote, which a filter string cannot."""
        running = self.find_runs(experiment_ids or self._experiment_ids(),
                                 f"tags.`{KIND_TAG}` = 'pipeline' and attributes.status = 'RUNNING'")
        return [run for run in running if run.data.tags.get(RUN_FOLDER_TAG) == run_folder]

    def _finish_running_children(self, run, status: str, only_live: bool = False) -> None:
        for child in self.find_runs([run.info.experiment_id], f"tags.`{PARENT_TAG}` = '{run.info.run_id}' and "
                                    "attributes.status = 'RUNNING'"):
            if not only_live or child.data.tags.get(LIVE_TAG) == "true":
                self.finish(child.info.run_id, status)

    def pipeline_runs_tagged(self, tag: str, value: str) -> list:
        """Pipeline (parent) runs with tag=value in any active experiment (the exit handler does not know the
        experiment). Stage runs may carry the same tag (the model runs carry the KFP run id): never these."""
        experiment_ids = self._experiment_ids()
        runs = []
        for start in range(0, len(experiment_ids), 100):
            runs += self.client.search_runs(experiment_ids[start:start + 100],
                                            f"tags.`{KIND_TAG}` = 'pipeline' and tags.`{tag}` = '{value}'",
                                            max_results=10)
        return runs

    def _experiment_ids(self) -> list[str]:
        """Every active experiment's id."""
        experiment_ids, token = [], None
        while True:
            page = self.client.search_experiments(max_results=1000, page_token=token)
            experiment_ids += [e.experiment_id for e in page]
            token = page.token
            if not token:
                return experiment_ids

    def _finish_quietly(self, run_id: str, status: str) -> None:
        try:
            self.client.set_terminated(run_id, status)
        except Exception:  # already failing; the original error is the one to report
            pass

    # ------------------------------------------------------------------ variants and registry

    def log_variants(self, run_id: str, variants: dict[str, dict[str, Any]]) -> None:
        """FP32/PTQ/QAT figures on the parent run, as `variant.<name>.<metric>`, for side-by-side views; each
        variant's engine and, for an int8 engine on the CPU, what its speed-up means (`cpu_int8`) as tags."""
        flat = {f"{VARIANT_PREFIX}{name}.{key}": value for name, row in variants.items()
                for key, value in row.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}
        self.log_metrics(run_id, flat)
        words = {f"{prefix}{name}": row[key] for name, row in variants.items() for key, prefix in VARIANT_TAGS.items()
                 if row.get(key)}
        self.set_tags(run_id, {"qatpipe.variants": ",".join(variants), **words})

    def log_comparison(self, run_id: str, variants: dict[str, dict[str, Any]], folder: str | Path,
                       pruning: dict[str, Any] | None = None, comparisons: dict[str, float] | None = None,
                       tensorrt_comparisons: dict[str, float] | None = None) -> dict:
        """The compare stage's output on the parent run: variant metrics (and `pruning.*`, the flat
        differences between variants as `comparison.*`, and the same in TensorRT's numbers as
        `comparison_tensorrt.*`) plus its files under comparison/. Returns where it went (summary.json's
        `mlflow` block)."""
        self.log_variants(run_id, variants)
        if pruning:
            self.log_metrics(run_id, {f"pruning.{key}": value for key, value in pruning.items()})
        for prefix, flat in ((COMPARISON_PREFIX, comparisons), (TENSORRT_COMPARISON_PREFIX, tensorrt_comparisons)):
            if flat:
                self.log_metrics(run_id, {f"{prefix}{key}": value for key, value in flat.items()})
        for relative in StageRecord.read(folder).artifacts:
            self.log_artifact(run_id, Path(folder) / relative, "comparison")
        run = self.call(f"reading run {run_id}", lambda: self.client.get_run(run_id))
        experiment = self.call("reading the experiment",
                                lambda: self.client.get_experiment(run.info.experiment_id))
        return {"tracking_uri": redact_uri(self.tracking_uri), "experiment": experiment.name, "run_id": run_id}

    def read_variants(self, run_id: str) -> dict[str, dict[str, float]]:
        run = self.call(f"reading run {run_id}", lambda: self.client.get_run(run_id))
        variants: dict[str, dict[str, float]] = {}
        for name in run.data.tags.get("qatpipe.variants", "").split(","):
            if name:
                variants[name] = {}
        for key, value in run.data.metrics.items():
            if key.startswith(VARIANT_PREFIX):
                name, metric = key[len(VARIANT_PREFIX):].split(".", 1)
                variants.setdefault(name, {})[metric] = value
        for key, value in run.data.tags.items():
            for field, prefix in VARIANT_TAGS.items():
                if key.startswith(prefix):
                    variants.setdefault(key[len(prefix):], {})[field] = value
        return variants

    def read_comparisons(self, run_id: str) -> dict[str, float]:
        """The `comparison.*` metrics log_comparison put on the parent run, without the prefix."""
        run = self.call(f"reading run {run_id}", lambda: self.client.get_run(run_id))
        return {key[len(COMPARISON_PREFIX):]: value for key, value in run.data.metrics.items()
                if key.startswith(COMPARISON_PREFIX)}

    def latest_pipeline_run(self, experiment: str) -> str:
        def find() -> str:
            found = self.client.get_experiment_by_name(experiment)
            if found is None:
                raise TrackingError(f"no MLflow experiment named {experiment!r}")
            runs = self.client.search_runs([found.experiment_id], f"tags.`{KIND_TAG}` = 'pipeline'",
                                           order_by=["attributes.start_time DESC"], max_results=1)
            if not runs:
                raise TrackingError(f"experiment {experiment!r} has no pipeline runs")
            return runs[0].info.run_id

        try:
            return find()
        except TrackingError:
            raise
        except Exception:
            return self.call(f"searching experiment {experiment!r}", find)


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _MAX_PARAM_CHARS else text[:_MAX_PARAM_CHARS - 3] + "..."


def _metric_key(name: str) -> str:
    # MLflow allows alphanumerics, _ - . / and space; per-class names come from user data
    return re.sub(r"[^\w\-./ ]", "_", name)


def _is_transient(exc: Exception) -> bool:
    """Worth a retry: no answer, or a 5xx / 429 answer. A 4xx (no such run, bad value) will not change."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (TypeError, AttributeError, KeyError, ValueError)) and not isinstance(exc, MlflowException):
        return False  # a mistake in the call, not the network
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return status >= 500 or status == 429  # connection failures come wrapped as INTERNAL_ERROR (500)
    return True


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _one_line(exc: BaseException) -> str:
    """The exception as one short line, with any credentials in URLs removed."""
    # a database store's error carries its SQL statement and a link: neither says what went wrong
    text = str(exc).split("[SQL:")[0].split("(Background on this error")[0]
    text = redact_uri(" ".join(text.split())) or type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."
