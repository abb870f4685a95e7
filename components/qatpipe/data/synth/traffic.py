"""The `traffic` data set: crowded KITTI-like street scenes for a multi-scale detector (SSD) study.

Ten vehicle-like classes, told apart by silhouette, proportions and details (every class draws its colours from
the one palette of the shapes set, so colour never tells the class), seen from the side:

    car        low body, trapezoid cabin, two wheels (the shapes set's car)   width/height 2.1-2.7
    pedestrian head, torso, arms, legs (the shapes set's pedestrian)         0.3-0.5
    van        one tall box with a sloped nose, a row of side windows        1.45-1.85
    cyclist    ring wheels, frame and rider (the shapes set's cyclist)       0.9-1.35
    truck      cargo box, separate cab with a window, three wheels           1.9-2.5
    motorbike  solid wheels, tank and engine, a crouched helmeted rider      1.15-1.5
    bus        long tall box, a band of window panes, a door, small wheels   2.6-3.3
    scooter    small wheels, low deck, steering column, an upright rider     0.6-0.85
    trailer    ribbed box on a middle axle with a drawbar, no cab            2.2-3.2
    tram       two sections with a joint, pantograph, windows, bogies        3.3-4.3

Classes are drawn Zipf-like in that order (weight 1/rank: the car ten times as often as the tram). Each image
holds 2-10 objects (a scene left with fewer is drawn again). Box widths span `object_px` (16-80 px at a
192-px-high image, scaled with the height): lo * (hi/lo) ** (U ** 0.85), log-uniform tilted a little towards
large boxes so that about 30% are under 28 px; each class's range is narrowed so that its box is 7 px to 75% of
the image high (a pedestrian's widest is 43-72 px, a tram's narrowest 23-30 px, by aspect ratio). A drawing
whose tight box misses the drawn width by over 5% (a pedestrian's arms) is drawn again, rescaled.

Depth: a flat ground plane seen by a camera 1.65 m up (KITTI's), its horizon at 38-50% of the image height.
An object of class height H_c metres drawn h px high stands with its bottom edge h * 1.65 / H_c px below the
horizon (+-2% of the image height of jitter): farther objects are smaller and higher, near tall ones run off
the bottom edge. Objects are placed and painted back to front (by bottom edge) over the cluttered backgrounds
of background.py; each placement draws a new x (25 tries) until no object behind it is left with more than
40% of its pixels hidden, else the object is dropped. 15% of objects are shifted over the left or right
border by 10-60% of their width.

Labels (KITTI): the box is the tight box of the object's drawn pixels inside the image (clipped to it).
`truncated` is the fraction of the object's pixels (its silhouette, alpha >= 0.5) that lie outside the image,
two decimals. `occluded` comes from the fraction of its in-image pixels that objects in front cover:
0 (fully visible) below 5%, 1 (partly occluded) below 25%, 2 (largely occluded) from 25% to the 40% cap.
Every object dict also carries `mask` (its whole silhouette, bool), `origin` (the image position of the mask's
top-left pixel, possibly outside the image) and `hidden` (the covered fraction), which tests check the labels
against; the writer reads only class, box, occluded and truncated.
"""

from __future__ import annotations

import math

import numpy as np

from qatpipe.data.synth import shapes
from qatpipe.data.synth.background import cluttered_background
from qatpipe.data.synth.shapes import _FRAME, _GLASS, _HEAD, _HUB, _PRIMARY, _SECONDARY, _SS, _TIRE

