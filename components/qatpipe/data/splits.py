"""Spec -> validated samples of a split, fetching s3:// datasets into the local cache first."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from qatpipe.data.kitti import ClassMap, KittiSample, read_kitti_dataset
from qatpipe.data.storage import is_s3_uri, resolve_dataset_dir
from qatpipe.errors import DataError
from qatpipe.spec import ExperimentSpec

Split = Literal["train", "val"]


def class_map_from_spec(spec: ExperimentSpec) -> ClassMap:
    ds = spec.dataset
    return ClassMap.create(ds.classes, ds.class_mapping, ds.ignore_classes)


def load_split(spec: ExperimentSpec, split: Split) -> list[KittiSample]:
    uri = getattr(spec.dataset, split)
    key = f"dataset.{split}"
    if not is_s3_uri(uri) and not Path(uri).is_dir():
        raise DataError(uri, f"{key}: dataset folder not found")
    folder = resolve_dataset_dir(uri, spec.dataset.cache_dir)
    return read_kitti_dataset(folder, class_map_from_spec(spec), spec.dataset.box_tolerance_px, key=key)
