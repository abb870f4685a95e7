"""Synthetic KITTI detection dataset: the embedded default data of the main job.

Three classes that only their SHAPE tells apart (colours are drawn from one distribution for all of
them): a wide `car` with a cabin and two dark wheels, a tall `pedestrian` with head, torso, arms and
legs, and a `cyclist` with two ring wheels, a frame and a rider. Objects of 18-100 px (at 192 px image
height) are drawn back-to-front over textured, noisy backgrounds with distractor strokes and blobs; the
generator tracks every object's visible pixels to set KITTI's `occluded` and refuses placements that
would hide more than half of an object already placed, so every labelled object stays recognisable.
Some objects are cut by the image border (`truncated`).

Every image is generated from its own `numpy` Generator seeded with (seed, split, index), so the output
is byte-identical for the same arguments, whatever the order or number of worker processes.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from typing import Callable
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

SYNTH_CLASSES = ("car", "pedestrian", "cyclist")

_SPLITS = (("train", 0), ("val", 1))
_SS = 2  # supersampling factor of the object renderer (anti-aliased edges, half-pixel boxes)
_JPEG_QUALITY = 92
_MIN_BOX_PX = 6.0  # objects whose clipped box is smaller than this in either dimension are dropped
_MAX_HIDDEN = 0.5  # a placement may not leave an earlier object with more than this fraction hidden
_TRUNCATE_PROB = 0.1
_MAX_TRUNCATION = 0.3
_EMPTY_IMAGE_PROB = 0.01
_PLACEMENT_TRIES = 10
_PROGRESS_EVERY = 500
# Object box heights (pixels at a 192-px-high image, scaled with the height). Below ~24 px a pedestrian is
# under 8 px wide, narrower than half a cell of DetectNet_v2's stride-16 grid: too small to localise.
DEFAULT_OBJECT_HEIGHT_PX = (24.0, 100.0)

# Part ids in an object's part map; each object picks one colour per part.
_BG, _PRIMARY, _SECONDARY, _HEAD, _TIRE, _HUB, _GLASS, _FRAME = range(8)
_NUM_PARTS = 8


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


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


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
    (min, max) object box height at a 192-px-high image (default: the kind's); sizes are drawn log-uniformly
    and scaled with the height. `kind` picks the data set (KINDS): `shapes` (this module), or `glyphs` and
    `photos`, whose classes differ only in internal detail (data/synth_detail.py).

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
    image, objects = KINDS[job.kind].generate(rng, job.height, job.width, job.object_height_px)
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
# One image
# --------------------------------------------------------------------------------------------------


def _generate_image(
    rng: np.random.Generator, height: int, width: int, object_height_px: tuple[float, float] = DEFAULT_OBJECT_HEIGHT_PX
) -> tuple[np.ndarray, list[dict]]:
    """Returns (uint8 HxWx3 image, objects back-to-front with class/box/occluded/truncated)."""
    scale = height / 192.0
    canvas = _background(rng, height, width, scale)
    owner = np.zeros((height, width), np.int16)  # 0 = background, k = k-th placed object (1-based)
    placed: list[dict] = []

    n_objects = 0 if rng.random() < _EMPTY_IMAGE_PROB else int(rng.integers(1, 7))
    plans = []
    for _ in range(n_objects):
        cls = SYNTH_CLASSES[int(rng.integers(len(SYNTH_CLASSES)))]
        lo, hi = object_height_px
        box_h = math.exp(rng.uniform(math.log(lo * scale), math.log(hi * scale)))
        plans.append((box_h, cls))
    plans.sort(key=lambda p: p[0])  # far (small) objects first: drawn back-to-front

    for box_h, cls in plans:
        obj = _place_object(rng, canvas, owner, placed, cls, box_h, height, width, scale)
        if obj is not None:
            placed.append(obj)

    noise_sigma = rng.uniform(3.0, 9.0)
    canvas += rng.standard_normal(canvas.shape, dtype=np.float32) * np.float32(noise_sigma)
    image = np.clip(np.rint(canvas), 0, 255).astype(np.uint8)

    objects = []
    for obj in placed:
        hidden = 1.0 - obj["visible"] / obj["full"]
        occluded = 0 if hidden < 0.1 else 1 if hidden < 0.5 else 2
        objects.append(
            {"class": obj["class"], "box": obj["box"], "occluded": occluded, "truncated": obj["truncated"]}
        )
    return image, objects


def _background(rng: np.random.Generator, height: int, width: int, scale: float) -> np.ndarray:
    """Low-frequency gradients, sinusoids, a soft horizon and value-noise texture, then distractors."""
    yy = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    xx = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    base = rng.uniform(60.0, 200.0, 3).astype(np.float32)
    gx = rng.uniform(-70.0, 70.0, 3).astype(np.float32)
    gy = rng.uniform(-70.0, 70.0, 3).astype(np.float32)
    img = base + (xx - 0.5) * gx + (yy - 0.5) * gy
    if rng.random() < 0.5:  # sky/ground-like split with a soft edge
        y0 = rng.uniform(0.25, 0.75)
        softness = rng.uniform(0.01, 0.08)
        step = 1.0 / (1.0 + np.exp(-(yy - y0) / softness))
        img = img + step * rng.uniform(-60.0, 60.0, 3).astype(np.float32)
    for _ in range(int(rng.integers(2, 5))):
        fx, fy = rng.uniform(-4.0, 4.0, 2)
        phase = rng.uniform(0.0, 2.0 * math.pi)
        wave = np.sin(2.0 * math.pi * (fx * xx + fy * yy) + phase)
        img = img + wave * rng.uniform(4.0, 22.0, 3).astype(np.float32)
    # Value noise at a medium scale: blotchy texture.
    for cells, amp in ((rng.integers(8, 20), rng.uniform(6.0, 16.0)), (rng.integers(25, 50), rng.uniform(3.0, 9.0))):
        gh = max(2, int(cells * height / width))
        small = rng.standard_normal((3, gh, int(cells))).astype(np.float32) * np.float32(amp)
        up = [np.asarray(Image.fromarray(c, "F").resize((width, height), Image.BICUBIC)) for c in small]
        img = img + np.stack(up, axis=-1)
    img = np.broadcast_to(img, (height, width, 3))

    pil = Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(pil)
    _distractors(rng, draw, height, width, scale)
    return np.asarray(pil, dtype=np.float32).copy()


def _distractors(rng: np.random.Generator, draw: ImageDraw.ImageDraw, height: int, width: int, scale: float) -> None:
    """Strokes (straight or zig-zag lines) and small irregular blobs: nothing car/person/bike-like."""
    for _ in range(int(rng.integers(2, 8))):
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        x, y = rng.uniform(0, width), rng.uniform(0, height)
        points = [(x, y)]
        angle = rng.uniform(0, 2 * math.pi)
        for _ in range(int(rng.integers(1, 4))):
            length = rng.uniform(10.0, 90.0) * scale
            angle += rng.uniform(-1.2, 1.2)
            x, y = x + length * math.cos(angle), y + length * math.sin(angle)
            points.append((x, y))
        draw.line(points, fill=colour, width=max(1, int(round(rng.uniform(1.0, 3.0) * scale))), joint="curve")
    for _ in range(int(rng.integers(2, 9))):
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        radius = rng.uniform(2.0, 7.0) * scale
        n = int(rng.integers(4, 8))
        angles = np.sort(rng.uniform(0, 2 * math.pi, n))
        radii = radius * rng.uniform(0.4, 1.2, n)
        draw.polygon(
            [(cx + r * math.cos(a), cy + r * math.sin(a)) for a, r in zip(angles, radii)], fill=colour
        )


# --------------------------------------------------------------------------------------------------
# Objects
# --------------------------------------------------------------------------------------------------


def _place_object(
    rng: np.random.Generator,
    canvas: np.ndarray,
    owner: np.ndarray,
    placed: list[dict],
    cls: str,
    box_h: float,
    height: int,
    width: int,
    scale: float,
) -> dict | None:
    aspect = {"car": (1.6, 2.6), "pedestrian": (0.3, 0.5), "cyclist": (0.9, 1.4)}[cls]
    box_w = box_h * rng.uniform(*aspect)
    if box_w > 0.85 * width:  # very large cars: shrink both sides
        box_h *= 0.85 * width / box_w
        box_w = 0.85 * width
    if cls == "pedestrian":
        box_w = max(box_w, 7.0)

    parts = _render_parts(rng, cls, box_w, box_h)  # (ch*SS, cw*SS) uint8 part ids
    ssh, ssw = parts.shape
    ch, cw = ssh // _SS, ssw // _SS
    drawn = parts > 0
    rows = np.flatnonzero(drawn.any(axis=1))
    cols = np.flatnonzero(drawn.any(axis=0))
    # Tight box of the drawn extent in canvas pixels (half-pixel resolution with SS=2).
    lx1, lx2 = cols[0] / _SS, (cols[-1] + 1) / _SS
    ly1, ly2 = rows[0] / _SS, (rows[-1] + 1) / _SS
    alpha = drawn.reshape(ch, _SS, cw, _SS).mean(axis=(1, 3), dtype=np.float32)
    solid = alpha >= 0.5  # the object's pixels, for occlusion bookkeeping
    total_ss = int(drawn.sum())

    truncate = rng.random() < _TRUNCATE_PROB
    for _ in range(_PLACEMENT_TRIES):
        ox, oy = _choose_origin(rng, truncate, lx1, ly1, lx2, ly2, height, width)
        x1, y1 = max(0.0, ox + lx1), max(0.0, oy + ly1)
        x2, y2 = min(float(width), ox + lx2), min(float(height), oy + ly2)
        if x2 - x1 < _MIN_BOX_PX or y2 - y1 < _MIN_BOX_PX:
            continue
        # Intersection of the object canvas with the image.
        ix0, iy0 = max(0, ox), max(0, oy)
        ix1, iy1 = min(width, ox + cw), min(height, oy + ch)
        cx0, cy0 = ix0 - ox, iy0 - oy
        cx1, cy1 = cx0 + (ix1 - ix0), cy0 + (iy1 - iy0)
        mask = solid[cy0:cy1, cx0:cx1]
        full = int(mask.sum())
        if full < 8:
            continue
        inside_ss = int(drawn[cy0 * _SS : cy1 * _SS, cx0 * _SS : cx1 * _SS].sum())
        truncated = 1.0 - inside_ss / total_ss
        if truncated > _MAX_TRUNCATION + 0.1:
            continue
        region_owner = owner[iy0:iy1, ix0:ix1]
        if placed:
            newly_hidden = np.bincount(region_owner[mask], minlength=len(placed) + 1)[1:]
            if any(
                (o["visible"] - h) < (1.0 - _MAX_HIDDEN) * o["full"] for o, h in zip(placed, newly_hidden) if h
            ):
                continue
        else:
            newly_hidden = ()
        break
    else:
        return None

    for o, h in zip(placed, newly_hidden):
        o["visible"] -= int(h)
    region_owner[mask] = len(placed) + 1

    # Colours: contrast with what is under the object now (background and earlier objects).
    region = canvas[iy0:iy1, ix0:ix1]
    under = region[mask].mean(axis=0) if full else region.reshape(-1, 3).mean(axis=0)
    palette = _palette(rng, under)
    colour = palette[parts].reshape(ch, _SS, cw, _SS, 3).mean(axis=(1, 3))  # premultiplied
    a = alpha[cy0:cy1, cx0:cx1, None]
    region *= 1.0 - a
    region += colour[cy0:cy1, cx0:cx1]

    trunc = round(truncated, 2) if truncated >= 0.005 else 0.0
    return {
        "class": cls,
        "box": (x1, y1, x2, y2),
        "full": full,
        "visible": full,
        "truncated": trunc,
    }


def _choose_origin(rng, truncate, lx1, ly1, lx2, ly2, height, width) -> tuple[int, int]:
    """Integer canvas origin so the object box lies inside the image, or sticks out of one border."""
    bw, bh = lx2 - lx1, ly2 - ly1

    def inside(lo, hi, limit):  # origin range keeping [lo, hi] within [0, limit]
        a, b = math.ceil(-lo), math.floor(limit - hi)
        return int(rng.integers(a, b + 1)) if b >= a else int(round((limit - lo - hi) / 2))

    ox, oy = inside(lx1, lx2, width), inside(ly1, ly2, height)
    if truncate:
        frac = rng.uniform(0.08, _MAX_TRUNCATION)
        side = int(rng.integers(4))
        if side == 0:
            ox = int(round(-frac * bw - lx1))
        elif side == 1:
            ox = int(round(width + frac * bw - lx2))
        elif side == 2:
            oy = int(round(-frac * bh - ly1))
        else:
            oy = int(round(height + frac * bh - ly2))
    return ox, oy


def _lum(c: np.ndarray) -> float:
    return float(0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2])


def _contrasting(rng: np.random.Generator, ref: np.ndarray, min_dist: float = 110.0, min_lum: float = 35.0):
    best, best_score = None, -1.0
    for _ in range(16):
        c = rng.uniform(0.0, 255.0, 3)
        dist, dlum = float(np.linalg.norm(c - ref)), abs(_lum(c) - _lum(ref))
        if dist >= min_dist and dlum >= min_lum:
            return c
        score = min(dist / min_dist, dlum / min_lum)
        if score > best_score:
            best, best_score = c, score
    # Fall back: push the best candidate's brightness away from the reference.
    shift = 80.0 if _lum(ref) < 128 else -80.0
    return np.clip(best + shift, 0.0, 255.0)


def _palette(rng: np.random.Generator, under: np.ndarray) -> np.ndarray:
    """One colour per part id. Same distribution for every class, so colour never tells the class."""
    pal = np.zeros((_NUM_PARTS, 3), np.float32)
    primary = _contrasting(rng, under)
    pal[_PRIMARY] = primary
    pal[_SECONDARY] = _contrasting(rng, under)
    pal[_HEAD] = _contrasting(rng, under)
    pal[_FRAME] = _contrasting(rng, under)
    if _lum(under) >= 85.0:  # dark tyres, unless the ground under them is dark too
        pal[_TIRE] = rng.uniform(12.0, 45.0) + rng.uniform(-6.0, 6.0, 3)
    else:
        pal[_TIRE] = rng.uniform(150.0, 200.0) + rng.uniform(-6.0, 6.0, 3)
    pal[_HUB] = rng.uniform(150.0, 225.0) + rng.uniform(-8.0, 8.0, 3)
    if _lum(primary) > 110.0:  # glass contrasts with the body
        pal[_GLASS] = rng.uniform(25.0, 70.0) + np.array([0.0, 5.0, 15.0]) + rng.uniform(-8.0, 8.0, 3)
    else:
        pal[_GLASS] = rng.uniform(170.0, 225.0) + np.array([-10.0, 0.0, 10.0]) + rng.uniform(-8.0, 8.0, 3)
    return np.clip(pal, 0.0, 255.0)


class _Pen:
    """Draws part ids into a supersampled canvas; object-local coordinates in SS units, optional mirror."""

    def __init__(self, draw: ImageDraw.ImageDraw, dx: float, dy: float, w: float, flip: bool):
        self.draw, self.dx, self.dy, self.w, self.flip = draw, dx, dy, w, flip

    def p(self, x: float, y: float) -> tuple[float, float]:
        return (self.dx + (self.w - x if self.flip else x), self.dy + y)

    def circle(self, x, y, r, part, outline_width: int = 0):
        cx, cy = self.p(x, y)
        bbox = [cx - r, cy - r, cx + r, cy + r]
        if outline_width:
            self.draw.ellipse(bbox, outline=part, width=outline_width)
        else:
            self.draw.ellipse(bbox, fill=part)

    def polygon(self, points, part):
        self.draw.polygon([self.p(x, y) for x, y in points], fill=part)

    def rrect(self, x0, y0, x1, y1, radius, part):
        (a, b), (c, d) = self.p(x0, y0), self.p(x1, y1)
        self.draw.rounded_rectangle([min(a, c), b, max(a, c), d], radius=radius, fill=part)

    def limb(self, a, b, width, part):
        """Thick line with round caps; the caps stay inside the segment's endpoints' discs."""
        wi = max(1, int(round(width)))
        self.draw.line([self.p(*a), self.p(*b)], fill=part, width=wi)
        if wi >= 3:
            for x, y in (a, b):
                self.circle(x, y, wi / 2.0 - 0.5, part)

    def line(self, points, width, part):
        self.draw.line([self.p(x, y) for x, y in points], fill=part, width=max(1, int(round(width))))


def _render_parts(rng: np.random.Generator, cls: str, box_w: float, box_h: float) -> np.ndarray:
    """Part-id map of one object at SS resolution, with a random sub-pixel offset and a 1-px margin."""
    off_x, off_y = rng.uniform(1.0, 2.0, 2)
    cw = int(math.ceil(off_x + box_w)) + 2
    ch = int(math.ceil(off_y + box_h)) + 2
    img = Image.new("L", (cw * _SS, ch * _SS), 0)
    pen = _Pen(ImageDraw.Draw(img), off_x * _SS, off_y * _SS, box_w * _SS, bool(rng.random() < 0.5))
    w, h = box_w * _SS, box_h * _SS
    {"car": _draw_car, "pedestrian": _draw_pedestrian, "cyclist": _draw_cyclist}[cls](rng, pen, w, h)
    return np.asarray(img)


def _draw_car(rng: np.random.Generator, pen: _Pen, w: float, h: float) -> None:
    u = rng.uniform
    r = min(u(0.17, 0.23) * h, 0.15 * w)
    body_top = u(0.33, 0.46) * h
    body_bot = h - r * u(0.5, 0.9)
    rear_x = max(u(0.15, 0.24) * w, r + 0.04 * w)
    front_x = w - max(u(0.15, 0.24) * w, r + 0.04 * w)
    # Cabin: trapezoid on the body; its proportions make sedans, hatchbacks and vans.
    a, b = u(0.06, 0.26) * w, u(0.66, 0.9) * w
    ta, tb = a + u(0.02, 0.16) * w, b - u(0.08, 0.22) * w
    if tb - ta < 0.18 * w:
        mid = (ta + tb) / 2
        ta, tb = mid - 0.09 * w, mid + 0.09 * w
    cabin_bot = body_top + 0.06 * h
    pen.polygon([(a, cabin_bot), (ta, 0.0), (tb, 0.0), (b, cabin_bot)], _PRIMARY)
    pen.rrect(0.0, body_top, w, body_bot, u(0.12, 0.35) * (body_bot - body_top), _PRIMARY)
    # Windows, split by a pillar.
    inset = max(0.1 * h, 1.2 * _SS)
    wy0, wy1 = inset, body_top - 0.02 * h
    if wy1 - wy0 > 1.5 * _SS:
        slope_a = (ta - a) / cabin_bot
        slope_b = (b - tb) / cabin_bot
        xa0, xa1 = ta - slope_a * wy0 + inset * 0.8, a + slope_a * (cabin_bot - wy1) + inset * 0.8
        xb0, xb1 = tb + slope_b * wy0 - inset * 0.8, b - slope_b * (cabin_bot - wy1) - inset * 0.8
        if min(xb0 - xa0, xb1 - xa1) > 2 * _SS:
            pen.polygon([(xa1, wy1), (xa0, wy0), (xb0, wy0), (xb1, wy1)], _GLASS)
            pillar = xa0 + (xb0 - xa0) * u(0.45, 0.62)
            pen.line([(pillar, wy0 - 1), (pillar, wy1 + 1)], max(_SS, 0.025 * w), _PRIMARY)
    # Head light and tail light.
    light_r = max(0.05 * h, 0.6 * _SS)
    ly = body_top + 0.3 * (body_bot - body_top)
    pen.circle(w - light_r * 1.6, ly, light_r, _HUB)
    # Wheels: dark tyres with light hubs.
    for x in (rear_x, front_x):
        pen.circle(x, h - r, r, _TIRE)
        pen.circle(x, h - r, r * u(0.35, 0.55), _HUB)


def _draw_pedestrian(rng: np.random.Generator, pen: _Pen, w: float, h: float) -> None:
    u = rng.uniform
    rh = min(u(0.075, 0.095) * h, 0.45 * w)
    cx = w / 2 + u(-0.05, 0.05) * w
    torso_w = u(0.55, 0.8) * w
    torso_top = 2 * rh * 0.92
    torso_bot = u(0.55, 0.62) * h
    leg_w = u(0.2, 0.28) * w
    # Legs (behind the torso): hips to feet; stride varies from standing to walking.
    hip_y = torso_bot - 0.05 * h
    half = leg_w / 2
    for side in (-1, 1):
        foot_x = cx + side * u(0.0, 0.35) * w
        foot_x = min(max(foot_x, half), w - half)
        pen.limb((cx + side * torso_w * 0.2, hip_y), (foot_x, h - half), leg_w, _SECONDARY)
    pen.rrect(cx - torso_w / 2, torso_top, cx + torso_w / 2, torso_bot, torso_w * 0.45, _PRIMARY)
    arm_w = max(u(0.13, 0.2) * w, _SS)
    for side in (-1, 1):
        hand_x = cx + side * u(0.22, 0.45) * w
        hand_x = min(max(hand_x, arm_w / 2), w - arm_w / 2)
        shoulder = (cx + side * torso_w * 0.35, torso_top + 0.04 * h)
        pen.limb(shoulder, (hand_x, torso_top + u(0.27, 0.34) * h), arm_w, _PRIMARY)
    pen.circle(cx, rh, rh, _HEAD)


def _draw_cyclist(rng: np.random.Generator, pen: _Pen, w: float, h: float) -> None:
    u = rng.uniform
    r = u(0.2, 0.235) * w
    hub_y = h - r
    rear, front = (r, hub_y), (w - r, hub_y)
    tyre_w = max(int(round(max(1.2 * _SS, u(0.13, 0.2) * r))), 1)
    frame_w = max(0.035 * h, 0.8 * _SS)
    limb_w = max(0.075 * h, 1.0 * _SS)
    bb = (w * u(0.44, 0.5), hub_y + u(0.0, 0.1) * r)
    seat = (w * u(0.33, 0.4), hub_y - u(0.95, 1.2) * r)
    top = (w * u(0.66, 0.72), seat[1] + 0.05 * r)
    fork_top = (top[0] + 0.03 * w, top[1] + 0.35 * (hub_y - top[1]))
    bar = (top[0] - 0.02 * w, top[1] - u(0.1, 0.3) * r)
    grip = (bar[0] - u(0.02, 0.07) * w, bar[1])
    rh = u(0.07, 0.09) * h
    head = (w * u(0.52, 0.62), rh)
    shoulder = (head[0] - u(0.0, 0.07) * w, 2 * rh + 0.04 * h)
    hip = (seat[0] + 0.02 * w, seat[1] - 0.05 * r)
    crank = 0.35 * r
    theta = u(0.0, 2 * math.pi)

    def leg(pedal_angle: float) -> None:
        pedal = (bb[0] + crank * math.cos(pedal_angle), bb[1] + crank * math.sin(pedal_angle))
        dxl, dyl = pedal[0] - hip[0], pedal[1] - hip[1]
        d = math.hypot(dxl, dyl)
        seg = 0.55 * (math.hypot(bb[0] - hip[0], bb[1] - hip[1]) + crank)
        bend = math.sqrt(max(0.0, seg * seg - (d / 2) ** 2))
        nx, ny = -dyl / d, dxl / d  # perpendicular; knee goes forward (+x)
        if nx < 0:
            nx, ny = -nx, -ny
        knee = (hip[0] + dxl / 2 + nx * bend, hip[1] + dyl / 2 + ny * bend)
        pen.limb(hip, knee, limb_w, _SECONDARY)
        pen.limb(knee, pedal, limb_w * 0.85, _SECONDARY)

    leg(theta + math.pi)  # far leg, behind the bike
    for x, y in (rear, front):
        pen.circle(x, y, r - tyre_w / 2, _TIRE, outline_width=tyre_w)
        pen.circle(x, y, max(0.12 * r, 0.6 * _SS), _TIRE)
    pen.line([rear, seat, bb, rear], frame_w, _FRAME)
    pen.line([seat, top, fork_top, bb], frame_w, _FRAME)
    pen.line([fork_top, front], frame_w, _FRAME)
    pen.line([top, bar, grip], frame_w, _FRAME)
    leg(theta)  # near leg
    pen.limb(hip, shoulder, u(0.11, 0.15) * h, _PRIMARY)
    pen.limb(shoulder, grip, limb_w * 0.9, _PRIMARY)
    pen.circle(head[0], head[1], rh, _HEAD)


# --------------------------------------------------------------------------------------------------
# The data sets this writer makes
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticKind:
    classes: tuple[str, ...]
    generate: Callable  # (rng, height, width, object_px) -> (uint8 HxWx3 image, objects)
    object_px: tuple[float, float]  # default (min, max) object size at a 192-px-high image


def _kinds() -> dict[str, SyntheticKind]:
    from qatpipe.data import synth_detail as detail

    return {
        "shapes": SyntheticKind(SYNTH_CLASSES, _generate_image, DEFAULT_OBJECT_HEIGHT_PX),
        "glyphs": SyntheticKind(detail.GLYPH_CLASSES, detail.generate_glyphs, detail.DETAIL_OBJECT_PX),
        "photos": SyntheticKind(detail.TEXTURE_CLASSES, detail.generate_photos, detail.DETAIL_OBJECT_PX),
    }


KINDS = _kinds()
