"""The synthetic KITTI generator: valid labels, determinism, variety, and it never destroys existing data."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from qatpipe.data.kitti import ClassMap, read_kitti_dataset
from qatpipe.data.synth import SYNTH_CLASSES, write_synthetic_dataset
from qatpipe.errors import QatpipeError

H, W = 192, 320


@pytest.fixture(scope="module")
def sample_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    summary = write_synthetic_dataset(root, num_train=40, num_val=8, seed=11, image_height=H, image_width=W,
                                      workers=1)
    return root, summary


def test_files_and_labels_are_valid_kitti(sample_set):
    root, summary = sample_set
    assert len(list((root / "train" / "images").glob("*.jpg"))) == 40
    assert len(list((root / "val" / "labels").glob("*.txt"))) == 8
    assert (root / "classes.txt").read_text().split() == list(SYNTH_CLASSES)
    # the strict reader is the judge: field count, numbers, x1<x2, boxes inside the image, known classes
    samples = read_kitti_dataset(root / "train", ClassMap.create(SYNTH_CLASSES), tolerance=0.0)
    assert all((s.width, s.height) == (W, H) for s in samples)
    boxes = np.concatenate([s.boxes for s in samples])
    heights = boxes[:, 3] - boxes[:, 1]
    assert heights.max() > 60 and heights.min() < 40  # scale variety
    assert summary["splits"]["train"]["objects"] == len(boxes)
    assert set(summary["per_class"]) == set(SYNTH_CLASSES) and min(summary["per_class"].values()) > 10


def test_occlusion_and_truncation_are_recorded(sample_set):
    root, summary = sample_set
    occluded, truncated = [], []
    for path in (root / "train" / "labels").glob("*.txt"):
        for line in path.read_text().splitlines():
            fields = line.split()
            truncated.append(float(fields[1]))
            occluded.append(int(fields[2]))
    assert any(o > 0 for o in occluded) and any(t > 0 for t in truncated)
    assert summary["splits"]["train"]["occluded"] == sum(o > 0 for o in occluded)


def test_backgrounds_are_textured_and_noisy(sample_set):
    root, _ = sample_set
    image = np.asarray(Image.open(root / "val" / "images" / "000000.jpg"), np.float32)
    # per-pixel noise: neighbouring pixels differ; texture: large-scale variation across the image
    assert np.abs(np.diff(image, axis=1)).mean() > 2.0
    assert image.reshape(-1, 3).std(axis=0).mean() > 10.0


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = write_synthetic_dataset(tmp_path / "a", 6, 2, seed=4, image_height=H, image_width=W, workers=1)
    write_synthetic_dataset(tmp_path / "b", 6, 2, seed=4, image_height=H, image_width=W, workers=2)
    write_synthetic_dataset(tmp_path / "c", 6, 2, seed=5, image_height=H, image_width=W, workers=1)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) == 2 * (6 + 2) + 1 and a["splits"]["train"]["images"] == 6
    for rel in files:  # the worker count does not change the output
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert (tmp_path / "a" / "train" / "images" / "000000.jpg").read_bytes() != (
        tmp_path / "c" / "train" / "images" / "000000.jpg").read_bytes()


def test_refuses_to_overwrite_and_keeps_existing_files(tmp_path):
    write_synthetic_dataset(tmp_path, 2, 1, seed=0, image_height=H, image_width=W)
    label = tmp_path / "train" / "labels" / "000000.txt"
    before = label.read_bytes()
    with pytest.raises(QatpipeError, match=r"train exists and is not empty"):
        write_synthetic_dataset(tmp_path, 2, 1, seed=9, image_height=H, image_width=W)
    assert label.read_bytes() == before
    assert not list(tmp_path.glob(".*partial*"))
    write_synthetic_dataset(tmp_path, 3, 1, seed=9, image_height=H, image_width=W, overwrite=True)
    assert len(list((tmp_path / "train" / "images").iterdir())) == 3


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(QatpipeError, match="num_train must be >= 0"):
        write_synthetic_dataset(tmp_path, -1, 1)
    with pytest.raises(QatpipeError, match="object_height_px"):
        write_synthetic_dataset(tmp_path, 1, 1, object_height_px=(50, 20))


def test_small_images_scale_objects_and_stay_valid(tmp_path):
    summary = write_synthetic_dataset(tmp_path, 12, 4, seed=2, image_height=96, image_width=160, workers=1)
    for split, count in (("train", 12), ("val", 4)):
        assert len(list((tmp_path / split / "images").glob("*.jpg"))) == count
        samples = read_kitti_dataset(tmp_path / split, ClassMap.create(SYNTH_CLASSES), tolerance=0.0)
        assert all((s.width, s.height) == (160, 96) for s in samples)
        boxes = np.concatenate([s.boxes for s in samples])
        assert len(boxes) == summary["splits"][split]["objects"] > 0
        sizes = np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
        assert sizes.min() >= 6.0 and (boxes[:, 3] - boxes[:, 1]).max() <= 52.0  # 100 px * 96/192, plus AA
    for line in (tmp_path / "train" / "labels" / "000000.txt").read_text().splitlines():
        fields = line.split()
        assert len(fields) == 15 and fields[3] == "0.00" and all(f == "0.00" for f in fields[8:])


@pytest.mark.parametrize("kind", ["glyphs", "photos"])
def test_fine_grained_kinds_write_valid_reproducible_kitti(tmp_path, kind):
    """The two 10-class sets whose classes differ only inside the object (data/synth/detail.py)."""
    from qatpipe.data.synth import KINDS

    classes = KINDS[kind].classes
    first = write_synthetic_dataset(tmp_path / "a", num_train=30, num_val=4, seed=3, kind=kind, workers=1)
    write_synthetic_dataset(tmp_path / "b", num_train=30, num_val=4, seed=3, kind=kind, workers=2)
    assert len(classes) == 10 and first["classes"] == list(classes)
    assert (tmp_path / "a" / "classes.txt").read_text().split() == list(classes)
    samples = read_kitti_dataset(tmp_path / "a" / "train", ClassMap.create(classes), tolerance=0.0)
    boxes = np.concatenate([s.boxes for s in samples])
    sides = np.minimum(boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])
    assert 15 <= sides.min() and sides.max() <= 75  # 20-60 px, +-15% aspect jitter
    assert all(1 <= len(s.classes) <= 4 for s in samples)
    assert len(set(np.concatenate([s.classes for s in samples]).tolist())) >= 8  # most classes in 30 images
    for split in ("train", "val"):  # byte-identical whatever the number of workers
        for path in sorted((tmp_path / "a" / split).rglob("*.*")):
            assert path.read_bytes() == (tmp_path / "b" / split / path.relative_to(tmp_path / "a" / split)).read_bytes()


def test_unknown_kind_and_mismatched_classes_are_refused(tmp_path, tiny_spec):
    from qatpipe.data.prepare import prepare_dataset
    from qatpipe.errors import SpecError
    from qatpipe.spec import apply_overrides, parse_spec

    with pytest.raises(QatpipeError, match="unknown kind 'letters'"):
        write_synthetic_dataset(tmp_path / "x", num_train=1, num_val=1, kind="letters")
    data = apply_overrides(tiny_spec().to_dict(), ["dataset.train=null", "dataset.val=null",
                                                   "dataset.synthetic.kind=glyphs"])
    with pytest.raises(SpecError, match=r"not the classes of the synthetic data set 'glyphs'.*'zero', 'one'"):
        prepare_dataset(parse_spec(data), tmp_path / "prepared")
    assert not (tmp_path / "prepared" / "train").exists()


def test_glyphs_shift_keeps_the_train_split_and_prints_val_in_unseen_fonts(tmp_path):
    """The style-shift set (issue 36's measurement): train byte-identical to glyphs', val in other fonts only."""
    from qatpipe.data.synth import detail

    for kind in ("glyphs", "glyphs_shift"):
        write_synthetic_dataset(tmp_path / kind, num_train=3, num_val=3, seed=5, kind=kind, workers=1)
    for path in sorted((tmp_path / "glyphs" / "train").rglob("*.*")):
        assert path.read_bytes() == (tmp_path / "glyphs_shift" / "train" / path.relative_to(
            tmp_path / "glyphs" / "train")).read_bytes()
    val = sorted((tmp_path / "glyphs" / "val" / "images").iterdir())
    assert all(p.read_bytes() != (tmp_path / "glyphs_shift" / "val" / "images" / p.name).read_bytes() for p in val)
    assert detail.GLYPH_FONT not in detail.SHIFTED_GLYPH_FONTS
    for name in detail.SHIFTED_GLYPH_FONTS:  # every font has the digits
        assert detail._font(40, name).getbbox("0123456789")[2] > 40
