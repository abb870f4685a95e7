"""Stage: the variants as MLflow models, and the QAT one in the model registry (tracking/registry.py).

Every variant (fp32, ptq, ptq-partial, qat) is logged as an MLflow model over the ONNX file its evaluation
scored, with its validated figures; the QAT model also carries what deployment needs (calibration cache, implicit
ONNX, engine metadata, validation report, DeepStream config). The QAT model becomes a new registered version: alias
`tracking.champion_alias` when its validation passed, `rejected` with the gate's reason when it did not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from qatpipe.fileio import read_json
from qatpipe.spec import ExperimentSpec, spec_to_yaml
from qatpipe.stages.compare import variant_row
from qatpipe.stages.validate import DEEPSTREAM_FOLDER, MARKDOWN_FILE, REPORT_FILE as VALIDATION_FILE, gate_message
from qatpipe.tracking.mlflow_runs import KFP_RUN_TAG, KFP_RUN_URL_TAG, MlflowTracker
from qatpipe.tracking.records import RECORD_FILE
from qatpipe.tracking.registry import (MODEL_DIGEST_TAG, REJECTED_ALIAS, file_digest, loading_snippet,
                                      log_variant_model, register_variant, spec_digest)

log = logging.getLogger(__name__)

REGISTERED_VARIANT = "qat"


@dataclass
class VariantFiles:
    onnx: Path  # the model the variant's evaluation scored
    validation: Path  # the validate stage's folder (validation.json, metrics.json, bench.json)
    deployment: list[Path] = field(default_factory=list)  # further files the MLflow model carries


def deployment_files(onnx_dir: Path, engine_dir: Path | None, validation_dir: Path) -> list[Path]:
    """What a deployment job needs beside the ONNX: calibration cache, implicit ONNX and export reports,
    engine.json, the validation report and the DeepStream config."""
    files = [p for p in sorted(onnx_dir.iterdir()) if p.is_file() and p.suffix in (".cache", ".json", ".onnx")
             and p.name not in ("model.onnx", RECORD_FILE)]
    if engine_dir is not None and (engine_dir / "engine.json").is_file():
        files.append(engine_dir / "engine.json")
    files += [validation_dir / name for name in (VALIDATION_FILE, MARKDOWN_FILE, DEEPSTREAM_FOLDER)
              if (validation_dir / name).exists()]
    return files


def register_models(tracker: MlflowTracker, parent_run_id: str, spec: ExperimentSpec,
                    variants: dict[str, VariantFiles], manifest: dict | None = None, kfp_run_id: str = "",
                    kfp_run_url: str = "") -> dict:
    """Log every variant's MLflow model and register the QAT one; returns what was done (also for the UI)."""
    # the gate's verdict first: a missing or broken report stops the stage before anything is logged
    report = (read_json(variants[REGISTERED_VARIANT].validation / VALIDATION_FILE, "validation report")
              if REGISTERED_VARIANT in variants else None)
    digest = spec_digest(spec_to_yaml(spec))
    run_tags = {"qatpipe.spec_digest": digest, **({KFP_RUN_TAG: kfp_run_id} if kfp_run_id else {}),
                **({KFP_RUN_URL_TAG: kfp_run_url} if kfp_run_url else {})}
    logged, figures = {}, {}
    for name, files in variants.items():
        figures[name] = {k: v for k, v in variant_row(files.validation).items() if v is not None}
        logged[name] = log_variant_model(tracker, parent_run_id, name, files.onnx, spec, figures[name], manifest,
                                         files.deployment, tags=run_tags)
    result = {"models": {name: item.model_uri for name, item in logged.items()}, "registered": None}
    if report is None:
        return result
    passed = bool(report["passed"])
    reason = "" if passed else gate_message(report)
    tags = {**run_tags, "qatpipe.engine": str(report.get("engine_label", "")),
            **{f"qatpipe.{key}": f"{value:.6g}" for key, value in figures[REGISTERED_VARIANT].items()
               if isinstance(value, float)},
            "qatpipe.baseline_map50": f"{report['baseline_map50']:.6g}",
            "qatpipe.map50_drop": str(report["map50_drop"]), MODEL_DIGEST_TAG: file_digest(variants[REGISTERED_VARIANT].onnx)}
    alias = spec.tracking.champion_alias
    version = register_variant(tracker, spec.tracking.registered_model, logged[REGISTERED_VARIANT], passed, reason,
                               champion_alias=alias, tags=tags)
    result["registered"] = {"name": spec.tracking.registered_model, "version": str(version.version),
                            "alias": alias if passed else REJECTED_ALIAS, "passed": passed, "reason": reason,
                            "uri": f"models:/{spec.tracking.registered_model}@{alias if passed else REJECTED_ALIAS}"}
    return result


def markdown(result: dict | None) -> str:
    """What `register_models` did, as Markdown (the KFP UI's report); None: no tracking server."""
    if result is None:
        return "No MLflow tracking server: no models were logged or registered.\n"
    lines = ["| variant | MLflow model |", "|---|---|"]
    lines += [f"| {name} | `{uri}` |" for name, uri in result["models"].items()]
    registered = result["registered"]
    if registered:
        verdict = "passed the gate" if registered["passed"] else f"failed the gate: {registered['reason']}"
        lines += ["", f"QAT: version {registered['version']} of `{registered['name']}`, `{registered['uri']}` "
                      f"({verdict})", "", "```python", loading_snippet(registered["uri"]), "```"]
    return "\n".join(lines) + "\n"


__all__ = ["VariantFiles", "deployment_files", "markdown", "register_models"]
