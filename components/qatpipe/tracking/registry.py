"""Models in MLflow: each variant (fp32, ptq, ptq-partial, qat) as an MLflow 3 LoggedModel, and the QAT one in the
model registry under an alias.

- `log_variant_model`: a nested run `model-<variant>` whose output is the variant's MLflow model
  (deploy/mlflow_model.py: ONNX flavour + a pyfunc that returns detections), whose inputs are the data set
  (train and val, tracking/lineage.py), and whose figures (mAP, latency, size) are linked to that model and to
  the val set.
- `register_variant`: a new version of the registered model from a logged model. When the validation gate
  passed it takes the alias `tracking.champion_alias` ("champion"), and the version that held it keeps the
  alias "previous-<alias>"; no version is ever deleted. When the gate failed the version is still registered,
  so it can be looked at, under the alias "rejected", with the reason on it; the champion does not move.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qatpipe.fileio import file_sha256
from qatpipe.tracking.lineage import dataset_entities
from qatpipe.tracking.mlflow_runs import MlflowTracker

log = logging.getLogger(__name__)

REJECTED_ALIAS = "rejected"  # not "challenger": MLflow users read that as a candidate still under test
MODEL_STAGE_PREFIX = "model-"
MODEL_ID_TAG = "qatpipe.model_id"
GATE_TAG, GATE_REASON_TAG = "qatpipe.gate", "qatpipe.gate_reason"
MODEL_DIGEST_TAG = "qatpipe.model_digest"  # on a registered version: its ONNX file's SHA-256


@dataclass
class LoggedVariant:
    variant: str
    model_id: str
    model_uri: str  # models:/<model_id>
    run_id: str


def previous_alias(champion_alias: str) -> str:
    return f"previous-{champion_alias}"


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a model file: the same model registered twice is one version."""
    return file_sha256(path)


def spec_digest(spec_text: str) -> str:
    """16 hex digits of SHA-256 of the resolved spec's YAML: which recipe made a version."""
    return hashlib.sha256(spec_text.encode("utf-8")).hexdigest()[:16]


@contextlib.contextmanager
def _fluent_uris(uri: str):
    """mlflow's fluent API pointed at `uri` for the block, then left as it was: its global tracking and registry
    URIs and the environment variables mlflow.set_*_uri write (a caller in this process keeps its own store)."""
    import mlflow
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    names = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    saved = tracking_utils._tracking_uri, registry_utils._registry_uri, {name: os.environ.get(name) for name in names}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved[0])  # None: unset again (it also resets what it derived from the URI)
        mlflow.set_registry_uri(saved[1])
        for name, value in saved[2].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def log_variant_model(tracker: MlflowTracker, parent_run_id: str, variant: str, onnx_path: str | Path, spec,
                      figures: dict[str, Any], manifest: dict | None = None, extra_files=(),
                      tags: dict[str, str] | None = None) -> LoggedVariant:
    """Log one variant's MLflow model in its own nested run (see the module docstring). A retried task finds
    the finished run and its model instead of logging a second one."""
    from mlflow.entities import Metric
    from mlflow.models import Model

    from qatpipe.deploy.mlflow_model import DetectorFlavor

    stage = MODEL_STAGE_PREFIX + variant
    done = tracker.finished_stage_run(parent_run_id, stage)
    if done is not None and done.data.tags.get(MODEL_ID_TAG):
        model_id = done.data.tags[MODEL_ID_TAG]
        log.info("the %s model is already logged (%s, run %s)", variant, model_id, done.info.run_id)
        return LoggedVariant(variant, model_id, f"models:/{model_id}", done.info.run_id)
    run_id = tracker.start_stage_run(parent_run_id, stage, {"qatpipe.variant": variant, **(tags or {})})
    try:
        with _fluent_uris(tracker.tracking_uri):  # Model.log works through the fluent API's client
            info = tracker.call(f"logging the {variant} model", lambda: Model.log(
                artifact_path=None, name=f"qatpipe-{variant}", flavor=DetectorFlavor, flavor_name="onnx",
                run_id=run_id, model_type="object-detector", tags={"qatpipe.variant": variant, **(tags or {})},
                onnx_path=onnx_path, spec=spec, extra_files=list(extra_files)))
        val = dataset_entities(manifest).get("val") if manifest else None
        if manifest:
            tracker.log_datasets([run_id], manifest)
        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, 0, model_id=info.model_id,
                          dataset_name=val.name if val else None, dataset_digest=val.digest if val else None)
                   for key, value in sorted(figures.items())
                   if isinstance(value, (int, float)) and not isinstance(value, bool)]
        tracker.call("logging the model's figures", lambda: tracker.client.log_batch(run_id, metrics=metrics))
        tracker.set_tags(run_id, {MODEL_ID_TAG: info.model_id})
    except Exception:
        tracker.finish(run_id, "FAILED")
        raise
    tracker.finish(run_id, "FINISHED")
    log.info("logged the %s model %s (run %s)", variant, info.model_id, run_id)
    return LoggedVariant(variant, info.model_id, f"models:/{info.model_id}", run_id)


