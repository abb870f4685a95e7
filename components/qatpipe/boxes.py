"""Box maths in NumPy, shared by the detectors' decoders and the metrics: IoU, non-maximum suppression, TAO's DBSCAN
clustering, the boxes a grid head's cells predict, and SSD's prior boxes with their offset encoding. No
TensorFlow here, so that metrics/ and the decoders run wherever NumPy does (models/ssd.py mirrors `encode_offsets`
in TensorFlow for the tf.data targets, and models/decoding.py as ONNX ops)."""

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


# ------------------------------------------------------------------------------------------------- SSD


# An engine that runs SSD's NMS itself (engines/tensorrt_backend.py) outputs its results instead of the heads:
# NMS_INDICES (K, 3) int32 rows of (image in the batch, class id without the background, prior), best first within
# each image; NMS_BOXES (K, 4) their boxes, x1 y1 x2 y2 as fractions of the image; NMS_SCORES (K,) their scores;
# NMS_IMAGES (N,) each image's highest class score before NMS, which carries the batch size (an image may keep
# nothing). models/ssd.py's decode reads either form.
NMS_INDICES, NMS_BOXES, NMS_SCORES, NMS_IMAGES = "nms_indices", "nms_boxes", "nms_scores", "nms_image_scores"


def prior_boxes(image_hw: tuple[int, int], map_hws: list[tuple[int, int]], scales: list[float],
                ratios: list[list[float]], two_boxes_for_ar1: bool, clip: bool) -> np.ndarray:
    """SSD's priors (P, 4) as centre x, centre y, width, height, fractions of the image: map by map, cell by cell
    (row-major), then per aspect ratio (the second ar-1 box right after the first), the order of the heads'
    reshaped outputs. A prior of map k is scales[k] x the image's shorter side, w/h = the ratio; the second
    ar-1 box is sqrt(scales[k] x scales[k+1]) (TAO, Liu et al. 2016)."""
    height, width = image_hw
    side = min(height, width)
    out = []
    for k, (map_h, map_w) in enumerate(map_hws):
        sizes = []  # (w, h) in pixels of each prior of one cell
        for ratio in ratios[k]:
            sizes.append((scales[k] * side * np.sqrt(ratio), scales[k] * side / np.sqrt(ratio)))
            if ratio == 1.0 and two_boxes_for_ar1:
                extra = np.sqrt(scales[k] * scales[k + 1]) * side
                sizes.append((extra, extra))
        wh = np.array(sizes, np.float64) / [width, height]
        cy, cx = np.meshgrid((np.arange(map_h) + 0.5) / map_h, (np.arange(map_w) + 0.5) / map_w, indexing="ij")
        centres = np.stack([cx.ravel(), cy.ravel()], axis=1)  # (cells, 2)
        cells = np.concatenate([np.repeat(centres, len(wh), axis=0), np.tile(wh, (len(centres), 1))], axis=1)
        out.append(cells)
    priors = np.concatenate(out).astype(np.float32)
    if clip:
        priors = corners_to_centres(np.clip(centres_to_corners(priors), 0.0, 1.0))
    return priors


def priors_per_cell(ratios: list[float], two_boxes_for_ar1: bool) -> int:
    return len(ratios) + (1 if two_boxes_for_ar1 and 1.0 in ratios else 0)


def centres_to_corners(boxes: np.ndarray) -> np.ndarray:
    """cx cy w h -> x1 y1 x2 y2 (last axis)."""
    half = boxes[..., 2:] / 2
    return np.concatenate([boxes[..., :2] - half, boxes[..., :2] + half], axis=-1)


def corners_to_centres(boxes: np.ndarray) -> np.ndarray:
    """x1 y1 x2 y2 -> cx cy w h (last axis)."""
    return np.concatenate([(boxes[..., :2] + boxes[..., 2:]) / 2, boxes[..., 2:] - boxes[..., :2]], axis=-1)


def encode_offsets(boxes: np.ndarray, priors: np.ndarray, variances) -> np.ndarray:
    """Boxes (..., 4) cx cy w h against priors (..., 4) -> the offsets the box head regresses: the centre shift
    in prior sizes and the log size ratio, each divided by its variance (SSD's encoding, TAO's variances)."""
    v = np.asarray(variances, np.float32)
    return np.concatenate([(boxes[..., :2] - priors[..., :2]) / priors[..., 2:] / v[:2],
                           np.log(np.maximum(boxes[..., 2:], 1e-8) / priors[..., 2:]) / v[2:]], axis=-1)


def decode_offsets(offsets: np.ndarray, priors: np.ndarray, variances) -> np.ndarray:
    """The inverse of `encode_offsets`: offsets (..., 4) -> boxes cx cy w h."""
    v = np.asarray(variances, np.float32)
    return np.concatenate([priors[..., :2] + offsets[..., :2] * v[:2] * priors[..., 2:],
                           priors[..., 2:] * np.exp(np.clip(offsets[..., 2:] * v[2:], -10.0, 10.0))], axis=-1)


def per_class_nms(boxes: np.ndarray, scores: np.ndarray, confidence_threshold: float, top_k: int, nms_iou: float,
                  max_detections: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One image's boxes (P, 4) and class scores (P, C) -> kept boxes, scores and class ids, best first: per
    class the priors above the threshold, its top_k, greedy NMS; then the best max_detections overall."""
    kept_boxes, kept_scores, kept_classes = [], [], []
    for c in range(scores.shape[1]):
        candidates = np.nonzero(scores[:, c] > confidence_threshold)[0]
        if len(candidates) == 0:
            continue
        candidates = candidates[np.argsort(-scores[candidates, c], kind="stable")[:top_k]]
        class_boxes, class_scores = nms(boxes[candidates], scores[candidates, c], nms_iou)
        kept_boxes.append(class_boxes)
        kept_scores.append(class_scores)
        kept_classes.append(np.full(len(class_scores), c, np.int32))
    if not kept_scores:
        return np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int32)
    boxes, scores, classes = (np.concatenate(kept_boxes), np.concatenate(kept_scores), np.concatenate(kept_classes))
    order = np.argsort(-scores, kind="stable")[:max_detections]
    return boxes[order].astype(np.float32), scores[order].astype(np.float32), classes[order]


__all__ = ["NMS_BOXES", "NMS_IMAGES", "NMS_INDICES", "NMS_SCORES", "cell_boxes", "centres_to_corners",
           "corners_to_centres", "dbscan_cluster", "decode_offsets", "encode_offsets", "iou_matrix", "nms",
           "per_class_nms", "prior_boxes", "priors_per_cell"]
