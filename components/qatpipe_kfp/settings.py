"""The one place that says which image the components run on, and how components are declared."""

from __future__ import annotations

from kfp import dsl

# The project image (images/ builds it): TensorFlow 2.21, tf_keras, TensorRT where the base has it, and this
# package. The pipeline's `image` parameter overrides it per run.
DEFAULT_IMAGE = "ghcr.io/qatpipe/qatpipe:0.1.0"


def component(func=None, **kwargs):
    """`dsl.component` on the project image; kfp is in the image, so nothing is pip-installed at run time."""
    options = {"base_image": DEFAULT_IMAGE, "install_kfp_package": False, **kwargs}
    if func is None:
        return lambda f: dsl.component(f, **options)
    return dsl.component(func, **options)
