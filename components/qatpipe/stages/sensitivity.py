"""Stage: layer sensitivity of a Q/DQ ONNX (a PTQ model or a QAT export): per quantizable layer, the mAP@0.5
drop on a val subset with only it INT8 and with every layer but it INT8 (quantization/sensitivity.py;
docs/sensitivity.md). Settings: the spec's `sensitivity` section."""

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


def scorer(spec: ExperimentSpec, samples, arch):
    """score(onnx path) -> mAP@0.5 on `samples`, as evaluate scores a model (inference.predict, the same
    decoding and pycocotools), the images read once for every model scored; and the provider that runs it."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.metrics.coco import GroundTruth, evaluate_detections
    from qatpipe.inference import predict
    from qatpipe.onnx_model import OnnxModel, available_providers

    batches = [batch.numpy() for batch in eval_dataset(samples, spec)]
    truth = [GroundTruth(s.boxes, s.classes, s.image_path.name, s.width, s.height) for s in samples]

    def score(path: Path) -> float:
        model = OnnxModel(path)
        detections = predict(model.run, samples, spec, arch, batches=batches)
        return evaluate_detections(truth, detections, spec.dataset.classes,
                                   max_detections=spec.model.decoder.max_detections).map50

    return score, batches, available_providers()[0]


def sensitivity(spec: ExperimentSpec, model_path: str | Path, output_dir: str | Path,
                fp32_onnx: str | Path | None = None, stage_name: str = "sensitivity") -> dict:
    """Measure the layer sensitivity of the Q/DQ ONNX `model_path` on spec.sensitivity.val_images of dataset.val
    (a seeded sample); `fp32_onnx`: the FP32 model it was quantized from, whose weights a bypassed layer reads
    where they match (a PTQ model's), and whose mAP the report adds. Writes sensitivity.json (layers most
    sensitive first), sensitivity.png, sensitivity.md and tracking.json to `output_dir`; returns the JSON's
    content."""
    from qatpipe.data.splits import sample_split
    from qatpipe.inference import onnx_forward
    from qatpipe.models import get_architecture
    from qatpipe.quantization.sensitivity import measure, plot_sensitivity, sensitivity_markdown

    settings = spec.sensitivity
    model_path, output_dir = Path(model_path), Path(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QatpipeError(f"{output_dir}: cannot create the output directory: {exc}") from None
    arch = get_architecture(spec)
    onnx_forward(model_path, arch)  # the model fits the spec's detector (outputs, input size), or fails naming it
    if fp32_onnx is not None:
        onnx_forward(Path(fp32_onnx), arch)
    samples = sample_split(spec, "val", settings.val_images, settings.seed)
    if not any(len(s.classes) for s in samples):
        raise DataError(spec.dataset.val, "dataset.val: no labelled objects in the sample, so mAP is undefined")
    score, batches, provider = scorer(spec, samples, arch)
    log.info("sensitivity of %s on %d val images (%s)", model_path, len(samples), provider)
    result = measure(model_path, score, settings.layers, settings.max_layers, fp32_onnx,
                     screening_batch=batches[0])
    result.val_images = len(samples)
    result.scored_by = (f"ONNX Runtime {provider.removesuffix('ExecutionProvider')}, Q/DQ in the exact CPU form: "
                        "TensorRT's int8 numbers")
    data = result.to_dict()
    write_json(output_dir / JSON_FILE, data)
    plot_sensitivity(result, output_dir / CHART_FILE, title=f"Layer sensitivity of {model_path.name}, "
                                                             f"{result.val_images} val images")
    atomic_write_text(output_dir / MARKDOWN_FILE, sensitivity_markdown(result, f"Layer sensitivity of "
                                                                               f"{model_path.name}"))
    top = result.layers[0] if result.layers else None
    StageRecord(
        stage=stage_name,
        params={"model": model_path.name, **{f"sensitivity.{k}": v for k, v in settings.model_dump().items()}},
        metrics={"map50_float": result.map50_float, "map50_int8": result.map50_int8,
                 "layers_measured": len(result.layers), "layers_total": result.layers_total,
                 **({"max_drop_only_int8": top.drop_only_int8,
                     "max_recovery": max(r.recovery for r in result.layers)} if top else {}),
                 "seconds": result.seconds},
        artifacts=[JSON_FILE, CHART_FILE, MARKDOWN_FILE],
        tags={"sensitivity.most_sensitive": top.node} if top else {},
    ).write(output_dir)
    log.info("sensitivity: %d layers in %.1f s; most sensitive %s", len(result.layers), result.seconds,
             ", ".join(f"{r.node} ({100 * r.drop_only_int8:+.2f})" for r in result.layers[:3]) or "none")
    return data


__all__ = ["sensitivity", "scorer", "JSON_FILE", "CHART_FILE", "MARKDOWN_FILE"]
