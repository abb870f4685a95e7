"""Which filters a channel group keeps: TAO's per-filter norm, normaliser, threshold, equalisation and
granularity, as pure NumPy."""

from __future__ import annotations

import math

import numpy as np

EQUALIZATIONS = ("union", "intersection", "arithmetic_mean", "geometric_mean")


def filter_scores(kernel: np.ndarray, normalizer: str) -> np.ndarray:
    """Per-filter (last axis) L2 norm of a conv kernel (kh, kw, in, out), normalised by the largest norm
    ("max") or by the norm of the norm vector ("L2")."""
    norms = np.sqrt(np.sum(np.square(kernel.reshape(-1, kernel.shape[-1]).astype(np.float64)), axis=0))
    if normalizer == "max":
        scale = norms.max()
    elif normalizer == "L2":
        scale = np.linalg.norm(norms)
    else:
        raise ValueError(f"unknown normalizer {normalizer!r}: max or L2")
    return norms / scale if scale > 0 else np.zeros_like(norms)


def equalize(scores: list[np.ndarray], method: str) -> np.ndarray:
    """One score per channel for convs that must keep the same channels (a residual group).

    union: a channel stays if any conv keeps it (max); intersection: only if all keep it (min);
    arithmetic_mean / geometric_mean: the mean of the convs' scores."""
    stacked = np.stack(scores)
    if method == "union":
        return stacked.max(axis=0)
    if method == "intersection":
        return stacked.min(axis=0)
    if method == "arithmetic_mean":
        return stacked.mean(axis=0)
    if method == "geometric_mean":
        return np.exp(np.log(np.maximum(stacked, 1e-30)).mean(axis=0))
    raise ValueError(f"unknown equalization {method!r}: one of {', '.join(EQUALIZATIONS)}")


def kept_channels(score: np.ndarray, threshold: float, granularity: int, min_filters: int) -> np.ndarray:
    """Sorted indices of the channels kept: those scoring at least `threshold`, their count rounded up to a
    multiple of `granularity` and never below `min_filters` (nor above the total); the extra channels are
    the best-scoring of the rest."""
    total = score.size
    passing = int(np.count_nonzero(score >= threshold))
    count = max(min_filters, math.ceil(passing / granularity) * granularity)
    count = min(total, count)
    # stable: ties keep the lower index, so results do not depend on sort internals
    order = np.argsort(-score, kind="stable")
    return np.sort(order[:count])
