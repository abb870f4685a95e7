"""The synthetic KITTI writer: one of the generated data sets (KINDS) to `{train,val}/{images,labels}`.

Every image is generated from its own `numpy` Generator seeded with (seed, split, index), so the output
is byte-identical for the same arguments, whatever the order or number of worker processes.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from qatpipe.data.synth import detail, night, shapes, traffic
from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

_SPLITS = (("train", 0), ("val", 1))
_JPEG_QUALITY = 92
_PROGRESS_EVERY = 500


@dataclass(frozen=True)
class _Job:
    kind: str
    split_dir: str
    split_id: int
    index: int
    seed: int
    height: int
    width: int
    object_height_px: tuple[float, float]


def write_synthetic_dataset(
    out_dir: str | Path,
    num_train: int,
    num_val: int,
    seed: int = 0,
    *,
    image_height: int = 192,
    image_width: int = 320,
    overwrite: bool = False,
    workers: int | None = None,
    object_height_px: tuple[float, float] | None = None,
    kind: str = "shapes",
) -> dict:
    """Write a synthetic KITTI dataset to `out_dir/{train,val}/{images,labels}` and `out_dir/classes.txt`.

    Refuses (QatpipeError) to replace a non-empty `train`/`val` folder unless `overwrite`. Each split is
    written to a temporary sibling folder and renamed into place when complete. `workers` is the number
    of processes (default: up to 2 for large sets); it does not change the output. `object_height_px` is the
    (min, max) object box height at a 192-px-high image (default: the kind's; the box side for glyphs and photos,
    the box width for traffic); sizes are drawn log-uniformly (traffic's tilted to larger) and scaled with the
    height. `kind` picks the data set (KINDS): `shapes` (shapes.py), `glyphs` and `photos`, whose classes
    differ only in internal detail (detail.py), `traffic`, crowded street scenes of ten imbalanced classes
    (traffic.py), or `traffic_night`, the same scenes at night (night.py).

    Returns {"out_dir", "classes", "image_height", "image_width", "seed", "splits": {split: {"images",
    "objects", "empty_images", "per_class", "occluded", "truncated"}}, "per_class", "seconds"}.
    """
    start = time.perf_counter()
    if kind not in KINDS:
        raise QatpipeError(f"synthetic dataset: unknown kind {kind!r}; one of {', '.join(KINDS)}")
    classes = KINDS[kind].classes
    object_height_px = object_height_px or KINDS[kind].object_px
    out = Path(out_dir)
    counts = {"train": int(num_train), "val": int(num_val)}
    for name, n in counts.items():
        if n < 0:
            raise QatpipeError(f"synthetic dataset: num_{name} must be >= 0, got {n}")
    lo, hi = object_height_px
    if not 4 <= lo <= hi:
        raise QatpipeError(f"synthetic dataset: object_height_px must satisfy 4 <= min <= max, got {object_height_px}")
    if image_height < 32 or image_width < 32:
        raise QatpipeError(f"synthetic dataset: image size {image_width}x{image_height} is too small (min 32x32)")

    # Check both splits before writing anything, so a refusal never leaves half a dataset behind.
    for name, _ in _SPLITS:
        target = out / name
        if _is_nonempty(target) and not overwrite:
            raise QatpipeError(
                f"synthetic dataset: {target} exists and is not empty; "
                "choose another folder or pass overwrite=True to replace it"
            )
    out.mkdir(parents=True, exist_ok=True)

    if workers is None:
        workers = min(2, os.cpu_count() or 1) if num_train + num_val >= 64 else 1
    workers = max(1, int(workers))

    summary: dict = {
        "out_dir": str(out),
        "kind": kind,
        "classes": list(classes),
        "image_height": int(image_height),
        "image_width": int(image_width),
        "seed": int(seed),
        "splits": {},
    }
    pool = _make_pool(workers) if workers > 1 else None
    try:
        for name, split_id in _SPLITS:
            summary["splits"][name] = _write_split(
                kind, out, name, split_id, counts[name], seed, image_height, image_width, overwrite, pool,
                (float(lo), float(hi)),
            )
    finally:
        if pool is not None:
            pool.close()
            pool.join()

    classes_tmp = out / ".classes.txt.partial"
    classes_tmp.write_text("".join(f"{c}\n" for c in classes))
    os.replace(classes_tmp, out / "classes.txt")

    summary["per_class"] = {
        c: sum(s["per_class"][c] for s in summary["splits"].values()) for c in classes
    }
    summary["seconds"] = round(time.perf_counter() - start, 3)
    log.info(
        "synthetic dataset in %s: %s in %.1f s",
        out,
        ", ".join(f"{n}={s['images']} images/{s['objects']} objects" for n, s in summary["splits"].items()),
        summary["seconds"],
    )
    return summary


# --------------------------------------------------------------------------------------------------
# Splits and files
# --------------------------------------------------------------------------------------------------


def _is_nonempty(path: Path) -> bool:
    if path.is_dir():
        return any(path.iterdir())
    return path.exists() or path.is_symlink()


def _make_pool(workers: int):
    # fork is cheap and needs no re-import of the caller's __main__; the workers use numpy and PIL only.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    return ctx.Pool(workers)


def _write_split(
    kind: str, out: Path, name: str, split_id: int, count: int, seed: int, height: int, width: int, overwrite: bool, pool,
    object_height_px: tuple[float, float],
) -> dict:
    target = out / name
    tmp = out / f".{name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "images").mkdir(parents=True)
    (tmp / "labels").mkdir(parents=True)

    jobs = [_Job(kind, str(tmp), split_id, i, int(seed), int(height), int(width), object_height_px) for i in range(count)]
    stats = {
        "images": count,
        "objects": 0,
        "empty_images": 0,
        "per_class": {c: 0 for c in KINDS[kind].classes},
        "occluded": 0,
        "truncated": 0,
    }
    results = pool.imap(_generate_and_write, jobs, chunksize=16) if pool is not None else map(_generate_and_write, jobs)
    for done, objects in enumerate(results, start=1):
        stats["objects"] += len(objects)
        stats["empty_images"] += not objects
        for cls, occluded, truncated in objects:
            stats["per_class"][cls] += 1
            stats["occluded"] += occluded > 0
            stats["truncated"] += truncated > 0
        if done % _PROGRESS_EVERY == 0 or done == count:
            log.info("synthetic %s: %d/%d images", name, done, count)

    if target.is_dir() and not target.is_symlink():
        if any(target.iterdir()):
            if not overwrite:  # appeared while we were generating
                shutil.rmtree(tmp)
                raise QatpipeError(f"synthetic dataset: {target} exists and is not empty")
            shutil.rmtree(target)
        else:
            target.rmdir()
    elif target.exists() or target.is_symlink():
        if not overwrite:
            shutil.rmtree(tmp)
            raise QatpipeError(f"synthetic dataset: {target} exists and is not a folder")
        target.unlink()
    os.replace(tmp, target)
    return stats


def _generate_and_write(job: _Job) -> list[tuple[str, int, float]]:
    rng = np.random.default_rng([job.seed, job.split_id, job.index])
    kind = KINDS[job.kind]
    generate = kind.generate_val if job.split_id == 1 and kind.generate_val else kind.generate
    image, objects = generate(rng, job.height, job.width, job.object_height_px)
    buf = BytesIO()
    Image.fromarray(image, "RGB").save(buf, "JPEG", quality=_JPEG_QUALITY)
    stem = f"{job.index:06d}"
    Path(job.split_dir, "images", f"{stem}.jpg").write_bytes(buf.getvalue())
    Path(job.split_dir, "labels", f"{stem}.txt").write_text("".join(_label_line(o) for o in objects))
    return [(o["class"], o["occluded"], o["truncated"]) for o in objects]


def _label_line(obj: dict) -> str:
    x1, y1, x2, y2 = obj["box"]
    return (
        f"{obj['class']} {obj['truncated']:.2f} {obj['occluded']:d} 0.00 "
        f"{x1:.2f} {y1:.2f} {x2:.2f} {y2:.2f} 0.00 0.00 0.00 0.00 0.00 0.00 0.00\n"
    )


# --------------------------------------------------------------------------------------------------
# The data sets this writer makes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticKind:
    classes: tuple[str, ...]
    generate: Callable  # (rng, height, width, object_px) -> (uint8 HxWx3 image, objects)
    object_px: tuple[float, float]  # default (min, max) object size at a 192-px-high image
    generate_val: Callable | None = None  # the val split's, when it differs from train's (a style shift)


KINDS = {
    "shapes": SyntheticKind(shapes.SYNTH_CLASSES, shapes.generate_shapes, shapes.DEFAULT_OBJECT_HEIGHT_PX),
    "glyphs": SyntheticKind(detail.GLYPH_CLASSES, detail.generate_glyphs, detail.DETAIL_OBJECT_PX),
    "glyphs_shift": SyntheticKind(detail.GLYPH_CLASSES, detail.generate_glyphs, detail.DETAIL_OBJECT_PX,
                                  functools.partial(detail.generate_glyphs, fonts=detail.SHIFTED_GLYPH_FONTS)),
    "photos": SyntheticKind(detail.TEXTURE_CLASSES, detail.generate_photos, detail.DETAIL_OBJECT_PX),
    "traffic": SyntheticKind(traffic.TRAFFIC_CLASSES, traffic.generate_traffic, traffic.TRAFFIC_OBJECT_PX),
    "traffic_night": SyntheticKind(traffic.TRAFFIC_CLASSES, night.generate_traffic_night, traffic.TRAFFIC_OBJECT_PX),
}