# most common first: the class weights are 1/rank (Zipf, exponent 1)
TRAFFIC_CLASSES = ("car", "pedestrian", "van", "cyclist", "truck", "motorbike", "bus", "scooter", "trailer", "tram")
CLASS_WEIGHTS = tuple(1.0 / rank for rank in range(1, len(TRAFFIC_CLASSES) + 1))
# box widths, pixels at a 192-px-high image (scaled with the height)
TRAFFIC_OBJECT_PX = (16.0, 80.0)
OBJECTS_PER_IMAGE = (2, 10)
MAX_HIDDEN = 0.4  # no placement leaves an object behind it with more of its pixels hidden than this
# `occluded` from the hidden fraction: 0 below the first, 1 below the second, else 2
OCCLUDED_THRESHOLDS = (0.05, 0.25)
CAMERA_HEIGHT_M = 1.65
_HORIZON = (0.38, 0.5)  # fraction of the image height
_GROUND_JITTER = 0.02  # of the image height, on each object's bottom edge
_MIN_HEIGHT_PX = 7.0  # at a 192-px-high image
_MAX_HEIGHT = 0.75  # of the image height
_SIDE_TRUNCATE_PROB = 0.15
_SIDE_CUT = (0.1, 0.6)  # fraction of the box width over the border
_PLACEMENT_TRIES = 25
_DRAW_TRIES = 6
_SCENE_TRIES = 8
_SIZE_TILT = 0.85  # box width = lo * (hi / lo) ** (U ** tilt): 1 is log-uniform, below 1 favours large boxes


def occluded_level(hidden: float) -> int:
    """KITTI's occluded field from the fraction of an object's in-image pixels hidden by objects in front."""
    return 0 if hidden < OCCLUDED_THRESHOLDS[0] else 1 if hidden < OCCLUDED_THRESHOLDS[1] else 2


def generate_traffic(
    rng: np.random.Generator, height: int, width: int, object_px: tuple[float, float] = TRAFFIC_OBJECT_PX
) -> tuple[np.ndarray, list[dict]]:
    """One `traffic` image: (uint8 HxWx3, objects back to front: class, box, occluded, truncated, mask, origin,
    hidden)."""
    for _ in range(_SCENE_TRIES):  # a scene that kept fewer than 2 objects (rare) is drawn again
        canvas, placed = _scene(rng, height, width, object_px)
        if len(placed) >= OBJECTS_PER_IMAGE[0]:
            break
    canvas += rng.standard_normal(canvas.shape, dtype=np.float32) * np.float32(rng.uniform(3.0, 9.0))
    image = np.clip(np.rint(canvas), 0, 255).astype(np.uint8)
    objects = []
    for obj in placed:
        hidden = 1.0 - obj["visible"] / obj["full"]
        objects.append({"class": obj["class"], "box": obj["box"], "occluded": occluded_level(hidden),
                        "truncated": obj["truncated"], "mask": obj["mask"], "origin": obj["origin"],
                        "hidden": hidden})
    return image, objects


# --------------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------------


def _scene(rng, height: int, width: int, object_px) -> tuple[np.ndarray, list[dict]]:
    """The background with the objects painted back to front (float canvas, placed objects)."""
    scale = height / 192.0
    canvas = cluttered_background(rng, height, width, scale)
    horizon = rng.uniform(*_HORIZON) * height
    n_objects = int(rng.integers(OBJECTS_PER_IMAGE[0], OBJECTS_PER_IMAGE[1] + 1))
    p = np.asarray(CLASS_WEIGHTS) / sum(CLASS_WEIGHTS)
    plans = [_plan(rng, TRAFFIC_CLASSES[int(k)], object_px, scale, height, width, horizon)
             for k in rng.choice(len(TRAFFIC_CLASSES), size=n_objects, p=p)]
    plans = [plan for plan in plans if plan is not None]
    plans.sort(key=lambda plan: plan["bottom"])  # far (high in the image) first: painted back to front

    owner = np.zeros((height, width), np.int16)  # 0 = background, k = k-th placed object (1-based)
    placed: list[dict] = []
    for plan in plans:
        obj = _place(rng, canvas, owner, placed, plan, object_px[0] * scale, height, width)
        if obj is not None:
            placed.append(obj)
    return canvas, placed


