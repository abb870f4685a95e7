"""Preparing the data set: synthetic when the spec names none, validated when it does."""

from __future__ import annotations

import json

import pytest

from qatpipe.data.prepare import prepare_dataset, read_manifest, spec_with_prepared_dataset, with_default_dataset
from qatpipe.errors import DataError, SpecError
from qatpipe.spec import bundled_spec_path, load_spec

from conftest import kitti_line, write_kitti


def _tiny(*overrides):
    return load_spec(bundled_spec_path("tiny"), list(overrides))


def test_named_dataset_is_validated_and_counted(tiny_spec, tmp_path):
    spec = tiny_spec()
    manifest = prepare_dataset(spec, tmp_path / "prepared")
    assert manifest["source"] == "spec" and manifest["train"] == spec.dataset.train
    assert manifest["counts"]["train"]["images"] == 192 and manifest["counts"]["val"]["images"] == 48
    assert sum(manifest["counts"]["val"]["objects"].values()) > 48
    resolved = spec_with_prepared_dataset(_tiny(), tmp_path / "prepared")
    assert (resolved.dataset.train, resolved.dataset.val) == (spec.dataset.train, spec.dataset.val)


def test_a_bad_label_stops_preparation_with_file_and_line(tmp_path):
    good = write_kitti(tmp_path / "val", {"a": kitti_line()})
    bad = write_kitti(tmp_path / "train", {"a": kitti_line(), "b": kitti_line() + "\n" + kitti_line(cls="tank")})
    spec = _tiny(f"dataset.train={bad}", f"dataset.val={good}")
    with pytest.raises(DataError, match=r"train/labels/b\.txt:2: unknown class 'tank'"):
        prepare_dataset(spec, tmp_path / "prepared")
    assert not (tmp_path / "prepared" / "dataset.json").exists()


def test_the_digest_follows_the_files_bytes(tmp_path):
    """dataset.json's digests (MLflow's data set versions) change when one image changes, and only then."""
    val = write_kitti(tmp_path / "val", {"a": kitti_line()})
    train = write_kitti(tmp_path / "train", {"a": kitti_line(), "b": kitti_line(cls="cyclist")})
    spec = _tiny(f"dataset.train={train}", f"dataset.val={val}")
    first = prepare_dataset(spec, tmp_path / "one")["digests"]
    assert prepare_dataset(spec, tmp_path / "two")["digests"] == first and len(first["train"]) == 16
    image = train / "images" / "b.jpg"
    image.write_bytes(image.read_bytes() + b"\0")  # same name, same labels, other bytes
    changed = prepare_dataset(spec, tmp_path / "three")["digests"]
    assert changed["train"] != first["train"] and changed["val"] == first["val"]


def test_synthetic_default_is_made_once_and_reused(tmp_path):
    spec = _tiny("dataset.synthetic.train_images=4", "dataset.synthetic.val_images=2",
                 f"dataset.cache_dir={tmp_path / 'cache'}")
    first = with_default_dataset(spec)
    folder = tmp_path / "cache" / "synthetic" / "shapes-seed0-4x2-192x320"
    assert first.dataset.train == str(folder / "train")
    manifest = folder / "dataset.json"
    assert json.loads(manifest.read_text())["counts"]["train"]["images"] == 4
    stamp = manifest.stat().st_mtime_ns
    assert with_default_dataset(spec) == first and manifest.stat().st_mtime_ns == stamp


def test_unset_split_and_missing_manifest_errors(tmp_path):
    from qatpipe.data.splits import load_split

    with pytest.raises(SpecError, match="dataset.val is not set"):
        load_split(_tiny(), "val")
    with pytest.raises(DataError, match="not a prepared data set"):
        read_manifest(tmp_path)
