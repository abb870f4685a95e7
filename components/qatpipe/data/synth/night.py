"""The `traffic_night` data set: traffic.py's street scenes as a camera sees them at night (issue 37).

The scene and its labels are traffic's, drawn from the same generator first, so an index's boxes are the day set's;
then the picture is made a night one:

- underexposed and gamma-compressed, x -> e * x ** 1.8 with the exposure e drawn from 0.10-0.25 per image and a
  blue tint: the mean grey falls to about a tenth, and an object stands a few grey levels off its background;
- lamps that saturate the sensor, each a disc of twice full scale with a glow around it: a headlight and a tail
  light at the ends of most vehicles (one lamp on a two-wheeler; none on a pedestrian), placed only where the
  silhouette is, and 0-3 street lamps in the upper third of the image;
- sensor noise at high gain, 1.5-4 grey levels, drawn after the darkening.

What a detector must see sits in the bottom few grey levels while the lamps set the top of every activation's range:
the case in which one int8 scale per tensor chosen after training (PTQ) leaves the objects few steps, and training
with the quantizers in the graph (QAT) can learn around them.
"""

from __future__ import annotations

import numpy as np

from qatpipe.data.synth import traffic

_GAMMA = 1.8
_EXPOSURE = (0.10, 0.25)
_TINT = np.array([0.85, 0.95, 1.1], np.float32)  # moonlight / sodium-free night: a little blue
_NOISE = (1.5, 4.0)  # grey levels, standard deviation
_HEADLIGHT = np.array([1.0, 0.96, 0.85], np.float32)
_TAILLIGHT = np.array([1.0, 0.12, 0.08], np.float32)
_STREET_LAMP = np.array([1.0, 0.8, 0.5], np.float32)
_LAMP_PROB = 0.8  # of a vehicle showing its lamps
_TWO_WHEELERS = frozenset({"cyclist", "motorbike", "scooter"})
_STREET_LAMPS = (0, 3)
_CORE = 2.0  # a lamp's disc, in units of full scale: saturates whatever the exposure


def generate_traffic_night(
    rng: np.random.Generator, height: int, width: int, object_px: tuple[float, float] = traffic.TRAFFIC_OBJECT_PX
) -> tuple[np.ndarray, list[dict]]:
    """One `traffic_night` image: traffic's scene and objects (the same draws, so the same labels), then the night
    picture of it (uint8 HxWx3)."""
    day, objects = traffic.generate_traffic(rng, height, width, object_px)
    return night_picture(rng, day, objects), objects


def night_picture(rng: np.random.Generator, day: np.ndarray, objects: list[dict]) -> np.ndarray:
    """The night picture of a day image (uint8 HxWx3) whose objects carry traffic's class, box, mask and origin."""
    height, width = day.shape[:2]
    scale = height / 192.0
    x = np.float32(rng.uniform(*_EXPOSURE)) * (day.astype(np.float32) / 255.0) ** _GAMMA * _TINT
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)

    def lamp(cx: float, cy: float, radius: float, glow: float, strength: float, colour: np.ndarray) -> None:
        d2 = (xx - cx) ** 2 + (yy - cy) ** 2
        light = np.where(d2 <= radius * radius, _CORE, 0.0) + strength * np.exp(-d2 / (2.0 * glow * glow))
        x[...] += light[..., None].astype(np.float32) * colour

    for obj in objects:
        if obj["class"] == "pedestrian" or rng.random() >= _LAMP_PROB:
            continue
        x1, y1, x2, y2 = obj["box"]
        w, h = x2 - x1, y2 - y1
        radius = max(0.7, 0.045 * w)
        ends = [(x1 + 0.1 * w, _HEADLIGHT), (x2 - 0.1 * w, _TAILLIGHT)]
        if rng.random() < 0.5:  # facing left or right
            ends = [(ends[0][0], _TAILLIGHT), (ends[1][0], _HEADLIGHT)]
        if obj["class"] in _TWO_WHEELERS:
            ends = [ends[int(rng.integers(2))]]
        cy = y1 + rng.uniform(0.55, 0.75) * h
        for cx, colour in ends:
            if _on_silhouette(obj, cx, cy):
                lamp(cx, cy, radius, 3.0 * radius, rng.uniform(0.3, 0.6), colour)
    for _ in range(int(rng.integers(_STREET_LAMPS[0], _STREET_LAMPS[1] + 1))):
        lamp(rng.uniform(0, width), rng.uniform(0.03, 0.33) * height, rng.uniform(1.5, 3.0) * scale,
             rng.uniform(8.0, 20.0) * scale, rng.uniform(0.25, 0.5), _STREET_LAMP)

    x += rng.standard_normal(x.shape, dtype=np.float32) * np.float32(rng.uniform(*_NOISE) / 255.0)
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


def _on_silhouette(obj: dict, cx: float, cy: float) -> bool:
    """Whether image point (cx, cy) falls on the object's drawn silhouette (its mask, placed at its origin)."""
    mask, (ox, oy) = obj["mask"], obj["origin"]
    row, col = int(cy) - int(oy), int(cx) - int(ox)
    return 0 <= row < mask.shape[0] and 0 <= col < mask.shape[1] and bool(mask[row, col])
