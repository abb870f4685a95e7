"""Stage: evaluate a detector on the spec's val set (TAO `evaluate`): mAP, per class, PR curves."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from qatpipe.data.splits import load_split
from qatpipe.errors import DataError, QatpipeError
from qatpipe.fileio import atomic_write_text, file_sha256, json_sha256, write_json
from qatpipe.inference import engine_forward, onnx_forward, predict
from qatpipe.metrics.coco import DetectionMetrics, GroundTruth, evaluate_detections, plot_pr_curves, write_coco_files
from qatpipe.metrics.diagnostics import diagnostics_metrics, findings_tags, learning_check, log_findings
from qatpipe.metrics.report import evaluation_markdown
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import REPORT_MARKDOWN, StageRecord

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
PR_CURVE_FILE = "pr_curves.png"
# the evaluation in COCO files (ids as in metrics.json's evaluation): re-scorable, and the compare stage's input
DETECTIONS_FILE = "detections.json"
GROUND_TRUTH_FILE = "ground_truth.json"


def evaluate(spec: ExperimentSpec, model_path: str | Path, output_dir: str | Path | None = None,
             stage_name: str = "evaluate", variant: str | None = None, same_as: str | Path | None = None) -> dict:
    """Score `model_path` on dataset.val; writes metrics.json, pr_curves.png (titled with `variant` and what
    scored it, scored_by), detections.json, ground_truth.json, report.md (headed `variant`, default the model's
    file name) and tracking.json to `output_dir`. `same_as`: another evaluation's folder whose scores this one
    takes, without running the model, when its scoring key (scoring_key: the same model bytes, val images and
    decoding) is this one's; else the model runs as without it."""
    from qatpipe.engines.base import EngineMetadata
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model

    model_path = Path(model_path)
    is_engine = model_path.is_dir()
    output_dir = Path(output_dir) if output_dir else (model_path if is_engine else model_path.parent) / "evaluate"
    try:  # before the slow part, so a bad output path fails at once
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QatpipeError(f"{output_dir}: cannot create the output directory: {exc}") from None
    arch = get_architecture(spec)
    samples = load_split(spec, "val")
    if not any(len(s.classes) for s in samples):
        raise DataError(spec.dataset.val, "dataset.val: no labelled objects, so mAP is undefined")
    model_file = model_path / EngineMetadata.read(model_path).engine_file if is_engine else model_path
    key = scoring_key(spec, model_file, samples)
    result = _scores_of(Path(same_as), key, output_dir) if same_as else None
    if result is None:
        if is_engine:  # a folder from `qatpipe build-engine`: run it on the backend that built it
            forward, _ = engine_forward(model_path, arch)
        elif model_path.suffix.lower() == ".onnx":
            forward = onnx_forward(model_path, arch)
        else:
            import qatpipe.quantization.layers  # noqa: F401  (registers the QAT layers: a QAT model loads)

            model = load_keras_model(model_path, arch)
            forward = lambda batch: dict(zip(arch.output_names,  # noqa: E731
                                             (o.numpy() for o in model(batch, training=False))))
        result = _score(spec, forward, samples, arch, output_dir)
    result.update(model=str(model_path), scoring_key=key, model_size_mb=round(model_file.stat().st_size / 2**20, 3))
    write_json(output_dir / METRICS_FILE, result)
    metrics = DetectionMetrics.from_dict(result)
    plot_pr_curves(metrics, output_dir / PR_CURVE_FILE,
                   title=f"{variant or model_path.name} on {scored_by(model_path)}: PR @ IoU 0.5")
    atomic_write_text(output_dir / REPORT_MARKDOWN, evaluation_markdown(variant or model_path.name, result))
    findings = result["diagnostics"]["findings"]
    StageRecord(
        stage=stage_name, params={"model": model_path.name, "val_images": len(samples),
                                  **({"scores_from": result["scores_from"]} if "scores_from" in result else {})},
        metrics=tracked_metrics(result),
        artifacts=[METRICS_FILE, PR_CURVE_FILE, DETECTIONS_FILE, GROUND_TRUTH_FILE, REPORT_MARKDOWN],
        tags=findings_tags(findings),
    ).write(output_dir)
    log.info("mAP@0.5 %.4f  mAP@[.5:.95] %.4f  (%d images, %d detections)", metrics.map50, metrics.map,
             metrics.num_images, metrics.num_detections)
    for name, values in metrics.per_class.items():
        ap50, ap = values["ap50"], values["ap"]
        log.info("  %-12s AP50 %s  AP %s  (%d objects)", name, "n/a" if ap50 is None else f"{ap50:.4f}",
                 "n/a" if ap is None else f"{ap:.4f}", values["num_gt"])
    log_findings(findings, model_path.name)
    result.pop("pr_curves")
    result["metrics_file"] = str(output_dir / METRICS_FILE)
    result["pr_curve_file"] = str(output_dir / PR_CURVE_FILE)
    return result


