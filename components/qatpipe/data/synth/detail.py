"""Two generated data sets whose classes only INTERNAL DETAIL tells apart (the shapes set's classes differ in
outline, size and aspect ratio, which a detector can use without learning what is inside an object).

- `glyphs`: ten digit classes (`zero` ... `nine`) printed on tiles of one outline (a rounded square of
  random colour, 20-60 px), slightly rotated, on the cluttered procedural backgrounds of the shapes set;
  tiles printed with letters are unlabelled distractors, so a detector must read the glyph even to say
  "object". `glyphs_shift` is the same but for its val split, printed in fonts the train split never shows.
- `photos`: ten texture classes (stripes in three directions, crosses, checker, dots, rings, grid, pinwheel,
  waves) filling discs or rounded squares (the outline is drawn at random, whatever the class) of 20-60 px,
  in two random colours at a random period and phase, on random crops of real photographs (the photos that
  scikit-image ships: astronaut, coffee, the cat, bricks, coins, a rocket, ...).

Objects never overlap (each image holds 1-4); sizes are log-uniform. Each generator has the signature of
`shapes.generate_shapes`, so `write_synthetic_dataset(kind=...)` (writer.py) writes them with the same
reproducible, parallel KITTI writer.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from qatpipe.data.synth.background import cluttered_background
from qatpipe.errors import QatpipeError

GLYPH_CLASSES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_GLYPHS = "0123456789"
# letters unlike any digit (no O, I, S, B, Z, G, Q, D): unlabelled look-alike tiles
_DISTRACTOR_GLYPHS = "ACEFHKLMNPRTUVWXY"
# No class is the mirror image of another: a horizontal flip (the default augmentation) keeps every class
TEXTURE_CLASSES = ("stripes_h", "stripes_v", "stripes_diag", "crosses", "checker", "dots", "rings", "grid",
                   "pinwheel", "waves")
# objects' box sides, pixels at a 192-px-high image (scaled with the height)
DETAIL_OBJECT_PX = (20.0, 60.0)
_SS = 3  # supersampling of the object renderers
_MAX_OBJECTS = 4
_PLACEMENT_TRIES = 20
# photos shipped inside scikit-image's wheel (skimage/data); grey ones are used as they are
_PHOTOS = ("astronaut", "brick", "camera", "chelsea", "coffee", "grass", "gravel", "rocket", "coins", "moon",
           "hubble_deep_field", "retina", "immunohistochemistry")


# ------------------------------------------------------------------------------------------ shared


def _sizes(rng: np.random.Generator, scale: float, object_px: tuple[float, float]) -> list[float]:
    lo, hi = (v * scale for v in object_px)
    n = int(rng.integers(1, _MAX_OBJECTS + 1))
    return sorted((math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(n)), reverse=True)


def _free_spot(rng, taken: list[tuple[float, float, float, float]], w: float, h: float, width: int,
               height: int, margin: float = 2.0):
    """Top-left corner of a w x h box inside the image that overlaps no box in `taken` (None if none found)."""
    for _ in range(_PLACEMENT_TRIES):
        x1, y1 = rng.uniform(0, width - w), rng.uniform(0, height - h)
        if all(x1 + w + margin <= a or b + margin <= x1 or y1 + h + margin <= c or d + margin <= y1
               for a, c, b, d in taken):
            return x1, y1
    return None


def _colour_pair(rng: np.random.Generator, min_distance: float = 120.0) -> tuple[np.ndarray, np.ndarray]:
    """Two random colours far enough apart to read a pattern or glyph drawn in one on the other."""
    first = rng.uniform(0, 255, 3)
    for _ in range(50):
        second = rng.uniform(0, 255, 3)
        if np.linalg.norm(first - second) >= min_distance:
            return first, second
    return first, 255.0 - first


def _composite(canvas: np.ndarray, rgba: np.ndarray, x1: float, y1: float) -> tuple[int, int, int, int]:
    """Alpha-blend an (h, w, 4) float image (alpha in [0, 1]) into `canvas` at integer-rounded (x1, y1);
    returns the box it covers (x1, y1, x2, y2), clipped to the canvas."""
    h, w = rgba.shape[:2]
    x, y = int(round(x1)), int(round(y1))
    region = canvas[y:y + h, x:x + w]
    patch = rgba[: region.shape[0], : region.shape[1]]
    alpha = patch[..., 3:4]
    region[...] = region * (1 - alpha) + patch[..., :3] * alpha
    return x, y, x + region.shape[1], y + region.shape[0]


def _downsample(big: np.ndarray) -> np.ndarray:
    """A supersampled RGBA object with premultiplied colour -> _SS times smaller, straight (unpremultiplied)."""
    h, w = big.shape[0] // _SS, big.shape[1] // _SS
    small = big[: h * _SS, : w * _SS].reshape(h, _SS, w, _SS, -1).mean(axis=(1, 3))
    alpha = small[..., 3:4]
    small[..., :3] = np.where(alpha > 0, small[..., :3] / np.maximum(alpha, 1e-6), 0)
    return small


def _finish(rng: np.random.Generator, canvas: np.ndarray) -> np.ndarray:
    canvas += rng.standard_normal(canvas.shape).astype(np.float32) * np.float32(rng.uniform(2.0, 7.0))
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def _label(cls: str, box: tuple[int, int, int, int]) -> dict:
    return {"class": cls, "box": tuple(float(v) for v in box), "occluded": 0, "truncated": 0.0}


# ------------------------------------------------------------------------------------------ glyphs


# fonts that matplotlib ships (already a dependency, for plots): `glyphs` prints in the first; the val split of
# `glyphs_shift` in the others, which its train split never shows (a style shift: serif, italic, monospace)
GLYPH_FONT = "DejaVuSans-Bold.ttf"
SHIFTED_GLYPH_FONTS = ("DejaVuSerif-BoldItalic.ttf", "STIXGeneralBol.ttf", "DejaVuSansMono-Oblique.ttf",
                       "cmss10.ttf")


@functools.lru_cache(maxsize=256)
def _font(size: int, name: str = GLYPH_FONT) -> ImageFont.FreeTypeFont:
    import matplotlib

    return ImageFont.truetype(f"{matplotlib.get_data_path()}/fonts/ttf/{name}", size)


def _tile(rng: np.random.Generator, glyph: str, w: float, h: float, fonts: tuple[str, ...] = (GLYPH_FONT,)
          ) -> np.ndarray:
    """A rounded tile of w x h px with `glyph` printed on it, slightly rotated: (H, W, 4) floats."""
    font_name = fonts[int(rng.integers(len(fonts)))] if len(fonts) > 1 else fonts[0]
    tile_colour, ink = _colour_pair(rng)
    big_w, big_h = int(round(w * _SS)), int(round(h * _SS))
    image = Image.new("RGBA", (big_w, big_h), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, big_w - 1, big_h - 1), radius=min(big_w, big_h) * rng.uniform(0.1, 0.3),
                           fill=(*(int(v) for v in tile_colour), 255))
    font = _font(max(6, int(min(big_w, big_h) * rng.uniform(0.6, 0.8))), font_name)
    glyph_layer = Image.new("RGBA", (big_w, big_h), (0, 0, 0, 0))
    ImageDraw.Draw(glyph_layer).text((big_w / 2 + rng.uniform(-0.05, 0.05) * big_w, big_h / 2), glyph,
                                     font=font, anchor="mm", fill=(*(int(v) for v in ink), 255))
    glyph_layer = glyph_layer.rotate(rng.uniform(-15, 15), resample=Image.BICUBIC, center=(big_w / 2, big_h / 2))
    image.alpha_composite(glyph_layer)
    # the tile's own alpha masks the rotated glyph to the tile
    rgba = np.asarray(image, np.float32)
    rgba[..., 3] /= 255.0
    rgba[..., :3] *= rgba[..., 3:4]  # premultiply, so the downsampled edges blend right
    return _downsample(rgba)


def generate_glyphs(rng: np.random.Generator, height: int, width: int,
                    object_px: tuple[float, float] = DETAIL_OBJECT_PX, fonts: tuple[str, ...] = (GLYPH_FONT,)
                    ) -> tuple[np.ndarray, list[dict]]:
    """One `glyphs` image: (uint8 HxWx3, labelled objects); its tiles printed in one of `fonts`."""
    scale = height / 192.0
    canvas = cluttered_background(rng, height, width, scale)  # the shapes set's backgrounds
    taken, objects = [], []
    sizes = [(s, True) for s in _sizes(rng, scale, object_px)]
    sizes += [(s, False) for s in _sizes(rng, scale, object_px)[: int(rng.integers(0, 3))]]  # 0-2 distractors
    for side, labelled in sizes:
        w, h = side * rng.uniform(0.85, 1.15), side * rng.uniform(0.85, 1.15)
        spot = _free_spot(rng, taken, w, h, width, height)
        if spot is None:
            continue
        k = int(rng.integers(len(GLYPH_CLASSES)))
        glyph = _GLYPHS[k] if labelled else _DISTRACTOR_GLYPHS[int(rng.integers(len(_DISTRACTOR_GLYPHS)))]
        box = _composite(canvas, _tile(rng, glyph, w, h, fonts), *spot)
        taken.append(box)
        if labelled:
            objects.append(_label(GLYPH_CLASSES[k], box))
    return _finish(rng, canvas), objects


# ------------------------------------------------------------------------------------------ photos


@functools.lru_cache(maxsize=None)
def _photo(name: str) -> np.ndarray:
    try:
        from skimage import data
    except ImportError:
        raise QatpipeError("the `photos` data set needs scikit-image (its bundled photos), a dependency of "
                           "qatpipe: reinstall qatpipe") from None
    image = np.asarray(getattr(data, name)(), np.float32)
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=2)
    image = image[..., :3]
    if image.max() <= 1.0:
        image = image * 255.0
    return image


def _photo_background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A random crop of a random bundled photo at a random scale, maybe mirrored, colour-jittered."""
    photo = _photo(_PHOTOS[int(rng.integers(len(_PHOTOS)))])
    ph, pw = photo.shape[:2]
    zoom = rng.uniform(1.0, 2.5)  # how much of the photo's short side the crop leaves out
    crop_h = min(ph, int(ph / zoom * min(1.0, (pw * height) / (ph * width))))
    crop_w = min(pw, int(crop_h * width / height))
    crop_h = int(crop_w * height / width)
    y, x = int(rng.integers(0, ph - crop_h + 1)), int(rng.integers(0, pw - crop_w + 1))
    crop = Image.fromarray(np.clip(photo[y:y + crop_h, x:x + crop_w], 0, 255).astype(np.uint8))
    canvas = np.asarray(crop.resize((width, height), Image.BILINEAR), np.float32).copy()
    if rng.random() < 0.5:
        canvas = canvas[:, ::-1].copy()
    return canvas * rng.uniform(0.75, 1.25, 3).astype(np.float32) + rng.uniform(-25, 25, 3).astype(np.float32)