def _plan(rng, cls: str, object_px, scale: float, height: int, width: int, horizon: float) -> dict | None:
    """The object's part map at its size and the image row of its bottom edge on the ground plane (None: no
    drawing came out within the width range)."""
    draw, aspect, metres = _CLASSES[cls]
    ratio = rng.uniform(*aspect)  # box width / height
    lo = max(object_px[0] * scale, _MIN_HEIGHT_PX * scale * ratio)
    hi = min(object_px[1] * scale, _MAX_HEIGHT * height * ratio, 0.9 * width)
    lo = min(lo, hi)
    # log-uniform, tilted towards large boxes by _SIZE_TILT
    target = math.exp(math.log(lo) + rng.random() ** _SIZE_TILT * math.log(hi / lo))
    box_w = target
    for _ in range(_DRAW_TRIES):  # a drawing that leaves its box's sides empty (a pedestrian's) is drawn again
        parts = shapes.render_parts(rng, draw, box_w, box_w / ratio)
        tight_w = _extent(parts > 0)[2]
        if lo <= tight_w <= hi and tight_w >= 0.95 * target:
            break
        box_w *= target / tight_w
    else:
        return None
    tight_h = _extent(parts > 0)[3]
    bottom = horizon + tight_h * CAMERA_HEIGHT_M / metres + rng.uniform(-1.0, 1.0) * _GROUND_JITTER * height
    return {"class": cls, "parts": parts, "bottom": bottom}


def _extent(drawn: np.ndarray) -> tuple[float, float, float, float]:
    """(x1, y1, width, height) of the drawn SS pixels, in image pixels."""
    rows, cols = np.flatnonzero(drawn.any(axis=1)), np.flatnonzero(drawn.any(axis=0))
    return cols[0] / _SS, rows[0] / _SS, (cols[-1] + 1 - cols[0]) / _SS, (rows[-1] + 1 - rows[0]) / _SS


def _place(rng, canvas, owner, placed: list[dict], plan: dict, min_w: float, height: int, width: int) -> dict | None:
    """Paints the object in front of `placed` at a random x whose cover leaves every object behind it at most
    MAX_HIDDEN hidden; updates their visible pixel counts. None when no try fits."""
    parts = plan["parts"]
    drawn = parts > 0
    ssh, ssw = parts.shape
    ch, cw = ssh // _SS, ssw // _SS
    alpha = drawn.reshape(ch, _SS, cw, _SS).mean(axis=(1, 3), dtype=np.float32)
    solid = alpha >= 0.5  # the object's pixels: truncation and occlusion are fractions of these
    total = int(solid.sum())
    lx1, ly1, bw, bh = _extent(drawn)
    oy = int(round(plan["bottom"] - (ly1 + bh)))
    cut = None
    if rng.random() < _SIDE_TRUNCATE_PROB and (1.0 - (min_w + 1.0) / bw) > _SIDE_CUT[0]:
        cut = (_SIDE_CUT[0], min(_SIDE_CUT[1], 1.0 - (min_w + 1.0) / bw))
    for _ in range(_PLACEMENT_TRIES):
        if cut is None:
            a, b = math.ceil(-lx1), math.floor(width - lx1 - bw)
            ox = int(rng.integers(a, b + 1)) if b >= a else int(round((width - bw) / 2 - lx1))
        elif rng.random() < 0.5:  # over the left border
            ox = int(round(-rng.uniform(*cut) * bw - lx1))
        else:
            ox = int(round(width + rng.uniform(*cut) * bw - lx1 - bw))
        ix0, iy0, ix1, iy1 = max(0, ox), max(0, oy), min(width, ox + cw), min(height, oy + ch)
        if ix1 <= ix0 or iy1 <= iy0:
            continue
        cx0, cy0 = ix0 - ox, iy0 - oy
        mask = solid[cy0:cy0 + iy1 - iy0, cx0:cx0 + ix1 - ix0]
        full = int(mask.sum())
        sub = drawn[cy0 * _SS:(cy0 + iy1 - iy0) * _SS, cx0 * _SS:(cx0 + ix1 - ix0) * _SS]
        if full < 8 or not sub.any():
            continue
        sx1, sy1, sw, sh = _extent(sub)
        if sw < min_w or sh < 4.0:
            continue
        region_owner = owner[iy0:iy1, ix0:ix1]
        newly_hidden = np.bincount(region_owner[mask], minlength=len(placed) + 1)[1:]
        if any(o["visible"] - h < (1.0 - MAX_HIDDEN) * o["full"] for o, h in zip(placed, newly_hidden) if h):
            continue
        break
    else:
        return None

    for o, h in zip(placed, newly_hidden):
        o["visible"] -= int(h)
    region_owner[mask] = len(placed) + 1
    region = canvas[iy0:iy1, ix0:ix1]
    palette = shapes._palette(rng, region[mask].mean(axis=0))  # contrast with what is under the object now
    colour = palette[parts].reshape(ch, _SS, cw, _SS, 3).mean(axis=(1, 3))  # premultiplied by alpha
    a = alpha[cy0:cy0 + iy1 - iy0, cx0:cx0 + ix1 - ix0, None]
    region *= 1.0 - a
    region += colour[cy0:cy0 + iy1 - iy0, cx0:cx0 + ix1 - ix0]
    truncated = 1.0 - full / total
    return {
        "class": plan["class"],
        "box": (ix0 + sx1, iy0 + sy1, ix0 + sx1 + sw, iy0 + sy1 + sh),
        "full": full,
        "visible": full,
        "truncated": round(truncated, 2) if truncated >= 0.005 else 0.0,
        "mask": solid,
        "origin": (ox, oy),
    }


