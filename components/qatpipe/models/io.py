"""Loading saved detector models with clear errors for missing, corrupt or wrong-kind files."""

from __future__ import annotations

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

    import qatpipe.quantization.layers  # noqa: F401  (registers the QAT layers, so QAT models load)

    path = check_keras_file(path)
    try:
        model = keras.models.load_model(path, compile=False)
    except Exception as exc:  # Keras raises many kinds (ValueError, OSError, KeyError) for bad files
        raise ModelFileError(f"{path}: cannot load model: {type(exc).__name__}: {exc}") from None
    if arch is not None:
        arch.check_model(model, str(path))
    return model
