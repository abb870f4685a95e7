"""The prepare-data stage's library part: make the spec's data set available and checked, once.

A prepared data set is a folder with `dataset.json`:
  {"source": "synthetic" | "spec", "train": PATH_OR_URI, "val": PATH_OR_URI, "counts": {...},
   "digests": {"train": HEX, "val": HEX}}
(a digest covers every image's and label's bytes: MLflow records it as the data set's version)
Synthetic data lives inside the folder (paths relative to it), so the folder itself can travel as a
pipeline artifact; a named data set (local or s3://) stays where it is and the manifest records its URIs.
Later stages call `spec_with_prepared_dataset` to point their spec at it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
from pathlib import Path

from qatpipe.data.splits import load_split
from qatpipe.data.synth import KINDS, write_synthetic_dataset
from qatpipe.errors import DataError, SpecError
from qatpipe.fileio import write_json
from qatpipe.spec import ExperimentSpec

log = logging.getLogger(__name__)

MANIFEST = "dataset.json"


def prepare_dataset(spec: ExperimentSpec, out_dir: str | Path) -> dict:
    """Generate (no train/val named) or fetch and validate the data set; write `out_dir/dataset.json`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ds = spec.dataset
    if ds.train is None and ds.val is None:
        size, synth = ds.image_size, ds.synthetic
        kind_classes = list(KINDS[synth.kind].classes)
        if list(ds.classes) != kind_classes:
            raise SpecError(f"dataset.classes {list(ds.classes)} are not the classes of the synthetic data set "
                            f"'{synth.kind}' (dataset.synthetic.kind): {kind_classes}")
        log.info("dataset.train/val not set: generating %d + %d synthetic '%s' images (seed %d)",
                 synth.train_images, synth.val_images, synth.kind, synth.seed)
        write_synthetic_dataset(out_dir, synth.train_images, synth.val_images, synth.seed, kind=synth.kind,
                                image_height=size.height, image_width=size.width, overwrite=True)
        source, train, val = "synthetic", "train", "val"
    elif ds.train is None or ds.val is None:
        missing = "dataset.train" if ds.train is None else "dataset.val"
        raise SpecError(f"{missing} is not set: name both dataset.train and dataset.val, or neither (then "
                        f"the synthetic data set dataset.synthetic is generated)")
    else:  # named folders stay where they are; local ones recorded absolute (later stages run elsewhere)
        source, train, val = "spec", _absolute(ds.train), _absolute(ds.val)
    resolved = spec_with_prepared_dataset(spec, out_dir, {"train": train, "val": val})
    samples = {split: load_split(resolved, split) for split in ("train", "val")}  # the strict KITTI checks
    counts = {split: _counts(resolved, found) for split, found in samples.items()}
    digests = {split: split_digest(found) for split, found in samples.items()}
    manifest = {"source": source, "train": train, "val": val, "classes": list(ds.classes), "counts": counts,
                "digests": digests}
    write_json(out_dir / MANIFEST, manifest)
    log.info("dataset ready: %s", json.dumps(counts))
    return manifest


def _absolute(where: str) -> str:
    return where if "://" in where else str(Path(where).resolve())


def with_default_dataset(spec: ExperimentSpec) -> ExperimentSpec:
    """The spec as is when it names its data; else pointed at its synthetic data set, generated once into
    dataset.cache_dir (the command-line equivalent of the pipeline's prepare-data stage)."""
    ds = spec.dataset
    if ds.train is not None or ds.val is not None:
        return spec
    size, synth = ds.image_size, ds.synthetic
    folder = (Path(ds.cache_dir) / "synthetic"
              / f"{synth.kind}-seed{synth.seed}-{synth.train_images}x{synth.val_images}-{size.height}x{size.width}")
    if (folder / MANIFEST).is_file():
        return spec_with_prepared_dataset(spec, folder)
    prepare_dataset(spec, folder)
    return spec_with_prepared_dataset(spec, folder)


def _counts(spec: ExperimentSpec, samples: list) -> dict:
    """Images and objects per class of one split."""
    objects = collections.Counter(spec.dataset.classes[int(c)] for sample in samples for c in sample.classes)
    return {"images": len(samples), "objects": {name: objects.get(name, 0) for name in spec.dataset.classes}}


def split_digest(samples: list) -> str:
    """16 hex digits of SHA-256 over every image's and label's name and bytes, in name order."""
    total = hashlib.sha256()
    for sample in sorted(samples, key=lambda s: s.image_path.name):
        for path in (sample.image_path, sample.label_path):
            total.update(path.name.encode() + b"\0" + _file_digest(path))
    return total.hexdigest()[:16]


def _file_digest(path: Path) -> bytes:
    """SHA-256 of a file's bytes, streamed (light tasks hash data sets of any size)."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


def data_fingerprint(spec: ExperimentSpec) -> str:
    """What a prepared data set depends on beyond the spec: 16 hex digits of SHA-256 over the S3 listing (keys,
    sizes, ETags) or the local files (paths, sizes, SHA-256 of the bytes) of dataset.train and dataset.val;
    "synthetic" when the spec names no data (then the spec alone decides it). The pipeline passes it to
    prepare-data, so new or changed files under the same URI miss the cache."""
    from qatpipe.storage import is_s3_uri, list_objects

    ds = spec.dataset
    if ds.train is None and ds.val is None:
        return "synthetic"
    total = hashlib.sha256()
    for split in ("train", "val"):
        where = getattr(ds, split)
        if where is None:
            continue  # prepare_dataset reports the missing half
        total.update(f"{split}\0{where}\0".encode())
        if is_s3_uri(where):
            for obj in sorted(list_objects(where), key=lambda o: o["Key"]):
                total.update(f"{obj['Key']}\0{obj['Size']}\0{obj['ETag']}\n".encode())
            continue
        folder = Path(where)
        if not folder.is_dir():
            raise DataError(folder, f"dataset.{split}: dataset folder not found")
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            total.update(f"{path.relative_to(folder).as_posix()}\0{path.stat().st_size}\0".encode()
                         + _file_digest(path))
    return total.hexdigest()[:16]


def read_manifest(dataset_dir: str | Path) -> dict:
    path = Path(dataset_dir) / MANIFEST
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(path, "not a prepared data set (no dataset.json): run the prepare-data stage") from None
    except (OSError, ValueError) as exc:
        raise DataError(path, f"unreadable data set manifest: {exc}") from None


def spec_with_prepared_dataset(spec: ExperimentSpec, dataset_dir: str | Path,
                               manifest: dict | None = None) -> ExperimentSpec:
    """A copy of `spec` whose dataset.train/val point at the prepared data set."""
    manifest = manifest if manifest is not None else read_manifest(dataset_dir)
    paths = {}
    for split in ("train", "val"):
        where = manifest[split]
        paths[split] = where if "://" in where or Path(where).is_absolute() else str(Path(dataset_dir) / where)
    data = spec.to_dict()
    data["dataset"].update(paths)
    return type(spec).model_validate(data)
