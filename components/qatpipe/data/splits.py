"""Spec -> validated samples of a split, fetching s3:// datasets into the local cache first."""

from __future__ import annotations

from typing import Literal

from qatpipe.data.kitti import ClassMap, KittiSample, read_kitti_dataset
from qatpipe.storage import resolve_dataset_dir
from qatpipe.errors import SpecError
from qatpipe.spec import ExperimentSpec

Split = Literal["train", "val"]


def class_map_from_spec(spec: ExperimentSpec) -> ClassMap:
    ds = spec.dataset
    return ClassMap.create(ds.classes, ds.class_mapping, ds.ignore_classes)


def load_split(spec: ExperimentSpec, split: Split) -> list[KittiSample]:
    uri = getattr(spec.dataset, split)
    if uri is None:
        raise SpecError(
            f"dataset.{split} is not set: name a KITTI folder (--set dataset.{split}=PATH), or let the pipeline "
            f"generate synthetic data (`qatpipe run --local`), or write it with `qatpipe data synth --out DIR`"
        )
    folder = resolve_dataset_dir(uri, spec.dataset.cache_dir)  # a local path comes back as it is
    return read_kitti_dataset(folder, class_map_from_spec(spec), spec.dataset.box_tolerance_px, key=f"dataset.{split}",
                              follow_symlinks=spec.dataset.follow_symlinks)


def sample_split(spec: ExperimentSpec, split: Split, count: int, seed: int) -> list[KittiSample]:
    """A seeded sample of `count` images of a split (all of them if it has fewer), in data-set order: the
    calibration sets of QAT and PTQ."""
    return seeded_sample(load_split(spec, split), count, seed)


def seeded_sample(samples: list[KittiSample], count: int, seed: int) -> list[KittiSample]:
    """`count` of `samples` (all of them if there are fewer) drawn with `seed`, in their order."""
    import numpy as np

    picked = np.random.default_rng(seed).choice(len(samples), size=min(count, len(samples)), replace=False)
    return [samples[i] for i in sorted(picked)]
