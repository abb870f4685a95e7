"""Loading saved detector models with clear errors for missing, corrupt or wrong-kind files.

A QAT model's quantized layers load from tf_keras' registry of serializable classes (`qatpipe>QDQConv2D`, ...),
which quantization/layers.py fills when imported: models/ sits below quantization/ and does not import it, so a
caller that may load a QAT model imports that module first (the evaluate, export and train stages do)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from qatpipe.errors import ModelFileError

KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")


def check_keras_file(path: str | Path) -> Path:
    """`path`, when it is there and looks like a Keras model file; else a ModelFileError saying what is wrong.
    Cheap (TensorFlow is not loaded), so a command checks its inputs with it before any work."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: model file not found")
    if path.is_dir() or path.suffix.lower() not in KERAS_SUFFIXES:
        raise ModelFileError(f"{path}: not a Keras model file (expected one of {', '.join(KERAS_SUFFIXES)})")
    if path.suffix.lower() == ".keras" and not zipfile.is_zipfile(path):
        raise ModelFileError(f"{path}: corrupt model file (a .keras file is a zip archive)")
    return path


def load_keras_model(path: str | Path, arch=None):
    """A tf_keras model saved by a qatpipe stage (`.keras`, or TAO-style `.hdf5`), checked against `arch`."""
    import tf_keras as keras

    path = check_keras_file(path)
    if unregistered := unregistered_classes(path):  # else Keras fails with "'str' object is not callable"
        raise ModelFileError(f"{path}: holds layers not registered with tf_keras in this process: "
                             f"{', '.join(unregistered)} (qatpipe's QAT layers register when "
                             "qatpipe.quantization.layers is imported)")
    try:
        model = keras.models.load_model(path, compile=False)
    except Exception as exc:  # Keras raises many kinds (ValueError, OSError, KeyError) for bad files
        raise ModelFileError(f"{path}: cannot load model: {type(exc).__name__}: {exc}") from None
    if arch is not None:
        arch.check_model(model, str(path))
    return model


def unregistered_classes(path: Path) -> list[str]:
    """The registered names (`package>Class`) of the custom classes a `.keras` file's config uses that tf_keras'
    registry does not hold in this process; [] for other files or where the config cannot be read."""
    import tf_keras as keras

    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return []
    return sorted({name for name in _registered_names(config) if keras.utils.get_registered_object(name) is None})


def _registered_names(node):
    """Every `registered_name` of a custom class (`package>Class`) in a Keras config, nested ones included."""
    if isinstance(node, dict):
        name = node.get("registered_name")
        if isinstance(name, str) and ">" in name:
            yield name
        node = list(node.values())
    if isinstance(node, list):
        for child in node:
            yield from _registered_names(child)
