"""A variant as an MLflow model: one folder, two flavours over one ONNX file.

- `onnx`: `mlflow.onnx.load_model(uri)` gives the network as exported (raw coverage/bbox outputs).
- `python_function`: `mlflow.pyfunc.load_model(uri).predict(images)` gives detections, decoded with the spec's
  decoder exactly as `qatpipe evaluate` decodes them, boxes in each image's own pixels. The images are a uint8
  batch (N, H, W, 3), one image (H, W, 3), or a 1-D object array (or list) of image paths and/or arrays of any
  sizes. The answer is a table: a row per box (image, x1, y1, x2, y2, score, class_id, class_name).

The caller needs the installed `qatpipe` package and nothing qatpipe-specific in its code. The folder carries it:
the wheel of the qatpipe that logged the model, under wheels/<code digest>/ (deploy/wheel.py), which its
requirements.txt, python_env.yaml and conda.yaml name by that relative path, so `mlflow models serve`
(virtualenv, uv or conda) installs it anywhere. The folder also carries the files deployment needs
(`extra_files`: the calibration cache, implicit ONNX, DeepStream config, engine metadata), under artifacts/.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from qatpipe.deploy.wheel import WHEELS_DIR, qatpipe_wheel

log = logging.getLogger(__name__)

ONNX_KEY, SPEC_KEY = "onnx", "spec"
OUTPUT_COLUMNS = (("image", "long"), ("x1", "float"), ("y1", "float"), ("x2", "float"), ("y2", "float"),
                  ("score", "float"), ("class_id", "long"), ("class_name", "string"))

try:  # mlflow is a dependency of the package; the guard keeps `import qatpipe.deploy` light when it is absent
    from mlflow.pyfunc import PythonModel
except ImportError:  # pragma: no cover
    PythonModel = object


class DetectorModel(PythonModel):
    """The pyfunc flavour: images in, detections out (see the module docstring)."""

    def load_context(self, context):
        from qatpipe.inference import onnx_forward
        from qatpipe.models import get_architecture
        from qatpipe.spec import load_spec

        self.spec = load_spec(context.artifacts[SPEC_KEY])
        self.arch = get_architecture(self.spec)
        self.forward = onnx_forward(Path(context.artifacts[ONNX_KEY]), self.arch)

    def predict(self, context, model_input, params=None):
        import pandas as pd

        rows = []
        for index, det in enumerate(self.detect(_images(model_input))):
            names = self.spec.dataset.classes
            for box, score, cls in zip(det.boxes, det.scores, det.classes):
                rows.append((index, *map(float, box), float(score), int(cls), names[int(cls)]))
        frame = pd.DataFrame(rows, columns=[name for name, _ in OUTPUT_COLUMNS])
        return frame.astype({"image": "int64", "class_id": "int64", "x1": "float32", "y1": "float32",
                             "x2": "float32", "y2": "float32", "score": "float32"})

    def detect(self, images: list) -> list:
        """Detections per image (qatpipe.models.Detections), in that image's pixels."""
        import tensorflow as tf

        from qatpipe.data.pipeline import decode_image_file

        size, batch_size = self.spec.dataset.image_size, self.spec.evaluate.batch_size
        out = []
        for start in range(0, len(images), batch_size):
            resized, shapes = [], []
            for item in images[start:start + batch_size]:
                if isinstance(item, (str, Path)):
                    image = _read_image(item, decode_image_file)
                else:  # uint8 pixels, as decode_image_file's [0, 1] floats
                    image = tf.image.convert_image_dtype(tf.convert_to_tensor(np.asarray(item, np.uint8)),
                                                         tf.float32)
                shapes.append((int(image.shape[0]), int(image.shape[1])))
                resized.append(tf.image.resize(image, (size.height, size.width)))
            for det, (height, width) in zip(self.arch.decode(self.forward(tf.stack(resized))), shapes):
                out.append(det.scaled(width / size.width, height / size.height))
        return out


def _read_image(path, decode):
    """An image file as `decode` reads it; a DataError naming the file when it is missing or not an image."""
    import tensorflow as tf

    from qatpipe.errors import DataError

    try:
        return decode(str(path))
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as exc:
        raise DataError(path, f"cannot read the image: {exc.message.splitlines()[0]}") from None


