"""Shared fixtures. Everything here is real: real files, real TensorFlow, real pycocotools."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from qatpipe.spec import bundled_spec_path, load_spec  # noqa: E402

CLASSES = ["car", "pedestrian", "cyclist"]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    """A small synthetic KITTI dataset at the tiny spec's image size, made once per test session."""
    from qatpipe.data.synth import write_synthetic_dataset

    root = tmp_path_factory.mktemp("tiny_data")
    spec = load_spec(bundled_spec_path("tiny"))
    size = spec.dataset.image_size
    write_synthetic_dataset(root, num_train=192, num_val=48, seed=3, image_height=size.height,
                            image_width=size.width)
    return root


@pytest.fixture
def tiny_spec(tiny_dataset):
    """The bundled tiny spec pointed at the session's synthetic data; pass overrides as KEY=VALUE."""

    def make(*overrides: str):
        return load_spec(
            bundled_spec_path("tiny"),
            [f"dataset.train={tiny_dataset / 'train'}", f"dataset.val={tiny_dataset / 'val'}", *overrides],
        )

    return make


def write_kitti(root: Path, labels: dict[str, str], size=(160, 96), image_bytes: dict[str, bytes] | None = None):
    """A hand-made KITTI folder: stem -> label text; images are plain JPEGs of `size` (w, h)."""
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    for stem, text in labels.items():
        if image_bytes and stem in image_bytes:
            (root / "images" / f"{stem}.jpg").write_bytes(image_bytes[stem])
        else:
            Image.new("RGB", size, (120, 90, 60)).save(root / "images" / f"{stem}.jpg")
        (root / "labels" / f"{stem}.txt").write_text(text)
    return root


def kitti_line(cls="car", x1=10, y1=20, x2=50, y2=60) -> str:
    return f"{cls} 0.00 0 0.00 {x1} {y1} {x2} {y2} 0 0 0 0 0 0 0"
