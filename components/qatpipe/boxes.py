"""Box maths in NumPy, shared by the detectors' decoders and the metrics: IoU, non-maximum suppression, TAO's DBSCAN
clustering, and the boxes a grid head's cells predict. No TensorFlow here, so that metrics/ and the decoders run
wherever NumPy does (an SSD's prior-box encoding and decoding belong here too)."""

from __future__ import annotations

import numpy as np


def cell_boxes(bbox: np.ndarray, ys: np.ndarray, xs: np.ndarray, c: int, stride: int,
               bbox_norm: float) -> np.ndarray:
    """The class-c boxes (x1 y1 x2 y2, input pixels, unclipped) that cells (ys, xs) of one image's bbox output
    (gh,gw,4C) predict: edge distances from each cell's centre, in units of bbox_norm."""
    d = bbox[ys, xs, 4 * c : 4 * c + 4].astype(np.float32) * bbox_norm
    cx, cy = (xs + 0.5) * stride, (ys + 0.5) * stride
    return np.stack([cx - d[:, 0], cy - d[:, 1], cx + d[:, 2], cy + d[:, 3]], axis=1)


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in a (N,4) with every box in b (M,4), x1 y1 x2 y2."""
    tl = np.maximum(a[:, None, :2], b[None, :, :2])
    br = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(br - tl, 0, None), axis=2)
    area_a = np.prod(a[:, 2:] - a[:, :2], axis=1)
    area_b = np.prod(b[:, 2:] - b[:, :2], axis=1)
    return inter / np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Greedy non-maximum suppression; returns the kept boxes and scores, best first."""
    order = np.argsort(-scores, kind="stable")
    boxes, scores = boxes[order], scores[order]
    if len(boxes) == 0:
        return boxes, scores
    ious = iou_matrix(boxes, boxes)
    suppressed = np.zeros(len(boxes), bool)
    keep = []
    for i in range(len(boxes)):
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= ious[i] > iou_threshold
    return boxes[keep], scores[keep]


def dbscan_cluster(
    boxes: np.ndarray, scores: np.ndarray, eps: float, min_samples: int
) -> tuple[np.ndarray, np.ndarray]:
    """TAO-style clustering: DBSCAN with distance 1-IoU; each cluster -> coverage-weighted mean box.

    The cluster score is its highest coverage, so scores stay in [0, 1] and rank like NMS scores.
    """
    n = len(boxes)
    if n == 0:
        return boxes, scores
    neighbours = (1.0 - iou_matrix(boxes, boxes)) <= eps
    core = neighbours.sum(axis=1) >= min_samples
    labels = np.full(n, -1)
    cluster = 0
    for i in np.argsort(-scores, kind="stable"):
        if labels[i] != -1 or not core[i]:
            continue
        labels[i] = cluster
        frontier = [i]
        while frontier:
            j = frontier.pop()
            if not core[j]:
                continue  # border points join a cluster but do not extend it
            for k in np.nonzero(neighbours[j] & (labels == -1))[0]:
                labels[k] = cluster
                frontier.append(k)
        cluster += 1
    out_boxes = np.zeros((cluster, 4), np.float32)
    out_scores = np.zeros(cluster, np.float32)
    for c in range(cluster):
        members = labels == c
        w = scores[members]
        out_boxes[c] = (boxes[members] * w[:, None]).sum(axis=0) / w.sum()
        out_scores[c] = w.max()
    order = np.argsort(-out_scores, kind="stable")
    return out_boxes[order], out_scores[order]


__all__ = ["cell_boxes", "dbscan_cluster", "iou_matrix", "nms"]