def _score(spec: ExperimentSpec, forward, samples, arch, output_dir: Path) -> dict:
    """Run `forward` over the val samples: the scores (metrics.json's, with PR curves and the learning check),
    and detections.json / ground_truth.json in output_dir."""
    started = time.perf_counter()
    detections = predict(forward, samples, spec, arch)
    seconds = time.perf_counter() - started
    truth = [GroundTruth(s.boxes, s.classes, s.image_path.name, s.width, s.height) for s in samples]
    metrics = evaluate_detections(truth, detections, spec.dataset.classes,
                                  max_detections=spec.model.decoder.max_detections)
    write_coco_files(truth, detections, spec.dataset.classes, output_dir / GROUND_TRUTH_FILE,
                     output_dir / DETECTIONS_FILE)
    check = learning_check(spec, truth, detections, metrics.map50)
    return {**metrics.to_dict(with_curves=True), "images_per_second": round(len(samples) / max(seconds, 1e-9), 2),
            "diagnostics": check.to_dict()}


def scoring_key(spec: ExperimentSpec, model_file: Path, samples) -> str:
    """What an evaluation's detections depend on, as a digest: the model's bytes, the val images (path and
    size), the model and image-size settings (decoding, anchors) and the batch size."""
    return json_sha256({"model_sha256": file_sha256(model_file),
                        "images": [[str(s.image_path), s.image_path.stat().st_size] for s in samples],
                        "model": spec.model.model_dump(mode="json"),
                        "image_size": spec.dataset.image_size.model_dump(), "batch_size": spec.evaluate.batch_size})


def _scores_of(folder: Path, key: str, output_dir: Path) -> dict | None:
    """The scores of the evaluation in `folder` (its metrics.json; its detections and ground truth copied into
    output_dir) when it scored what `key` names; None, saying why, when it did not."""
    try:
        scores = json.loads((folder / METRICS_FILE).read_text())
    except (OSError, ValueError) as exc:
        log.info("scoring the model: %s has no evaluation to take (%s)", folder, exc)
        return None
    if scores.get("scoring_key") != key:
        log.info("scoring the model: %s scored another model, other images or other settings", folder)
        return None
    for name in (DETECTIONS_FILE, GROUND_TRUTH_FILE):
        shutil.copyfile(folder / name, output_dir / name)
    log.info("the same model, images and settings as %s: its scores taken, the model not run again", folder)
    return {**scores, "scores_from": str(folder)}


def scored_by(model_path: Path) -> str:
    """What runs the model evaluate scores: an engine folder's label ("onnxruntime cpu int8", "tensorrt fp16"),
    ONNX Runtime on its first provider for an ONNX file, TensorFlow for a Keras model."""
    from qatpipe.engines.base import EngineMetadata, engine_label, is_explicitly_quantized
    from qatpipe.onnx_model import available_providers, load_onnx_proto

    if model_path.is_dir():
        return EngineMetadata.read(model_path).label
    if model_path.suffix.lower() == ".onnx":
        device = available_providers()[0].removesuffix("ExecutionProvider").lower()
        return engine_label("onnxruntime", device, "int8" if is_explicitly_quantized(load_onnx_proto(model_path))
                            else "fp32")
    return "tensorflow"


def tracked_metrics(result: dict) -> dict[str, float]:
    """The numbers of an evaluation worth a metric: overall and per-class AP, the learning check's class-agnostic
    mAP@0.5 and class accuracy, speed, size."""
    metrics = {key: result[key] for key in ("map50", "map", "images_per_second", "model_size_mb") if key in result}
    metrics.update(diagnostics_metrics(result.get("diagnostics")))
    for name, values in result.get("per_class", {}).items():
        for key in ("ap50", "ap"):
            if values.get(key) is not None:
                metrics[f"{key}.{name}"] = values[key]
    return metrics


__all__ = ["evaluate", "scored_by", "tracked_metrics", "METRICS_FILE", "PR_CURVE_FILE", "DETECTIONS_FILE",
           "GROUND_TRUTH_FILE"]
