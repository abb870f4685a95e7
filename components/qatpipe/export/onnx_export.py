"""tf_keras detector -> ONNX through tf2onnx, with a check that ONNX Runtime computes what TensorFlow does."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.fileio import replacing
from qatpipe.models.base import INPUT_NAME

log = logging.getLogger(__name__)


def export_onnx(model, path: str | Path, opset: int, batch_size: int | None = None) -> Path:
    """Write `model` as ONNX (NHWC float32 input named input_1, outputs named as the model's) atomically.
    `batch_size` None leaves the batch dimension dynamic (TensorRT builds an optimisation profile for it)."""
    import tensorflow as tf
    import tf2onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width, channels = model.input_shape[1:]
    signature = (tf.TensorSpec((batch_size, height, width, channels), tf.float32, name=INPUT_NAME),)
    try:
        proto, _ = tf2onnx.convert.from_keras(model, input_signature=signature, opset=opset)
        _name_batch_dimension(proto)
        save_onnx(proto, path)
    except Exception as exc:
        raise QatpipeError(f"{path}: ONNX export failed: {type(exc).__name__}: {exc}") from None
    return path


def _name_batch_dimension(proto) -> None:
    """tf2onnx calls the dynamic batch dimension `unk__N`; TensorRT profiles and people read `batch` better."""
    for value in list(proto.graph.input) + list(proto.graph.output):
        dim = value.type.tensor_type.shape.dim[0]
        if not dim.HasField("dim_value"):
            dim.dim_param = "batch"


def save_onnx(proto, path: str | Path) -> Path:
    path = Path(path)
    with replacing(path) as tmp:
        tmp.write_bytes(proto.SerializeToString())
    return path


def write_decoding(onnx_path: str | Path, decoding) -> dict[str, str]:
    """Add the metadata that carries `decoding` (a models.decoding record, from the architecture's `decoding()`;
    None adds nothing) to the ONNX file at `onnx_path`, its other metadata kept; returns what was added."""
    import onnx

    from qatpipe.models.decoding import decoding_metadata

    metadata = decoding_metadata(decoding)
    if metadata:
        model = onnx.load(onnx_path)
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **metadata})
        save_onnx(model, onnx_path)
    return metadata


def output_differences(model, onnx_path: str | Path, inputs: np.ndarray, reference: dict | None = None
                       ) -> dict[str, dict]:
    """Per output, how far ONNX Runtime is from TensorFlow on `inputs`: the largest absolute difference, and
    percentiles of the difference in int8 steps of that output's range (max |TF| / 127). `reference`: the
    model's outputs on `inputs` (tf_outputs), when the caller already has them."""
    from qatpipe.onnx_model import OnnxModel

    reference = tf_outputs(model, inputs) if reference is None else reference
    return step_differences(reference, OnnxModel(onnx_path).run(inputs))


def rounding_sensitivity(model, inputs: np.ndarray, relative: float, seed: int = 0,
                         reference: dict | None = None) -> dict[str, dict]:
    """The same figures for TensorFlow against itself on `inputs` moved by +-`relative` (a few ulps): how far a
    quantized model's outputs move when values near int8 rounding boundaries flip, which is all an exact
    conversion may differ by. A deep quantized network carries such flips much further than a shallow one."""
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), size=inputs.shape)
    moved = (inputs * (1 + signs * np.float32(relative))).astype(np.float32)
    reference = tf_outputs(model, inputs) if reference is None else reference
    return step_differences(reference, tf_outputs(model, moved))


def tf_outputs(model, inputs) -> dict[str, np.ndarray]:
    """Output name -> the Keras model's outputs on `inputs` (inference mode), as NumPy."""
    outputs = model(inputs, training=False)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return dict(zip([name.split("/")[0] for name in model.output_names], (o.numpy() for o in outputs)))


def step_differences(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict[str, dict]:
    result = {}
    for name, expected in reference.items():
        diff = np.abs(expected - other[name])
        step = max(float(np.abs(expected).max()), 1e-12) / 127.0
        result[name] = {"max_abs": float(diff.max()),
                        **{f"p{q}_steps": round(float(np.percentile(diff, q)) / step, 4) for q in (50, 90, 99)},
                        "max_steps": round(float(diff.max()) / step, 3)}
    return result