# --------------------------------------------------------------------------------------------------
# Silhouettes: draw(rng, pen, w, h) in SS units into a w x h box (shapes._Pen; x grows towards the front)
# --------------------------------------------------------------------------------------------------


def _wheel(pen, x: float, y: float, r: float, hub: float = 0.45) -> None:
    pen.circle(x, y, r, _TIRE)
    pen.circle(x, y, r * hub, _HUB)


def _panes(pen, x0: float, x1: float, y0: float, y1: float, n: int, gap: float) -> None:
    """n window panes side by side between x0 and x1, separated by gaps (pillars) of the body colour."""
    pane = (x1 - x0 - (n - 1) * gap) / n
    if pane <= _SS or y1 - y0 <= _SS:
        return
    for i in range(n):
        xa = x0 + i * (pane + gap)
        pen.rrect(xa, y0, xa + pane, y1, min(pane, y1 - y0) * 0.15, _GLASS)


def _draw_van(rng, pen, w: float, h: float) -> None:
    u = rng.uniform
    r = u(0.13, 0.16) * h
    bot = h - 0.6 * r
    nose = u(0.78, 0.84) * w
    pen.rrect(0.0, 0.0, nose + 0.04 * w, bot, 0.1 * h, _PRIMARY)
    hood = u(0.42, 0.5) * h
    pen.polygon([(nose - 0.02 * w, 0.0), (w - 0.09 * w, hood), (w, hood + 0.05 * h), (w, bot), (nose, bot)],
                _PRIMARY)
    pen.polygon([(nose + 0.01 * w, 0.1 * h), (w - 0.11 * w, hood - 0.04 * h), (nose + 0.01 * w, hood - 0.04 * h)],
                _GLASS)  # windscreen along the sloped nose
    _panes(pen, 0.05 * w, nose - 0.03 * w, 0.1 * h, u(0.34, 0.4) * h, int(rng.integers(2, 4)), 0.04 * w)
    door = u(0.42, 0.5) * w
    pen.line([(door, 0.45 * h), (door, bot - 0.08 * h)], max(_SS * 0.6, 0.012 * w), _SECONDARY)
    pen.circle(w - 0.03 * w, hood + 0.14 * h, max(0.035 * h, 0.6 * _SS), _HUB)  # head light
    for x in (0.17 * w, 0.84 * w):
        _wheel(pen, x, h - r, r)


def _draw_truck(rng, pen, w: float, h: float) -> None:
    u = rng.uniform
    r = u(0.12, 0.15) * h
    box_end = u(0.66, 0.72) * w
    chassis_y = h - r
    pen.line([(0.02 * w, chassis_y), (w - 0.02 * w, chassis_y)], max(0.07 * h, _SS), _FRAME)
    pen.rrect(0.0, 0.0, box_end, chassis_y - 0.4 * r, 0.03 * h, _SECONDARY)  # cargo box
    cab_x = box_end + 0.025 * w
    cab_top = u(0.28, 0.38) * h
    pen.rrect(cab_x, cab_top, w, chassis_y, 0.12 * (w - cab_x), _PRIMARY)
    pen.rrect(cab_x + 0.35 * (w - cab_x), cab_top + 0.07 * h, w - 0.08 * (w - cab_x), cab_top + u(0.22, 0.28) * h,
              0.05 * h, _GLASS)
    for x in (0.13 * w, 0.13 * w + 2.15 * r, w - 0.12 * w):
        _wheel(pen, x, h - r, r)


