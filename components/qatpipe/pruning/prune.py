"""prune_model: TAO's structured pruning on a tf_keras functional model."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np
import tf_keras as keras

from qatpipe.errors import SpecError
from qatpipe.pruning.cost import conv_flops, param_count
from qatpipe.pruning.criteria import equalize, filter_scores, kept_channels
from qatpipe.pruning.graph import analyse
from qatpipe.spec import PruneSpec

log = logging.getLogger(__name__)


@dataclass
class PruneReport:
    params_before: int
    params_after: int
    flops_before: int
    flops_after: int
    settings: dict
    # one entry per channel group: its convs, channels before/after, and why it was kept whole
    groups: list[dict] = field(default_factory=list)

    @property
    def flops_ratio(self) -> float:
        return self.flops_after / self.flops_before if self.flops_before else 1.0

    def to_dict(self) -> dict:
        return {**asdict(self), "flops_ratio": round(self.flops_ratio, 4),
                "params_ratio": round(self.params_after / max(self.params_before, 1), 4)}


def prune_model(model: keras.Model, settings: PruneSpec) -> tuple[keras.Model, PruneReport]:
    """The physically smaller model and what was removed.

    Per conv filter: L2 norm of its weights, normalised by the conv's max (or L2) norm. Convs that share a
    channel set (joined by residual adds) get one score per channel by `settings.equalization`. A channel
    scoring below the threshold is removed; each set keeps a multiple of `settings.granularity` channels, at
    least `settings.min_filters`. Excluded layers, and sets reaching a model output, keep all. The threshold
    is `settings.threshold` (TAO's -pth), or with `settings.target_flops_ratio` the lowest one whose pruned
    model has at most that share of the FLOPs (threshold_for_flops).
    """
    from qatpipe.pruning.rebuild import rebuild

    names = {layer.name for layer in model.layers}
    unknown = sorted(set(settings.excluded_layers) - names)
    if unknown:
        raise SpecError(f"prune.excluded_layers: no such layers in {model.name}: {', '.join(unknown)}")
    graph = analyse(model, set(settings.excluded_layers))
    totals, scores = [], []  # per group: its channel count, and its channel scores (None: kept whole)
    for group in graph.groups:
        # a producer's last kernel axis is its output channels (Conv2D filters, Dense units)
        totals.append(model.get_layer(group.producers[0]).kernel.shape[-1] if group.producers else 0)
        scores.append(
            equalize([filter_scores(model.get_layer(name).get_weights()[0], settings.normalizer)
                      for name in group.producers], settings.equalization)
            if group.prunable and group.producers else None)

    def keep_at(threshold: float) -> list[np.ndarray]:
        return [np.arange(total) if score is None else
                kept_channels(score, threshold, settings.granularity, settings.min_filters)
                for total, score in zip(totals, scores)]

    threshold = settings.threshold
    if settings.target_flops_ratio is not None:
        threshold = threshold_for_flops(model, graph, scores, keep_at, settings.target_flops_ratio)
    keep = keep_at(threshold)
    report_groups = [
        {"convs": group.producers, "before": total, "after": int(kept.size)}
        | ({} if score is not None else {"kept_whole": group.reason or "no producer"})
        for group, total, score, kept in zip(graph.groups, totals, scores, keep)
    ]
    pruned = rebuild(model, graph, keep)
    report = PruneReport(param_count(model), param_count(pruned), conv_flops(model), conv_flops(pruned),
                         {**settings.model_dump(), "threshold_used": round(float(threshold), 6)}, report_groups)
    log.info("pruned %s at threshold %.4f: params %d -> %d, FLOPs %.3g -> %.3g (x%.3f)", model.name, threshold,
             report.params_before, report.params_after, report.flops_before, report.flops_after,
             report.flops_ratio)
    return pruned, report


def threshold_for_flops(model: keras.Model, graph, scores: list[np.ndarray | None], keep_at,
                        target_ratio: float) -> float:
    """The lowest threshold at which the pruned model keeps at most `target_ratio` of the FLOPs.

    A norm threshold means different things on different data and losses (the same -pth cut one model to x0.27
    of its FLOPs and another to x0.45), while a FLOPs budget is what a deployment plans for. Raising the
    threshold never keeps more channels, so the FLOPs fall monotonically along the sorted channel scores and a
    bisection over them finds it. When granularity and min_filters keep the budget out of reach, the highest
    threshold is used and a warning says how close it came."""
    before = conv_flops(model)

    def ratio(threshold: float) -> float:
        kept = [k.size for k in keep_at(threshold)]

        def channels(layer) -> tuple[int, int]:  # a group's kept count; -1 is the model input, never pruned
            return tuple(int(layer.input.shape[-1]) if g < 0 else int(kept[g])
                         for g in (graph.group_of_input[layer.name], graph.group_of_output[layer.name]))

        return conv_flops(model, channels) / before

    candidates = np.unique(np.concatenate([[0.0], *(s for s in scores if s is not None)]))
    candidates = np.append(candidates, np.nextafter(candidates[-1], np.inf))  # above every score: the floor
    lo, hi = 0, len(candidates) - 1
    if (floor := ratio(candidates[hi])) > target_ratio:
        log.warning("prune.target_flops_ratio %.3f is out of reach (granularity and min_filters keep x%.3f); "
                    "pruning as far as they allow", target_ratio, floor)
        return float(candidates[hi])
    while lo < hi:  # the first candidate whose ratio is within the budget
        mid = (lo + hi) // 2
        if ratio(candidates[mid]) <= target_ratio:
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo])
