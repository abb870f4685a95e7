"""Paired bootstrap confidence intervals for COCO mAP and for the mAP differences between model variants.

Resampling the val images and re-running pycocotools per replicate is too slow, so the matching is done once:
pycocotools' own per-image evaluation (COCOeval.evaluate) says, per detection and IoU threshold, whether it is
a true positive; matching in one image never depends on another. A replicate is then a vector of image
multiplicities, and AP is COCO's accumulate with those multiplicities as weights, vectorised over replicates.
On the full set (every weight 1) it is pycocotools' number.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from pycocotools.cocoeval import Params

from qatpipe.metrics.coco import coco_evaluator

DEFAULT_RESAMPLES = 1000
DEFAULT_SEED = 0
CI95_PERCENTILES = (2.5, 97.5)  # the percentile bootstrap's 95% interval ("ci95")
METRICS = ("map50", "map")  # mAP@0.5 (the first IoU threshold), mAP@[.5:.95] (the mean over all ten)
_CHUNK_ELEMENTS = 1_000_000  # replicates x IoU thresholds x detections per vectorised step (memory bound)


@dataclass(frozen=True)
class ClassMatches:
    """One class's detections over the val set, in the order COCO accumulates them (score, highest first)."""

    image: np.ndarray  # (D,) image index of each detection
    tp: np.ndarray  # (T, D) a true positive at each IoU threshold
    fp: np.ndarray  # (T, D) a false positive (neither matched nor ignored)


@dataclass(frozen=True)
class MatchedDetections:
    """A variant's detections matched against the ground truth once, ready for any image weighting."""

    classes: list[ClassMatches]
    gt_counts: np.ndarray  # (N images, K classes) ground-truth objects (not crowd)
    iou_thresholds: np.ndarray  # (T,) COCO's .50:.05:.95
    recall_thresholds: np.ndarray  # (R,) COCO's 0:.01:1
    # weighted_maps under each resampling drawn so far, by (images, resamples, seed): a variant in several
    # bootstraps (compare's engine numbers and TensorRT's) is resampled once
    replicates: dict = field(default_factory=dict, compare=False, repr=False)


def match_detections(dataset: dict, results: list[dict], max_detections: int | None = None) -> MatchedDetections:
    """Match COCO `results` (detections.json) against a COCO `dataset` (ground_truth.json, category ids 1..K as
    coco_ground_truth writes them) with pycocotools. `max_detections` per image and class as COCO's maxDets;
    None keeps them all (a decoder's file holds no more than its limit, which is what the evaluation used).
    Ground truth counts unless it is a crowd (COCO's area range "all" excludes nothing else)."""
    image_index = {image_id: i for i, image_id in enumerate(sorted(image["id"] for image in dataset["images"]))}
    gt_counts = np.zeros((len(image_index), len(dataset["categories"])), np.int64)
    for annotation in dataset["annotations"]:
        if not annotation.get("iscrowd"):
            gt_counts[image_index[annotation["image_id"]], annotation["category_id"] - 1] += 1
    if not results:  # pycocotools cannot load an empty result list
        params = Params(iouType="bbox")
        classes = [_accumulation_order([], [], [], [], len(params.iouThrs))] * gt_counts.shape[1]
        return MatchedDetections(classes, gt_counts, params.iouThrs, params.recThrs)

    if max_detections is None:
        max_detections = max(Counter((r["image_id"], r["category_id"]) for r in results).values())
    evaluator = coco_evaluator(dataset, results, max_detections, area_ranges=False)  # the bootstrap reads "all"
    params = evaluator.params
    areas, images, thresholds = len(params.areaRng), len(params.imgIds), len(params.iouThrs)
    all_areas = params.areaRngLbl.index("all")
    classes = []
    for k in range(len(params.catIds)):  # evalImgs: category, then area range, then image (sorted ids)
        first = (k * areas + all_areas) * images
        image, scores, matched, ignored = [], [], [], []
        for i, e in enumerate(evaluator.evalImgs[first:first + images]):
            if e is None:  # neither ground truth nor detections
                continue
            image.append(np.full(len(e["dtScores"]), i))
            scores.append(np.asarray(e["dtScores"], float))
            matched.append(e["dtMatches"].reshape(thresholds, -1) > 0)  # the matched ground truth's id, or 0
            ignored.append(e["dtIgnore"].reshape(thresholds, -1).astype(bool))
        classes.append(_accumulation_order(image, scores, matched, ignored, thresholds))
    return MatchedDetections(classes, gt_counts, params.iouThrs, params.recThrs)