def register_variant(tracker: MlflowTracker, name: str, logged: LoggedVariant, passed: bool, reason: str = "",
                     champion_alias: str = "champion", tags: dict[str, str] | None = None):
    """A new version of `name` from `logged`, aliased as the module docstring says; returns the version."""
    client = tracker.client
    tags = {**(tags or {}), "qatpipe.variant": logged.variant, GATE_TAG: "passed" if passed else "failed"}
    if reason:
        tags[GATE_REASON_TAG] = reason[:5000]

    def create():
        try:
            client.create_registered_model(name, description="qatpipe: INT8 detectors that passed the validation "
                                                             "gate (alias champion) and those that did not")
        except Exception:  # exists already
            pass
        # a retried task (or a retried call whose answer was lost) finds the version it made; a re-run of the
        # pipeline that registers the same model file again finds its version by the file's digest
        made = client.search_model_versions(f"name = '{name}' and run_id = '{logged.run_id}'")
        if not made and tags.get(MODEL_DIGEST_TAG):
            made = client.search_model_versions(f"name = '{name}' and tags.`{MODEL_DIGEST_TAG}` = "
                                                f"'{tags[MODEL_DIGEST_TAG]}'")
        if made:
            log.info("%s version %s is already registered from this model (run %s)", name, made[0].version,
                     made[0].run_id)
            return made[0]
        return client.create_model_version(name, logged.model_uri, run_id=logged.run_id, tags=tags,
                                           description=reason or None, model_id=logged.model_id)

    version = tracker.call(f"registering model {name!r}", create)
    if passed:
        current = _version_with_alias(tracker, name, champion_alias)
        if current == str(version.version):  # a retry after the alias moved: the previous champion stays
            current = None
        elif current is not None:
            tracker.call("keeping the previous champion", lambda: client.set_registered_model_alias(
                name, previous_alias(champion_alias), current))
        tracker.call(f"moving alias {champion_alias!r}", lambda: client.set_registered_model_alias(
            name, champion_alias, version.version))
        log.info("registered %s version %s as @%s%s", name, version.version, champion_alias,
                 f" (version {current} is now @{previous_alias(champion_alias)})" if current else "")
    else:
        tracker.call("aliasing the rejected version", lambda: client.set_registered_model_alias(
            name, REJECTED_ALIAS, version.version))
        log.warning("registered %s version %s as @%s only: %s", name, version.version, REJECTED_ALIAS, reason)
    return version


def pipeline_models(tracker: MlflowTracker, parent_run_id: str) -> tuple[dict[str, str], Any]:
    """({variant: models:/<id>} logged under a pipeline run, the registry version of its QAT model or None)."""
    models, version = {}, None
    for run in tracker.find_runs([tracker.client.get_run(parent_run_id).info.experiment_id],
                                  f"tags.`mlflow.parentRunId` = '{parent_run_id}'"):
        stage, model_id = run.data.tags.get("qatpipe.stage", ""), run.data.tags.get(MODEL_ID_TAG)
        if stage.startswith(MODEL_STAGE_PREFIX) and model_id:
            models[stage[len(MODEL_STAGE_PREFIX):]] = f"models:/{model_id}"
            if stage == MODEL_STAGE_PREFIX + "qat":
                found = tracker.call("reading the registry", lambda: tracker.client.search_model_versions(
                    f"run_id = '{run.info.run_id}'"))
                if found:  # a search leaves the aliases out: read the version itself
                    version = tracker.call("reading the registry", lambda: tracker.client.get_model_version(
                        found[0].name, found[0].version))
    return models, version


def loading_snippet(uri: str) -> str:
    """Five lines that run a registered detector on an image (README, `qatpipe compare`, the KFP UI)."""
    return "\n".join([
        "import mlflow.pyfunc, numpy as np",
        f'model = mlflow.pyfunc.load_model("{uri}")',
        'boxes = model.predict(np.array(["image.jpg"], dtype=object))  # or a uint8 batch (N, H, W, 3)',
        "# a row per box: image, x1, y1, x2, y2 (image pixels), score, class_id, class_name",
        "print(boxes)",
    ])


def _version_with_alias(tracker: MlflowTracker, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return tracker.client.get_model_version_by_alias(name, alias).version
    except MlflowException as exc:
        if exc.get_http_status_code() == 404 or "not found" in str(exc).lower():
            return None
        return tracker.call(f"reading alias {alias!r}",
                             lambda: tracker.client.get_model_version_by_alias(name, alias).version)


__all__ = ["LoggedVariant", "MODEL_DIGEST_TAG", "file_digest", "loading_snippet", "log_variant_model",
           "pipeline_models", "previous_alias", "register_variant", "spec_digest"]
