"""The `shapes` data set, the embedded default data of the main job.

Three classes that only their SHAPE tells apart (colours are drawn from one distribution for all of
them): a wide `car` with a cabin and two dark wheels, a tall `pedestrian` with head, torso, arms and
legs, and a `cyclist` with two ring wheels, a frame and a rider. Objects of 18-100 px (at 192 px image
height) are drawn back-to-front over textured, noisy backgrounds with distractor strokes and blobs; the
generator tracks every object's visible pixels to set KITTI's `occluded` and refuses placements that
would hide more than half of an object already placed, so every labelled object stays recognisable.
Some objects are cut by the image border (`truncated`).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from qatpipe.data.synth.background import cluttered_background

SYNTH_CLASSES = ("car", "pedestrian", "cyclist")

_SS = 2  # supersampling factor of the object renderer (anti-aliased edges, half-pixel boxes)
_MIN_BOX_PX = 6.0  # objects whose clipped box is smaller than this in either dimension are dropped
_MAX_HIDDEN = 0.5  # a placement may not leave an earlier object with more than this fraction hidden
_TRUNCATE_PROB = 0.1
_MAX_TRUNCATION = 0.3
_EMPTY_IMAGE_PROB = 0.01
_PLACEMENT_TRIES = 10
# Object box heights (pixels at a 192-px-high image, scaled with the height). Below ~24 px a pedestrian is
# under 8 px wide, narrower than half a cell of DetectNet_v2's stride-16 grid: too small to localise.
DEFAULT_OBJECT_HEIGHT_PX = (24.0, 100.0)

# Part ids in an object's part map; each object picks one colour per part.
_BG, _PRIMARY, _SECONDARY, _HEAD, _TIRE, _HUB, _GLASS, _FRAME = range(8)
_NUM_PARTS = 8


# --------------------------------------------------------------------------------------------------
# One image
# --------------------------------------------------------------------------------------------------


def generate_shapes(
    rng: np.random.Generator, height: int, width: int, object_height_px: tuple[float, float] = DEFAULT_OBJECT_HEIGHT_PX
) -> tuple[np.ndarray, list[dict]]:
    """Returns (uint8 HxWx3 image, objects back-to-front with class/box/occluded/truncated)."""
    scale = height / 192.0
    canvas = cluttered_background(rng, height, width, scale)
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
    """Part-id map of one object of class `cls` (render_parts)."""
    draw = {"car": _draw_car, "pedestrian": _draw_pedestrian, "cyclist": _draw_cyclist}[cls]
    return render_parts(rng, draw, box_w, box_h)


def render_parts(rng: np.random.Generator, draw, box_w: float, box_h: float) -> np.ndarray:
    """Part-id map (uint8, SS resolution) of the object `draw(rng, pen, w, h)` draws into a box_w x box_h box, with
    a random sub-pixel offset, a random mirror and a 1-px margin; the traffic set (traffic.py) draws with it too."""
    off_x, off_y = rng.uniform(1.0, 2.0, 2)
    cw = int(math.ceil(off_x + box_w)) + 2
    ch = int(math.ceil(off_y + box_h)) + 2
    img = Image.new("L", (cw * _SS, ch * _SS), 0)
    pen = _Pen(ImageDraw.Draw(img), off_x * _SS, off_y * _SS, box_w * _SS, bool(rng.random() < 0.5))
    draw(rng, pen, box_w * _SS, box_h * _SS)
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
