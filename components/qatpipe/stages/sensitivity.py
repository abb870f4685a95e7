"""Stage: layer sensitivity of a Q/DQ ONNX (a PTQ model or a QAT export): per quantizable layer, the mAP@0.5
drop on a val subset with only it INT8 and with every layer but it INT8 (quantization/sensitivity.py;
docs/sensitivity.md). Settings: the spec's `sensitivity` section. `sensitivity` measures one model (`qatpipe
sensitivity`); `sensitivity_models` several into one folder (the pipeline's sensitivity stage: ptq and qat)."""

from __future__ import annotations

import logging
from pathlib import Path

from qatpipe.errors import DataError, QatpipeError
from qatpipe.fileio import atomic_write_text, write_json
from qatpipe.spec import ExperimentSpec
from qatpipe.tracking.records import StageRecord

log = logging.getLogger(__name__)

JSON_FILE = "sensitivity.json"
CHART_FILE = "sensitivity.png"
MARKDOWN_FILE = "sensitivity.md"
HTML_FILE = "sensitivity.html"  # sensitivity_models: the tables and charts of every model, one page


def scorer(spec: ExperimentSpec, samples, arch, read_once: bool = True):
    """(score, batches, provider): score(onnx path) -> mAP@0.5 on `samples`, as evaluate scores a model
    (inference.predict, the same decoding and pycocotools), the images read once for every model scored
    (`read_once`; else read again for each model, and batches None: a whole val split need not fit in memory);
    and the provider that runs it."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.metrics.coco import GroundTruth, mean_ap50
    from qatpipe.inference import predict
    from qatpipe.onnx_model import OnnxModel, available_providers

    batches = [batch.numpy() for batch in eval_dataset(samples, spec)] if read_once else None
    truth = [GroundTruth(s.boxes, s.classes, s.image_path.name, s.width, s.height) for s in samples]

    def score(path: Path) -> float:
        model = OnnxModel(path)
        detections = predict(model.run, samples, spec, arch, batches=batches)
        return mean_ap50(truth, detections, spec.dataset.classes, max_detections=spec.model.decoder.max_detections)

    return score, batches, available_providers()[0]


def val_sample(spec: ExperimentSpec, arch):
    """(samples, score, batches, provider): the seeded val sample (spec.sensitivity) every model is scored on,
    and its scorer (the images read once for all models); ptq-partial scores on the same sample."""
    from qatpipe.data.splits import sample_split

    samples = sample_split(spec, "val", spec.sensitivity.val_images, spec.sensitivity.seed)
    if not any(len(s.classes) for s in samples):
        raise DataError(spec.dataset.val, "dataset.val: no labelled objects in the sample, so mAP is undefined")
    return samples, *scorer(spec, samples, arch)


def _output_folder(output_dir: str | Path) -> Path:
    output_dir = Path(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QatpipeError(f"{output_dir}: cannot create the output directory: {exc}") from None
    return output_dir


def _measure_model(spec: ExperimentSpec, model_path: Path, output_dir: Path, fp32_onnx: Path | None, sample,
                   title: str):
    """Measure one Q/DQ model on the shared `sample` (val_sample's) and write sensitivity.json / .png / .md into
    `output_dir`; returns the SensitivityResult."""
    from qatpipe.quantization.sensitivity import measure, plot_sensitivity, sensitivity_markdown

    samples, score, batches, provider = sample
    settings = spec.sensitivity
    log.info("sensitivity of %s on %d val images (%s)", model_path, len(samples), provider)
    result = measure(model_path, score, settings.layers, settings.max_layers, fp32_onnx,
                     screening_batch=batches[0])
    result.val_images = len(samples)
    result.scored_by = (f"ONNX Runtime {provider.removesuffix('ExecutionProvider')}, Q/DQ in the exact CPU form: "
                        "TensorRT's int8 numbers")
    write_json(output_dir / JSON_FILE, result.to_dict())
    plot_sensitivity(result, output_dir / CHART_FILE, title=f"{title}, {result.val_images} val images")
    atomic_write_text(output_dir / MARKDOWN_FILE, sensitivity_markdown(result, title))
    log.info("sensitivity of %s: %d layers in %.1f s; most sensitive %s", model_path.name, len(result.layers),
             result.seconds, ", ".join(f"{r.node} ({100 * r.drop_only_int8:+.2f})" for r in result.layers[:3])
             or "none")
    return result


def _figures(result) -> dict[str, float]:
    """A result's headline numbers, as a stage record's metrics."""
    top = result.layers[0] if result.layers else None
    figures = {"map50_float": result.map50_float, "map50_int8": result.map50_int8,
               "layers_measured": len(result.layers), "layers_total": result.layers_total,
               **({"max_drop_only_int8": top.drop_only_int8,
                   "max_recovery": max(r.recovery for r in result.layers)} if top else {}),
               "seconds": result.seconds}
    if result.map50_fp32_onnx is not None:
        figures["map50_fp32_onnx"] = result.map50_fp32_onnx
    return figures


def sensitivity(spec: ExperimentSpec, model_path: str | Path, output_dir: str | Path,
                fp32_onnx: str | Path | None = None, stage_name: str = "sensitivity") -> dict:
    """Measure the layer sensitivity of the Q/DQ ONNX `model_path` on spec.sensitivity.val_images of dataset.val
    (a seeded sample); `fp32_onnx`: the FP32 model it was quantized from, whose weights a bypassed layer reads
    where they match (a PTQ model's), and whose mAP the report adds. Writes sensitivity.json (layers most
    sensitive first), sensitivity.png, sensitivity.md and tracking.json to `output_dir`; returns the JSON's
    content."""
    from qatpipe.inference import onnx_forward
    from qatpipe.models import get_architecture

    model_path, output_dir = Path(model_path), _output_folder(output_dir)
    arch = get_architecture(spec)
    onnx_forward(model_path, arch)  # the model fits the spec's detector (outputs, input size), or fails naming it
    if fp32_onnx is not None:
        onnx_forward(Path(fp32_onnx), arch)
    result = _measure_model(spec, model_path, output_dir, Path(fp32_onnx) if fp32_onnx else None,
                            val_sample(spec, arch), f"Layer sensitivity of {model_path.name}")
    top = result.layers[0] if result.layers else None
    StageRecord(
        stage=stage_name,
        params={"model": model_path.name, **{f"sensitivity.{k}": v for k, v in spec.sensitivity.model_dump().items()}},
        metrics=_figures(result),
        artifacts=[JSON_FILE, CHART_FILE, MARKDOWN_FILE],
        tags={"sensitivity.most_sensitive": top.node} if top else {},
    ).write(output_dir)
    return result.to_dict()


def sensitivity_models(spec: ExperimentSpec, fp32_onnx: str | Path | None, models: dict[str, str | Path],
                       output_dir: str | Path, stage_name: str = "sensitivity") -> dict[str, dict]:
    """The layer sensitivity of several Q/DQ models (variant name -> ONNX: the pipeline's ptq and qat), each as
    `sensitivity` measures it, all on the same val sample: output_dir/<variant>/ gets that model's
    sensitivity.json, .png and .md; output_dir gets sensitivity.md (every variant's table under an overview),
    sensitivity.html (the tables and bar charts: the KFP UI's page) and one tracking record for the stage, its
    metrics per variant (`ptq.map50_int8`, ...) and the variants' folders its artifacts. Returns variant ->
    sensitivity.json's content."""
    from qatpipe.html_report import sections_page
    from qatpipe.inference import onnx_forward
    from qatpipe.models import get_architecture

    if not models:
        raise QatpipeError("sensitivity: no models to measure")
    bad = [name for name in models if not name or "/" in name or name.startswith(".")]
    if bad:
        raise QatpipeError(f"sensitivity: {bad[0]!r} cannot name a variant's folder")
    output_dir = _output_folder(output_dir)
    arch = get_architecture(spec)
    paths = {name: Path(path) for name, path in models.items()}
    for path in [*paths.values(), *([Path(fp32_onnx)] if fp32_onnx else [])]:
        onnx_forward(path, arch)  # every model fits the spec's detector, checked before any is measured
    sample = val_sample(spec, arch)
    results = {name: _measure_model(spec, path, _output_folder(output_dir / name), Path(fp32_onnx) if fp32_onnx
                                    else None, sample, f"Layer sensitivity of the {name} model ({path.name})")
               for name, path in paths.items()}
    overview = overview_markdown(results)
    tables = {name: (output_dir / name / MARKDOWN_FILE).read_text() for name in results}
    atomic_write_text(output_dir / MARKDOWN_FILE, "\n".join([overview, *tables.values()]))
    atomic_write_text(output_dir / HTML_FILE, sections_page(
        "Layer sensitivity", [("", overview, [])] + [(f"{name} model", tables[name], [output_dir / name / CHART_FILE])
                                                     for name in results]))
    metrics = {f"{name}.{key}": value for name, result in results.items() for key, value in _figures(result).items()}
    metrics["seconds"] = round(sum(result.seconds for result in results.values()), 2)
    StageRecord(
        stage=stage_name,
        params={**{f"{name}.model": path.name for name, path in paths.items()},
                **{f"sensitivity.{k}": v for k, v in spec.sensitivity.model_dump().items()}},
        metrics=metrics,
        artifacts=[MARKDOWN_FILE, HTML_FILE, *results],
        tags={f"sensitivity.{name}.most_sensitive": result.layers[0].node for name, result in results.items()
              if result.layers},
    ).write(output_dir)
    return {name: result.to_dict() for name, result in results.items()}


def overview_markdown(results: dict) -> str:
    """One row per model: its mAP@0.5 float, INT8 and FP32, and its three most sensitive layers (variant ->
    SensitivityResult)."""
    lines = ["# Layer sensitivity", "",
             "Per model: mAP@0.5 with no layer INT8, with every layer INT8, of the FP32 ONNX, and the layers whose "
             "INT8 alone costs the most (drop in mAP@0.5 points; the tables below hold every measured layer).", "",
             "| model | val images | no layer INT8 | every layer INT8 | drop | FP32 ONNX | layers measured | "
             "most sensitive |", "|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        fp32 = "n/a" if result.map50_fp32_onnx is None else f"{result.map50_fp32_onnx:.4f}"
        top = ", ".join(f"{r.name} ({100 * r.drop_only_int8:+.2f})" for r in result.layers[:3]) or "none"
        lines.append(f"| {name} | {result.val_images} | {result.map50_float:.4f} | {result.map50_int8:.4f} | "
                     f"{100 * (result.map50_float - result.map50_int8):+.2f} | {fp32} | "
                     f"{len(result.layers)} / {result.layers_total} | {top} |")
    return "\n".join(lines) + "\n"


__all__ = ["sensitivity", "sensitivity_models", "overview_markdown", "scorer", "val_sample", "JSON_FILE",
           "CHART_FILE", "MARKDOWN_FILE", "HTML_FILE"]
