"""Running a detector over images: `predict` decodes any forward pass (Keras, ONNX Runtime, a built engine) into
detections in each image's own pixels; `onnx_forward` and `engine_forward` are the forward passes of an ONNX file
and of an engine folder, checked against the spec's detector. The evaluate stage, validation during training and
the MLflow model all decode through here, so they score a model alike."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from qatpipe.errors import ModelFileError
from qatpipe.spec import ExperimentSpec

log = logging.getLogger(__name__)


def predict(forward, samples, spec: ExperimentSpec, arch, batches=None) -> list:
    """Decode `forward(batch) -> {output name: array}` over samples, boxes in each image's own pixels. `batches`:
    the samples' images as eval_dataset batches them, read once for several models (default: read now)."""
    from qatpipe.data.pipeline import eval_dataset

    detections = []
    size = spec.dataset.image_size
    for batch in eval_dataset(samples, spec) if batches is None else batches:
        decoded = arch.decode(forward(batch))
        for det in decoded:
            sample = samples[len(detections)]
            detections.append(det.scaled(sample.width / size.width, sample.height / size.height))
        if len(detections) % (20 * spec.evaluate.batch_size) == 0:
            log.info("evaluated %d/%d images", len(detections), len(samples))
    return detections


def onnx_forward(model_path: Path, arch):
    """ONNX Runtime forward pass for `predict`, after checking the file against the spec's detector."""
    from qatpipe.onnx_model import OnnxModel

    model = OnnxModel(model_path)
    missing = [name for name in arch.output_names if name not in model.output_names]
    if missing:
        raise ModelFileError(f"{model_path}: outputs {model.output_names} lack {missing}")
    if tuple(model.input_shape[1:3]) != tuple(arch.input_hw):
        raise ModelFileError(f"{model_path}: input is {model.input_shape[1]}x{model.input_shape[2]}, the spec's "
                             f"dataset.image_size is {arch.input_hw[0]}x{arch.input_hw[1]}")
    return lambda batch: model.run(batch.numpy())


def engine_forward(engine_dir: Path, arch):
    """An engine's forward pass for `predict` and the engine file, after checking that the architecture decodes
    its outputs: its heads, or what an engine makes of them (an SSD's TensorRT engine outputs its NMS results)."""
    from qatpipe.engines import load_engine

    runner = load_engine(engine_dir)
    probe = runner.run(np.zeros((1, *arch.input_hw, 3), np.float32))
    try:
        arch.decode(probe)
    except KeyError as exc:
        missing = [name for name in arch.output_names if name not in probe] or [exc.args[0]]
        raise ModelFileError(f"{engine_dir}: engine outputs {sorted(probe)} lack {missing}") from None
    return (lambda batch: runner.run(batch.numpy())), engine_dir / runner.metadata.engine_file


__all__ = ["predict", "onnx_forward", "engine_forward"]
