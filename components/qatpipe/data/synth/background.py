"""The cluttered procedural backgrounds of the `shapes` set, which the `glyphs` set prints its tiles on too."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw


def cluttered_background(rng: np.random.Generator, height: int, width: int, scale: float) -> np.ndarray:
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
