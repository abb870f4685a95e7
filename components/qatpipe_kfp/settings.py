"""The one place that names the project's container images, and how components are declared.

images/build.sh builds and pushes exactly these names (`python -m qatpipe_kfp.settings` prints them); the
pipeline's `training_image` / `engine_image` parameters default to them and override them per run.
QATPIPE_IMAGE_REPOSITORY and QATPIPE_IMAGE_TAG, read when this module is imported, move all of them at once
(for a private registry, or a tag of your own build).
"""

from __future__ import annotations

import json
import os

from kfp import dsl

from qatpipe import __version__

IMAGE_REPOSITORY = os.environ.get("QATPIPE_IMAGE_REPOSITORY", "ghcr.io/qatpipe")
IMAGE_TAG = os.environ.get("QATPIPE_IMAGE_TAG", __version__)

# kind -> image. training: TensorFlow GPU, tf_keras, Horovod (NCCL, MPI), OpenMPI, qatpipe: every stage but the
# engine ones, and the MPIJob's launcher and workers. engine: NVIDIA's TensorRT base, ONNX Runtime, qatpipe:
# build-engine and validate. mlflow: the tracking server of manifests/.
IMAGES = {kind: f"{IMAGE_REPOSITORY}/qatpipe-{kind}:{IMAGE_TAG}" for kind in ("training", "engine", "mlflow")}
TRAINING_IMAGE = IMAGES["training"]
ENGINE_IMAGE = IMAGES["engine"]
DEFAULT_IMAGE = TRAINING_IMAGE


def component(func=None, **kwargs):
    """`dsl.component` on the training image; kfp is in the image, so nothing is pip-installed at run time."""
    options = {"base_image": DEFAULT_IMAGE, "install_kfp_package": False, **kwargs}
    if func is None:
        return lambda f: dsl.component(f, **options)
    return dsl.component(func, **options)


if __name__ == "__main__":  # images/build.sh: the names to build
    print(json.dumps(IMAGES))