def _draw_bus(rng, pen, w: float, h: float) -> None:
    u = rng.uniform
    r = u(0.1, 0.12) * h
    bot = h - 0.55 * r
    pen.rrect(0.0, 0.0, w, bot, 0.12 * h, _PRIMARY)
    top, low = u(0.12, 0.16) * h, u(0.42, 0.48) * h
    _panes(pen, 0.03 * w, 0.84 * w, top, low, int(rng.integers(5, 8)), 0.012 * w)
    pen.rrect(0.955 * w, top - 0.02 * h, w - 0.012 * w, u(0.55, 0.62) * h, 0.03 * h, _GLASS)  # windscreen
    pen.rrect(0.865 * w, top, 0.925 * w, bot - 0.1 * h, 0.02 * h, _GLASS)  # front door
    pen.rrect(0.0, u(0.6, 0.66) * h, w, 0.72 * h, 0.0, _SECONDARY)  # stripe along the side
    for x in (0.15 * w, 0.8 * w):
        _wheel(pen, x, h - r, r)


def _draw_tram(rng, pen, w: float, h: float) -> None:
    u = rng.uniform
    roof = u(0.15, 0.2) * h
    bot = h - 0.06 * h
    mid = u(0.47, 0.53) * w
    panto = u(0.3, 0.7) * mid
    pen.line([(panto - 0.05 * w, roof), (panto, 0.5 * roof), (panto - 0.04 * w, _SS * 0.5),
              (panto + 0.04 * w, _SS * 0.5)], max(0.02 * h, 0.6 * _SS), _FRAME)  # pantograph
    for x0, x1 in ((0.0, mid - 0.012 * w), (mid + 0.012 * w, w)):
        pen.rrect(x0, roof, x1, bot, 0.22 * (bot - roof), _PRIMARY)
        _panes(pen, x0 + 0.03 * w, x1 - 0.03 * w, roof + 0.12 * h, roof + u(0.34, 0.4) * h, 3, 0.012 * w)
    pen.rrect(mid - 0.016 * w, roof + 0.06 * h, mid + 0.016 * w, bot - 0.04 * h, 0.0, _SECONDARY)  # the joint
    rb = max(0.065 * h, 0.7 * _SS)
    for x in (0.08 * w, 0.13 * w, mid - 0.03 * w, mid + 0.03 * w, 0.87 * w, 0.92 * w):  # bogies
        _wheel(pen, x, h - rb, rb, 0.3)


def _draw_trailer(rng, pen, w: float, h: float) -> None:
    u = rng.uniform
    r = u(0.15, 0.18) * h
    box_end = u(0.8, 0.86) * w
    box_bot = h - 1.7 * r
    pen.line([(box_end - 0.02 * w, box_bot - 0.05 * h), (w - 0.03 * w, h - 1.3 * r)], max(0.05 * h, _SS), _FRAME)
    pen.circle(w - 0.03 * w, h - 1.3 * r, max(0.045 * h, 0.8 * _SS), _FRAME, outline_width=max(1, int(0.02 * h)))
    pen.rrect(0.0, 0.0, box_end, box_bot, 0.04 * h, _PRIMARY)
    ribs = int(rng.integers(4, 8))
    for i in range(1, ribs):  # corrugated sides
        x = box_end * i / ribs
        pen.line([(x, 0.06 * h), (x, box_bot - 0.06 * h)], max(0.02 * w, 0.6 * _SS), _SECONDARY)
    axle = u(0.38, 0.5) * box_end
    for x in (axle, axle + 2.15 * r) if rng.random() < 0.5 else (axle,):
        _wheel(pen, x, h - r, r)


