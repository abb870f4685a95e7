"""The vectorised COCO AP behind the bootstrap against pycocotools, and the paired bootstrap on cases whose
answer is known."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
from bootstrap_reference import reference_weighted_ap
from conftest import random_evaluation
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval, Params

from qatpipe.metrics.bootstrap import (ClassMatches, MatchedDetections, image_weights, match_detections,
                                       paired_bootstrap, weighted_ap, weighted_maps)
from qatpipe.metrics.coco import GroundTruth, coco_ground_truth, coco_results, evaluate_detections
from qatpipe.models.base import Detections

CLASSES = ["car", "pedestrian", "cyclist"]


def _pycocotools(dataset: dict, results: list[dict]) -> tuple[float, float]:
    """Plain pycocotools, defaults and all: (stats[1], stats[0]) = (mAP@0.5, mAP@[.5:.95])."""
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO()
        truth.dataset = dataset
        truth.createIndex()
        evaluator = COCOeval(truth, truth.loadRes(results), iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator.stats[1], evaluator.stats[0]


def _full_set(matched) -> tuple[float, float]:
    maps = weighted_maps(matched, np.ones((1, matched.gt_counts.shape[0])))
    return maps["map50"][0], maps["map"][0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_ap_on_the_full_set_is_pycocotools(seed):
    truth, detections = random_evaluation(seed)
    dataset, results = coco_ground_truth(truth, CLASSES), coco_results(detections)
    expected = _pycocotools(dataset, results)
    assert expected[0] > 0.05 and expected[1] > 0.02  # a case with something to get right
    assert _full_set(match_detections(dataset, results)) == pytest.approx(expected, abs=1e-9)


def test_fast_ap_keeps_cocos_per_image_detection_limit():
    truth, detections = random_evaluation(3, max_detections=30)
    dataset, results = coco_ground_truth(truth, CLASSES), coco_results(detections)
    limited = evaluate_detections(truth, detections, CLASSES, max_detections=3)
    assert limited.map50 < evaluate_detections(truth, detections, CLASSES).map50  # the limit matters here
    assert _full_set(match_detections(dataset, results, max_detections=3)) == pytest.approx(
        (limited.map50, limited.map), abs=1e-9)


def test_a_replicate_is_the_evaluation_of_its_resampled_images():
    # pycocotools on a data set where each image appears as often as a replicate draws it
    truth, detections = random_evaluation(4, images=25)
    rng = np.random.default_rng(11)
    for det in detections:  # distinct scores: copies of one detection are then the only ties
        det.scores = rng.random(len(det)).astype(np.float32)
    assert len({float(s) for det in detections for s in det.scores}) == sum(len(det) for det in detections)
    weights = image_weights(len(truth), resamples=1, seed=7)[0]
    assert weights.max() > 1 and (weights == 0).any()
    drawn = [i for i, times in enumerate(weights) for _ in range(times)]
    expected = _pycocotools(coco_ground_truth([truth[i] for i in drawn], CLASSES),
                            coco_results([detections[i] for i in drawn]))
    matched = match_detections(coco_ground_truth(truth, CLASSES), coco_results(detections))
    maps = weighted_maps(matched, weights[None, :])
    assert (maps["map50"][0], maps["map"][0]) == pytest.approx(expected, abs=1e-9)


def test_image_weights_are_seeded_draws_with_replacement():
    weights = image_weights(50, resamples=200, seed=3)
    assert weights.shape == (200, 50) and (weights.sum(axis=1) == 50).all()
    assert (weights == image_weights(50, resamples=200, seed=3)).all()
    assert (weights != image_weights(50, resamples=200, seed=4)).any()
    assert weights.mean() == pytest.approx(1.0) and (weights == 0).mean() == pytest.approx(np.exp(-1), abs=0.03)


def test_identical_variants_differ_by_exactly_zero():
    truth, detections = random_evaluation(5)
    dataset, results = coco_ground_truth(truth, CLASSES), coco_results(detections)
    result = paired_bootstrap({"a": match_detections(dataset, results), "b": match_detections(dataset, results)},
                              [("a", "b")], resamples=1000, seed=0)
    assert result["resamples"] == 1000 and result["seed"] == 0 and result["images"] == len(truth)
    for metric in ("map50", "map"):
        assert result["pairs"]["a-b"][metric] == {"diff": 0.0, "ci95": [0.0, 0.0]}
        low, high = result["variants"]["a"][metric]["ci95"]
        assert low < result["variants"]["a"][metric]["value"] < high  # a real interval for each variant


def _two_objects_per_image(images: int) -> list[GroundTruth]:
    return [GroundTruth(np.array([[10, 10, 60, 60], [100 + i, 100, 160 + i, 150]], np.float32),
                        np.array([0, i % 2], np.int32)) for i in range(images)]


def test_a_variant_better_on_every_image_has_a_ci_above_zero():
    truth = _two_objects_per_image(30)
    perfect = [Detections(gt.boxes, np.array([0.9, 0.8], np.float32), gt.classes) for gt in truth]
    # finds one of the two objects and adds a false positive, in every image
    half = [Detections(np.array([gt.boxes[0], [300, 300, 340, 340]], np.float32), np.array([0.9, 0.95], np.float32),
                       gt.classes[:1].repeat(2)) for gt in truth]
    dataset = coco_ground_truth(truth, CLASSES)
    variants = {name: match_detections(dataset, coco_results(dets))
                for name, dets in (("good", perfect), ("poor", half), ("blind", [Detections() for _ in truth]))}
    result = paired_bootstrap(variants, [("good", "poor"), ("poor", "good"), ("poor", "blind")], resamples=1000,
                              seed=1)
    poor = evaluate_detections(truth, half, CLASSES)
    for metric, expected in (("map50", 1.0 - poor.map50), ("map", 1.0 - poor.map)):
        better = result["pairs"]["good-poor"][metric]
        assert better["diff"] == pytest.approx(expected, abs=1e-9) and better["diff"] > 0.1
        assert 0 < better["ci95"][0] <= better["diff"] <= better["ci95"][1]
        worse = result["pairs"]["poor-good"][metric]
        assert worse["diff"] == pytest.approx(-expected, abs=1e-9) and worse["ci95"][1] < 0
        assert result["pairs"]["poor-blind"][metric]["ci95"][0] > 0  # no detections: AP 0 in every replicate
        assert result["variants"]["blind"][metric] == {"value": 0.0, "ci95": [0.0, 0.0]}


def test_variants_on_different_images_are_refused():
    first, second = random_evaluation(6, images=10), random_evaluation(6, images=12)
    matched = [match_detections(coco_ground_truth(t, CLASSES), coco_results(d)) for t, d in (first, second)]
    with pytest.raises(ValueError, match="not evaluated on the same images"):
        paired_bootstrap({"a": matched[0], "b": matched[1]}, [("a", "b")])


def _random_matches(rng, images: int, classes: int, thresholds: int = 10) -> MatchedDetections:
    """Matches as no detector makes them, to reach every branch: per class any number of detections (none, all
    false positives, false positives past the last true positive), each true positive, false positive or
    ignored at each IoU threshold independently, a class without ground truth, images without objects."""
    params = Params(iouType="bbox")
    found = []
    for k in range(classes):
        count = int(rng.choice([0, 1, 3, 40, 400]))
        kind = rng.choice(3, size=(thresholds, count), p=rng.dirichlet(np.ones(3)))  # 0 tp, 1 fp, 2 ignored
        found.append(ClassMatches(rng.integers(0, images, count), kind == 0, kind == 1))
    gt_counts = rng.integers(0, 3, (images, classes)) * (rng.random((images, 1)) < 0.8)
    gt_counts[:, rng.integers(0, classes)] = 0
    return MatchedDetections(found, gt_counts, params.iouThrs[:thresholds], params.recThrs)


@pytest.mark.parametrize("seed", range(6))
def test_weighted_ap_is_the_reference_bit_for_bit(seed):
    """The checkpoint form of COCO's accumulate gives the former implementation's numbers exactly (the
    reference, tests/bootstrap_reference.py) under integer image weights: resamplings, zero and large weights."""
    rng = np.random.default_rng(seed)
    matched = _random_matches(rng, images=60, classes=5)
    weights = np.concatenate([image_weights(60, 50, seed), np.ones((1, 60)), np.zeros((1, 60)),
                              rng.integers(0, 1000, (3, 60))])
    new, old = weighted_ap(matched, weights), reference_weighted_ap(matched, weights)
    assert np.isnan(old).any() and (old[~np.isnan(old)] > 0).any()  # classes without objects, and real APs
    assert np.array_equal(new, old, equal_nan=True)
    fractional = rng.random((4, 60)) * 3  # not multiplicities: the sums are summed in another order
    assert np.allclose(weighted_ap(matched, fractional), reference_weighted_ap(matched, fractional), rtol=0,
                       atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("seed", [0, 7])
def test_the_bootstrap_over_detector_matches_is_the_reference(seed):
    """The same on pycocotools' matching of detector-like output (ties in score, wrong classes)."""
    truth, detections = random_evaluation(seed, images=80, classes=4, max_detections=30)
    matched = match_detections(coco_ground_truth(truth, CLASSES + ["truck"]), coco_results(detections))
    weights = image_weights(len(truth), resamples=300, seed=seed)
    assert np.array_equal(weighted_ap(matched, weights), reference_weighted_ap(matched, weights), equal_nan=True)