def _accumulation_order(image, scores, matched, ignored, thresholds: int) -> ClassMatches:
    if not image:
        return ClassMatches(np.zeros(0, np.int64), np.zeros((thresholds, 0), bool), np.zeros((thresholds, 0), bool))
    # as COCOeval.accumulate: per-image lists concatenated in image order, then a stable sort by score
    order = np.argsort(-np.concatenate(scores), kind="mergesort")
    matched, ignored = np.concatenate(matched, axis=1)[:, order], np.concatenate(ignored, axis=1)[:, order]
    tp, fp = matched & ~ignored, ~matched & ~ignored
    # past the last true positive precision only falls and recall stays: those detections change no AP
    hits = np.nonzero(tp.any(axis=0))[0]
    end = hits[-1] + 1 if len(hits) else 0
    return ClassMatches(np.concatenate(image)[order][:end], tp[:, :end], fp[:, :end])


def weighted_ap(matched: MatchedDetections, weights: np.ndarray) -> np.ndarray:
    """AP per image weighting, IoU threshold and class: (B, T, K), NaN for a class without ground truth.
    `weights` (B, N): how many times each image counts (all ones: the plain evaluation).

    COCO's accumulate on every detection, read only where it can change the answer: recall moves only at a true
    positive, and precision only falls between true positives, so the monotone precision that each recall
    threshold reads is the one at a true positive (or past the end: 0). The checkpoints are the detections that
    some IoU threshold does not count as a false positive (true positives, ignored ones); a weak detector has
    few among many detections. The false positives' weight up to a checkpoint is all detections' weight there
    less the checkpoints'; all detections' weight is the weights times a sparse (images x checkpoints) count of
    the detections since the checkpoint before, summed up: one product per class, not a running sum over every
    detection per IoU threshold. For integer weights (image multiplicities) every sum is an exact integer, so
    the numbers are COCO's accumulate's bit for bit."""
    from scipy.sparse import csr_array

    weights = np.asarray(weights, float)
    recall_thresholds = matched.recall_thresholds
    points, ious = len(recall_thresholds), len(matched.iou_thresholds)
    objects = weights @ matched.gt_counts  # (B, K)
    ap = np.full((len(weights), ious, len(matched.classes)), np.nan)
    for k, found in enumerate(matched.classes):
        checkpoints = np.nonzero(~found.fp.all(axis=0))[0]  # (P,) some threshold's true positive or ignored
        tp_at, counted_at = found.tp[:, checkpoints], ~found.fp[:, checkpoints]  # (T, P)
        # (N, P): detections of each image after the checkpoint before and up to this one (false positives past
        # the last checkpoint change no AP; match_detections leaves none)
        image = found.image[:checkpoints[-1] + 1 if len(checkpoints) else 0]
        since = csr_array((np.ones(len(image)), (image, np.searchsorted(checkpoints, np.arange(len(image))))),
                          shape=(weights.shape[1], len(checkpoints)))
        chunk = max(1, _CHUNK_ELEMENTS // max(1, ious * len(checkpoints)))
        for start in range(0, len(weights), chunk):
            every = np.cumsum(weights[start:start + chunk] @ since, axis=1)[:, None, :]  # (b, 1, P)
            w = weights[start:start + chunk, found.image[checkpoints]][:, None, :]  # (b, 1, P)
            tp = np.cumsum(w * tp_at, axis=2)
            fp = every - np.cumsum(w * counted_at, axis=2)
            n = objects[start:start + chunk, k][:, None, None]
            with np.errstate(divide="ignore", invalid="ignore"):  # rows without ground truth: NaN, dropped
                recall = tp / n
            precision = tp / (fp + tp + np.spacing(1))
            # precision made monotone (the highest to its right), then 0 past the last detection
            precision = np.maximum.accumulate(precision[..., ::-1], axis=2)[..., ::-1]
            precision = np.concatenate([precision, np.zeros(precision.shape[:2] + (1,))], axis=2)
            # COCO takes, per recall threshold r, the first detection with recall >= r
            # (np.searchsorted(recall, thresholds, side='left')): the number of checkpoints with recall < r
            below = np.searchsorted(recall_thresholds, recall, side="right")  # thresholds <= each recall
            rows = np.arange(below.shape[0] * below.shape[1]).reshape(below.shape[:2] + (1,))
            counts = np.bincount((below + rows * (points + 1)).ravel(), minlength=rows.size * (points + 1))
            first = counts.reshape(below.shape[:2] + (points + 1,)).cumsum(axis=2)[..., :points]
            mean_precision = np.take_along_axis(precision, first, axis=2).mean(axis=2)  # (b, T)
            has_objects = objects[start:start + chunk, k] > 0
            ap[start:start + chunk, :, k] = np.where(has_objects[:, None], mean_precision, np.nan)
    return ap


def weighted_maps(matched: MatchedDetections, weights: np.ndarray) -> dict[str, np.ndarray]:
    """{"map50": (B,), "map": (B,)}: COCO's stats[1] (IoU 0.5, the first threshold) and stats[0] (all ten) per
    image weighting, means over the classes with ground truth (NaN when none has any)."""
    ap = weighted_ap(matched, weights)
    counted = ~np.isnan(ap[:, 0, :])  # (B, K): the classes with ground truth
    with np.errstate(invalid="ignore"):
        return {metric: np.where(counted, per_class, 0.0).sum(axis=1) / counted.sum(axis=1)
                for metric, per_class in (("map50", ap[:, 0, :]), ("map", ap.mean(axis=1)))}


def image_weights(num_images: int, resamples: int, seed: int) -> np.ndarray:
    """(resamples, num_images): each row how often each image is drawn when drawing num_images with
    replacement."""
    drawn = np.random.default_rng(seed).integers(0, num_images, size=(resamples, num_images))
    rows = np.arange(resamples)[:, None] * num_images
    return np.bincount((drawn + rows).ravel(), minlength=resamples * num_images).reshape(resamples, num_images)


def paired_bootstrap(variants: dict[str, MatchedDetections], pairs: Sequence[tuple[str, str]],
                     resamples: int = DEFAULT_RESAMPLES, seed: int = DEFAULT_SEED) -> dict:
    """Percentile bootstrap over the val images, the same resampled image sets for every variant (paired).

    Returns {"resamples", "seed", "images", "variants": {name: {metric: {"value", "ci95": [lo, hi]}}},
    "pairs": {"a-b": {metric: {"diff": a - b, "ci95": [lo, hi]}}}} for metric in map50, map; values and
    differences on the full set."""
    sizes = {name: m.gt_counts.shape for name, m in variants.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"the variants were not evaluated on the same images and classes: {sizes}")
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, not {resamples}")
    num_images = next(iter(sizes.values()))[0]
    point = {name: weighted_maps(m, np.ones((1, num_images))) for name, m in variants.items()}
    drawn = (num_images, resamples, seed)
    if any(drawn not in m.replicates for m in variants.values()):
        weights = image_weights(num_images, resamples, seed)
        for m in variants.values():  # a MatchedDetections under several names: resampled once
            if drawn not in m.replicates:
                m.replicates[drawn] = weighted_maps(m, weights)
    replicates = {name: m.replicates[drawn] for name, m in variants.items()}

    def interval(values: np.ndarray) -> list[float]:
        return [float(v) for v in np.nanpercentile(values, CI95_PERCENTILES)]

    return {
        "resamples": resamples, "seed": seed, "images": num_images,
        "variants": {name: {metric: {"value": float(point[name][metric][0]),
                                     "ci95": interval(replicates[name][metric])} for metric in METRICS}
                     for name in variants},
        "pairs": {f"{a}-{b}": {metric: {"diff": float(point[a][metric][0] - point[b][metric][0]),
                                        "ci95": interval(replicates[a][metric] - replicates[b][metric])}
                               for metric in METRICS}
                  for a, b in pairs},
    }


__all__ = ["match_detections", "weighted_ap", "weighted_maps", "image_weights", "paired_bootstrap",
           "MatchedDetections", "ClassMatches", "DEFAULT_RESAMPLES", "DEFAULT_SEED", "CI95_PERCENTILES",
           "METRICS"]