def _draw_motorbike(rng, pen, w: float, h: float) -> None:
    u = rng.uniform
    r = min(u(0.16, 0.18) * w, 0.25 * h)
    hub_y = h - r
    rear, front = (r, hub_y), (w - r, hub_y)
    frame_w = max(0.05 * h, 0.8 * _SS)
    limb_w = max(0.09 * h, _SS)
    pen.line([front, (w - 1.4 * r, hub_y - 1.9 * r)], frame_w, _FRAME)  # fork
    pen.polygon([(0.15 * w, hub_y - 1.25 * r), (0.62 * w, hub_y - 1.55 * r), (0.72 * w, hub_y - 1.2 * r),
                 (0.6 * w, hub_y - 0.5 * r), (0.32 * w, hub_y - 0.45 * r)], _PRIMARY)  # tank and seat
    pen.rrect(0.38 * w, hub_y - 0.75 * r, 0.6 * w, hub_y + 0.25 * r, 0.1 * r, _SECONDARY)  # engine
    pen.line([rear, (0.4 * w, hub_y - 0.2 * r)], frame_w, _FRAME)  # swing arm
    for c in (rear, front):
        _wheel(pen, c[0], c[1], r, u(0.4, 0.5))
    rh = u(0.1, 0.12) * h  # helmet
    head = (u(0.58, 0.66) * w, rh)
    hip = (0.33 * w, hub_y - 1.6 * r)
    shoulder = (head[0] - 0.08 * w, head[1] + 1.5 * rh)
    knee = (0.55 * w, hub_y - 1.2 * r)
    pen.limb(hip, knee, limb_w, _SECONDARY)
    pen.limb(knee, (0.45 * w, hub_y - 0.2 * r), limb_w * 0.85, _SECONDARY)
    pen.limb(hip, shoulder, u(0.14, 0.18) * h, _PRIMARY)  # torso, leaning forward
    pen.limb(shoulder, (w - 1.45 * r, hub_y - 1.95 * r), limb_w * 0.9, _PRIMARY)
    pen.circle(head[0], head[1], rh, _HEAD)


def _draw_scooter(rng, pen, w: float, h: float) -> None:
    u = rng.uniform
    r = max(u(0.055, 0.07) * h, 0.8 * _SS)
    deck_y = h - 1.6 * r
    frame_w = max(0.03 * h, 0.8 * _SS)
    pen.line([(r, deck_y), (w - r, deck_y)], max(0.035 * h, _SS), _FRAME)  # deck
    bar = (w - u(0.12, 0.2) * w, u(0.3, 0.36) * h)
    pen.line([(w - r, h - r), bar], frame_w, _FRAME)  # steering column
    pen.line([(bar[0] - 0.08 * w, bar[1]), (bar[0] + 0.06 * w, bar[1])], frame_w, _FRAME)  # handlebar
    for x in (r, w - r):
        _wheel(pen, x, h - r, r, 0.4)
    rh = u(0.065, 0.08) * h
    cx = u(0.3, 0.38) * w
    hip = (cx, u(0.52, 0.56) * h)
    leg_w = max(u(0.05, 0.07) * h, _SS)
    for dx in (-0.04 * w, 0.04 * w):  # straight legs, standing on the deck
        pen.limb((hip[0] + dx, hip[1]), (hip[0] + dx * 1.5, deck_y - 0.5 * leg_w), leg_w, _SECONDARY)
    shoulder = (cx + 0.03 * w, 2.2 * rh + 0.03 * h)
    pen.limb(hip, shoulder, u(0.11, 0.14) * h, _PRIMARY)
    pen.limb(shoulder, bar, max(0.045 * h, _SS), _PRIMARY)  # arms to the handlebar
    pen.circle(cx + 0.04 * w, rh, rh, _HEAD)


# class -> (draw, box width/height range, height in metres on the ground plane)
_CLASSES = {
    "car": (shapes._draw_car, (2.1, 2.7), 1.5),
    "pedestrian": (shapes._draw_pedestrian, (0.3, 0.5), 1.75),
    "van": (_draw_van, (1.45, 1.85), 2.1),
    "cyclist": (shapes._draw_cyclist, (0.9, 1.35), 1.75),
    "truck": (_draw_truck, (1.9, 2.5), 3.2),
    "motorbike": (_draw_motorbike, (1.15, 1.5), 1.5),
    "bus": (_draw_bus, (2.6, 3.3), 3.1),
    "scooter": (_draw_scooter, (0.6, 0.85), 1.8),
    "trailer": (_draw_trailer, (2.2, 3.2), 2.5),
    "tram": (_draw_tram, (3.3, 4.3), 3.4),
}
assert tuple(_CLASSES) == TRAFFIC_CLASSES
