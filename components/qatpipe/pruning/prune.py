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
    scoring below `settings.threshold` is removed; each set keeps a multiple of `settings.granularity`
    channels, at least `settings.min_filters`. Excluded layers, and sets reaching a model output, keep all.
    """
    from qatpipe.pruning.rebuild import rebuild

    names = {layer.name for layer in model.layers}
    unknown = sorted(set(settings.excluded_layers) - names)
    if unknown:
        raise SpecError(f"prune.excluded_layers: no such layers in {model.name}: {', '.join(unknown)}")
    graph = analyse(model, set(settings.excluded_layers))
    keep: list[np.ndarray] = []
    report_groups = []
    for group in graph.groups:
        # a producer's last kernel axis is its output channels (Conv2D filters, Dense units)
        total = model.get_layer(group.producers[0]).kernel.shape[-1] if group.producers else 0
        if not group.prunable or not group.producers:
            keep.append(np.arange(total))
            report_groups.append({"convs": group.producers, "before": total, "after": total,
                                  "kept_whole": group.reason or "no producer"})
            continue
        scores = [filter_scores(model.get_layer(name).get_weights()[0], settings.normalizer)
                  for name in group.producers]
        score = equalize(scores, settings.equalization)
        kept = kept_channels(score, settings.threshold, settings.granularity, settings.min_filters)
        keep.append(kept)
        report_groups.append({"convs": group.producers, "before": total, "after": int(kept.size)})
    pruned = rebuild(model, graph, keep)
    report = PruneReport(param_count(model), param_count(pruned), conv_flops(model), conv_flops(pruned),
                         settings.model_dump(), report_groups)
    log.info("pruned %s: params %d -> %d, FLOPs %.3g -> %.3g (x%.3f)", model.name, report.params_before,
             report.params_after, report.flops_before, report.flops_after, report.flops_ratio)
    return pruned, report