def _images(model_input) -> list:
    """The images of a predict call: paths (str) and/or HxWx3 arrays."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        model_input = model_input.iloc[:, 0].tolist()
    if isinstance(model_input, (str, Path)):
        return [model_input]
    if isinstance(model_input, dict):  # a named tensor input ({"images": ...})
        model_input = next(iter(model_input.values()))
    if isinstance(model_input, np.ndarray) and model_input.dtype != object:
        if model_input.ndim in (3, 4) and model_input.shape[-1] == 3:
            return [model_input] if model_input.ndim == 3 else list(model_input)
        raise ValueError(f"images: expected an array of shape (N, H, W, 3) or (H, W, 3), got {model_input.shape}")
    items = list(model_input)
    for index, item in enumerate(items):
        if not isinstance(item, (str, Path)) and (np.ndim(item) != 3 or np.shape(item)[-1] != 3):
            raise ValueError(f"images[{index}]: expected a path or an (H, W, 3) array, got "
                             f"{type(item).__name__} of shape {np.shape(item)}")
    return items


def signature():
    """Input: uint8 images (N, H, W, 3), any size (a 1-D object array of paths or arrays passes too, as MLflow
    lets ragged input through this spec); output: the detection table."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema, TensorSpec

    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.uint8), (-1, -1, -1, 3), "images")]),
                          outputs=Schema([ColSpec(kind, name) for name, kind in OUTPUT_COLUMNS]))


def input_example(spec) -> np.ndarray:
    """A small grey image: MLflow stores it beside the model and runs it once to check serving."""
    return np.full((1, 32, 48, 3), 128, np.uint8)


def requirements(wheel: Path) -> list[str]:
    """What the model needs installed: the qatpipe wheel it carries (its decoder, the code that logged it), by its
    path in the model folder, under the code's digest (deploy/wheel.py says why). MLflow installs a model's
    requirements with the folder as the working directory (mlflow.utils.virtualenv), as for
    mlflow.models.utils.add_libraries_to_model's wheels/; pip takes the wheel's own dependencies (TensorFlow, ONNX
    Runtime, ...) from the package index."""
    return [f"{WHEELS_DIR}/{wheel.parent.name}/{wheel.name}"]


class DetectorFlavor:
    """`mlflow.models.Model.log` calls `save_model` of its flavour argument: this writes the two-flavour
    folder. Arguments come through Model.log's keyword arguments."""

    __name__ = "qatpipe"

    @staticmethod
    def save_model(path, mlflow_model, onnx_path, spec, extra_files=(), **_):
        save_detector_model(path, onnx_path, spec, extra_files, mlflow_model=mlflow_model)


def save_detector_model(path: str | Path, onnx_path: str | Path, spec, extra_files=(), mlflow_model=None) -> Path:
    """Write the MLflow model folder at `path` (see the module docstring); returns it."""
    import tempfile

    import mlflow.pyfunc
    import onnx
    from mlflow.models import Model

    from qatpipe.onnx_model import MODEL_PROVIDERS
    from qatpipe.spec import dump_spec

    wheel = qatpipe_wheel()  # first: a model that cannot carry its code is not written at all
    path, mlflow_model = Path(path), mlflow_model or Model()
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "spec.yaml"
        dump_spec(spec, spec_file)
        onnx_file = Path(tmp) / "model.onnx"
        shutil.copyfile(onnx_path, onnx_file)
        artifacts = {ONNX_KEY: str(onnx_file), SPEC_KEY: str(spec_file)}
        for extra in map(Path, extra_files):
            if extra.exists():
                artifacts[extra.name] = str(extra)
            else:
                log.warning("%s does not exist: not in the MLflow model", extra)
        mlflow.pyfunc.save_model(str(path), python_model=DetectorModel(), artifacts=artifacts,
                                 signature=signature(), input_example=input_example(spec),
                                 pip_requirements=requirements(wheel), mlflow_model=mlflow_model)
    (path / requirements(wheel)[0]).parent.mkdir(parents=True)
    shutil.copyfile(wheel, path / requirements(wheel)[0])
    # the onnx flavour reads the same file the pyfunc one does
    mlflow_model.add_flavor("onnx", onnx_version=onnx.__version__, data="artifacts/model.onnx",
                            providers=list(MODEL_PROVIDERS), code=None)
    mlflow_model.save(str(path / "MLmodel"))
    return path


__all__ = ["DetectorFlavor", "DetectorModel", "OUTPUT_COLUMNS", "save_detector_model", "signature"]