def _crosses(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Plus signs on a grid, one per period."""
    a, b = np.mod(u, 2 * math.pi) - math.pi, np.mod(v, 2 * math.pi) - math.pi
    return ((np.abs(a) < 0.7) & (np.abs(b) < 2.3)) | ((np.abs(b) < 0.7) & (np.abs(a) < 2.3))


def _texture(k: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Class k's two-colour pattern (bool) on coordinates u, v measured in pattern periods (one period = 2 pi)."""
    r, theta = np.hypot(u, v), np.arctan2(v, u)
    patterns = (
        lambda: np.sin(v) > 0,  # stripes_h
        lambda: np.sin(u) > 0,  # stripes_v
        lambda: np.sin((u + v) / math.sqrt(2)) > 0,  # stripes_diag
        lambda: _crosses(u, v),
        lambda: np.sin(u) * np.sin(v) > 0,  # checker
        lambda: np.cos(u) + np.cos(v) > 1.0,  # dots
        lambda: np.sin(r) > 0,  # rings
        lambda: (np.abs(np.sin(u / 2)) < 0.35) | (np.abs(np.sin(v / 2)) < 0.35),  # grid
        lambda: np.sin(4 * theta) > 0,  # pinwheel
        lambda: np.sin(v + 1.6 * np.sin(u)) > 0,  # waves
    )
    return patterns[k]()


def _textured_object(rng: np.random.Generator, k: int, w: float, h: float) -> np.ndarray:
    """Class k's texture in a disc or rounded square of w x h px: (H, W, 4) floats."""
    big_w, big_h = int(round(w * _SS)), int(round(h * _SS))
    ys, xs = np.mgrid[0:big_h, 0:big_w].astype(np.float32)
    cx, cy = (big_w - 1) / 2, (big_h - 1) / 2
    nx, ny = (xs - cx) / (big_w / 2), (ys - cy) / (big_h / 2)  # -1..1 across the object
    if rng.random() < 0.5:
        inside = nx ** 2 + ny ** 2 <= 1.0
    else:
        corner = rng.uniform(0.2, 0.5)
        qx, qy = np.maximum(np.abs(nx) - (1 - corner), 0), np.maximum(np.abs(ny) - (1 - corner), 0)
        inside = qx ** 2 + qy ** 2 <= corner ** 2
    periods = rng.uniform(2.5, 4.0)  # pattern periods across the object: the period is no class cue
    angle = math.radians(rng.uniform(-12, 12))
    side = min(big_w, big_h)
    px, py = (xs - cx) / side * periods * 2 * math.pi, (ys - cy) / side * periods * 2 * math.pi
    u = px * math.cos(angle) - py * math.sin(angle) + rng.uniform(0, 2 * math.pi) * (k not in (6, 8))
    v = px * math.sin(angle) + py * math.cos(angle) + rng.uniform(0, 2 * math.pi) * (k not in (6, 8))
    first, second = _colour_pair(rng)
    rgb = np.where(_texture(k, u, v)[..., None], first, second)
    rgba = np.concatenate([rgb * inside[..., None], inside[..., None].astype(np.float32)], axis=-1)
    return _downsample(rgba)


def generate_photos(rng: np.random.Generator, height: int, width: int,
                    object_px: tuple[float, float] = DETAIL_OBJECT_PX) -> tuple[np.ndarray, list[dict]]:
    """One `photos` image: (uint8 HxWx3, labelled objects)."""
    canvas = _photo_background(rng, height, width)
    taken, objects = [], []
    for side in _sizes(rng, height / 192.0, object_px):
        w, h = side * rng.uniform(0.85, 1.15), side * rng.uniform(0.85, 1.15)
        spot = _free_spot(rng, taken, w, h, width, height)
        if spot is None:
            continue
        k = int(rng.integers(len(TEXTURE_CLASSES)))
        box = _composite(canvas, _textured_object(rng, k, w, h), *spot)
        taken.append(box)
        objects.append(_label(TEXTURE_CLASSES[k], box))
    return _finish(rng, canvas), objects
