"""Benchmark: compare's paired bootstrap on a weak model's detections, before and after (issue 55, item 5).

    python bench/bootstrap_speed.py [--images 1000] [--classes 10] [--detections 100] [--resamples 1000]

A synthetic val set as a weak detector leaves it: `--images` images with 0-8 objects of `--classes` classes, and
`--detections` detections per image (the decoder's max_detections): a few jittered boxes on the objects (some of
the wrong class, some far off) and the rest stray low-score boxes, scores rounded to two decimals (ties). It is
matched once with pycocotools (match_detections, as compare does), then scored under `--resamples` image
resamplings (image_weights, seed 0) by the reference weighted_ap (tests/bootstrap_reference.py, the version
before the speed-up) and by metrics/bootstrap.weighted_ap; prints both times, the speed-up and whether the two
give the same numbers (bit for bit). One process; set OMP/OPENBLAS threads as you wish.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the reference implementation


def weak_detections(images: int, classes: int, per_image: int, seed: int = 0):
    """(ground truth, detections) per image, as a weakly trained detector's output."""
    from qatpipe.metrics.coco import GroundTruth
    from qatpipe.models.base import Detections

    rng = np.random.default_rng(seed)
    truth, detections = [], []
    for _ in range(images):
        count = int(rng.integers(0, 9))
        corner = rng.uniform(0, 600, (count, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(12, 120, (count, 2))], axis=1)
        labels = rng.integers(0, classes, count)
        truth.append(GroundTruth(boxes.astype(np.float32), labels.astype(np.int32)))
        near = min(per_image, 3 * count)  # a few boxes on each object, jittered: some match, some do not
        source = rng.integers(0, max(count, 1), near)
        size = (boxes[source, 2:] - boxes[source, :2]) if count else np.zeros((0, 2))
        near_boxes = boxes[source] + rng.normal(0, 0.25, (near, 4)) * np.concatenate([size, size], axis=1)
        near_labels = np.where(rng.random(near) < 0.7, labels[source], rng.integers(0, classes, near))
        near_scores = rng.beta(2, 3, near)
        stray = per_image - near  # the rest: anywhere, mostly low scores
        corner = rng.uniform(0, 600, (stray, 2))
        stray_boxes = np.concatenate([corner, corner + rng.uniform(12, 120, (stray, 2))], axis=1)
        found = np.concatenate([near_boxes, stray_boxes]).astype(np.float32)
        scores = np.round(np.concatenate([near_scores, rng.beta(1, 6, stray)]), 2).astype(np.float32)
        detections.append(Detections(found, scores, np.concatenate(
            [near_labels, rng.integers(0, classes, stray)]).astype(np.int32)))
    return truth, detections


def timed(function, *args):
    """(result, (wall seconds, this process's CPU seconds)): the CPU time reads truer on a shared machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = function(*args)
    return result, (time.perf_counter() - wall, time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--detections", type=int, default=100, help="per image")
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--skip-reference", action="store_true", help="time only the current weighted_ap")
    args = parser.parse_args()

    from bootstrap_reference import reference_weighted_ap

    from qatpipe.devices import cpu_name
    from qatpipe.metrics.bootstrap import image_weights, match_detections, weighted_ap
    from qatpipe.metrics.coco import coco_ground_truth, coco_results

    truth, detections = weak_detections(args.images, args.classes, args.detections)
    names = [f"class{k}" for k in range(args.classes)]
    started = time.perf_counter()
    matched = match_detections(coco_ground_truth(truth, names), coco_results(detections))
    matching = time.perf_counter() - started
    kept = sum(len(found.image) for found in matched.classes)
    tps = int(sum(found.tp[0].sum() for found in matched.classes))
    print(f"CPU: {cpu_name()}")
    print(f"{args.images} images, {args.classes} classes, {int(matched.gt_counts.sum())} objects, "
          f"{sum(len(d) for d in detections)} detections ({kept} up to each class's last true positive, "
          f"{tps} true positives at IoU 0.5); matched in {matching:.1f} s")
    weights = image_weights(args.images, args.resamples, seed=0)
    plain = weighted_ap(matched, np.ones((1, args.images)))
    print(f"mAP@0.5 {np.nanmean(plain[0, 0]):.4f}, mAP@[.5:.95] {np.nanmean(plain[0].mean(axis=0)):.4f}")

    new, after = timed(weighted_ap, matched, weights)
    if args.skip_reference:
        print(f"{args.resamples} resamples: weighted_ap {after[0]:.2f} s (CPU {after[1]:.2f} s)")
        return
    old, before = timed(reference_weighted_ap, matched, weights)
    same = np.array_equal(old, new, equal_nan=True)
    print(f"{args.resamples} resamples: before {before[0]:.2f} s (CPU {before[1]:.2f} s), after {after[0]:.2f} s "
          f"(CPU {after[1]:.2f} s): {before[0] / after[0]:.1f}x; the same numbers bit for bit: {same}"
          + ("" if same else f" (largest difference {np.nanmax(np.abs(old - new)):.3g})"))


if __name__ == "__main__":
    main()
