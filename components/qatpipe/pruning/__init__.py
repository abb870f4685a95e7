"""Structured (filter) pruning with TAO's semantics: see prune_model in prune.py.

graph.py finds which layers share a channel set (residual adds join them); criteria.py decides which
filters each set keeps; rebuild.py builds the physically smaller model and copies the kept weights;
cost.py counts parameters and FLOPs.
"""

from qatpipe.pruning.prune import PruneReport, prune_model

__all__ = ["PruneReport", "prune_model"]
