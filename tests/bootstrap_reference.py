"""metrics/bootstrap.py's weighted_ap as it was before it was vectorised over the checkpoints (issue 55 item 5),
kept verbatim as the reference the new one must equal: tests/test_bootstrap.py checks equality on randomized
cases, bench/bootstrap_speed.py times both."""

from __future__ import annotations

import numpy as np

from qatpipe.metrics.bootstrap import MatchedDetections

CHUNK_ELEMENTS = 1_000_000  # replicates x IoU thresholds x detections per vectorised step (memory bound)


def reference_weighted_ap(matched: MatchedDetections, weights: np.ndarray) -> np.ndarray:
    """AP per image weighting, IoU threshold and class: (B, T, K), NaN for a class without ground truth.
    `weights` (B, N): how many times each image counts (all ones: the plain evaluation)."""
    weights = np.asarray(weights, float)
    recall_thresholds = matched.recall_thresholds
    points, ious = len(recall_thresholds), len(matched.iou_thresholds)
    objects = weights @ matched.gt_counts  # (B, K)
    ap = np.full((len(weights), ious, len(matched.classes)), np.nan)
    for k, found in enumerate(matched.classes):
        chunk = max(1, CHUNK_ELEMENTS // max(1, ious * len(found.image)))
        for start in range(0, len(weights), chunk):
            w = weights[start:start + chunk, found.image][:, None, :]  # (b, 1, D)
            tp, fp = np.cumsum(w * found.tp, axis=2), np.cumsum(w * found.fp, axis=2)
            n = objects[start:start + chunk, k][:, None, None]
            with np.errstate(divide="ignore", invalid="ignore"):  # rows without ground truth: NaN, dropped
                recall = tp / n
            precision = tp / (fp + tp + np.spacing(1))
            # precision made monotone (the highest to its right), then 0 past the last detection
            precision = np.maximum.accumulate(precision[..., ::-1], axis=2)[..., ::-1]
            precision = np.concatenate([precision, np.zeros(precision.shape[:2] + (1,))], axis=2)
            # COCO takes, per recall threshold r, the first detection with recall >= r
            # (np.searchsorted(recall, thresholds, side='left')): the number of detections with recall < r
            below = np.searchsorted(recall_thresholds, recall, side="right")  # thresholds <= each recall
            rows = np.arange(below.shape[0] * below.shape[1]).reshape(below.shape[:2] + (1,))
            counts = np.bincount((below + rows * (points + 1)).ravel(), minlength=rows.size * (points + 1))
            first = counts.reshape(below.shape[:2] + (points + 1,)).cumsum(axis=2)[..., :points]
            mean_precision = np.take_along_axis(precision, first, axis=2).mean(axis=2)  # (b, T)
            has_objects = objects[start:start + chunk, k] > 0
            ap[start:start + chunk, :, k] = np.where(has_objects[:, None], mean_precision, np.nan)
    return ap
