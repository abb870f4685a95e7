"""The paired differences between model variants as data: summary.json's `comparisons` as flat tracker metrics
and back, which side of 0 a difference's 95% CI lies on, and that in plain words."""

from __future__ import annotations

import math
from typing import Iterable


def pair_metrics(comparisons: dict[str, dict[str, dict]]) -> dict[str, float]:
    """summary.json's comparisons as flat metrics: `qat-fp32.map50_diff`, `qat-fp32.map50_ci95_lo`, `..._hi`."""
    flat = {}
    for pair, metrics in comparisons.items():
        for metric, estimate in metrics.items():
            flat[f"{pair}.{metric}_diff"] = estimate["diff"]
            flat[f"{pair}.{metric}_ci95_lo"], flat[f"{pair}.{metric}_ci95_hi"] = estimate["ci95"]
    return flat


def comparisons_from_metrics(flat: dict[str, float]) -> dict[str, dict[str, dict]]:
    """pair_metrics' inverse (the comparisons as an experiment tracker gives them back)."""
    comparisons: dict[str, dict[str, dict]] = {}
    for key, value in flat.items():
        pair, name = key.split(".", 1)
        metric, part = name.split("_", 1)
        estimate = comparisons.setdefault(pair, {}).setdefault(metric, {"diff": None, "ci95": [None, None]})
        if part == "diff":
            estimate["diff"] = value
        else:
            estimate["ci95"][("ci95_lo", "ci95_hi").index(part)] = value
    return comparisons


def verdict(pair: str, ci95: list[float], names: Iterable[str] = ()) -> str:
    """Plain words for a difference a-b: no significant difference when its interval holds 0, else which is
    better (split_pair: `names`, the variants, split a name holding "-")."""
    better, worse = split_pair(pair, names)
    if not all(math.isfinite(bound) for bound in ci95):  # e.g. every resample drew images without objects
        return "n/a"
    if ci95[0] <= 0 <= ci95[1]:
        return "no significant difference"
    return f"{better} better" if ci95[0] > 0 else f"{worse} better"


def split_pair(pair: str, names: Iterable[str] = ()) -> tuple[str, str]:
    """(a, b) of a difference named "a-b". A variant's name may hold "-" (ptq-partial): the split is the one
    whose sides are both among `names` (the summary's variants), else one side is, else the first "-"."""
    known = set(names)
    splits = [(pair[:at], pair[at + 1:]) for at, char in enumerate(pair) if char == "-"]
    if not splits:
        raise ValueError(f"{pair!r} is no difference a-b")
    for wanted in (2, 1):
        for a, b in splits:
            if (a in known) + (b in known) >= wanted:
                return a, b
    return splits[0]


def ci_side(ci95: list[float]) -> str:
    """Where a 95% CI lies against 0: "above", "below" or "holds" (a CI that is not finite counts as holding 0)."""
    if not all(math.isfinite(bound) for bound in ci95) or ci95[0] <= 0 <= ci95[1]:
        return "holds"
    return "above" if ci95[0] > 0 else "below"


__all__ = ["pair_metrics", "comparisons_from_metrics", "verdict", "split_pair", "ci_side"]
