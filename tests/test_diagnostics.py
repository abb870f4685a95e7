"""The learning check (metrics/diagnostics.py): hand-made detections whose answer is known, then the evaluate stage
on a trained tiny detector and on the same detector with its class channels shuffled."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from qatpipe.metrics.coco import GroundTruth
from qatpipe.metrics.diagnostics import (
    CLASSES_NOT_LEARNED, LOSS_PLATEAU, MIN_FOUND_OBJECTS, check_learning, class_agnostic_map50, class_confusion,
    findings_tags, loss_plateau, plateau_findings,
)
from qatpipe.metrics.report import evaluation_markdown
from qatpipe.models.base import Detections

CLASSES = ["car", "pedestrian", "cyclist"]


def gt(boxes, classes):
    return GroundTruth(np.array(boxes, np.float32).reshape(-1, 4), np.array(classes, np.int32))


def det(boxes, scores, classes):
    return Detections(np.array(boxes, np.float32).reshape(-1, 4), np.array(scores, np.float32),
                      np.array(classes, np.int32))


def grid_scene(count: int, classes_of):
    """`count` images with one object each (class i % 3) and one detection exactly on it, named classes_of(i)."""
    truth = [gt([[10, 10, 60, 60]], [i % 3]) for i in range(count)]
    found = [det([[10, 10, 60, 60]], [0.9], [classes_of(i)]) for i in range(count)]
    return truth, found


def test_confusion_takes_the_best_overlapping_detection_of_any_class_or_missed():
    truth = [gt([[0, 0, 40, 40], [100, 100, 140, 140], [200, 0, 240, 40]], [0, 1, 2])]
    found = [det([
        [0, 0, 40, 40],      # car object: pedestrian at 0.6 ...
        [2, 2, 40, 40],      # ... and car at 0.9 (IoU 0.90): the better one wins
        [100, 100, 140, 140],  # pedestrian object, found as cyclist
        [200, 0, 260, 60],   # cyclist object: IoU 0.44 < 0.5, so missed
    ], [0.6, 0.9, 0.5, 0.99], [1, 0, 2, 2])]
    matrix = class_confusion(truth, found, 3)
    assert matrix.tolist() == [[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]

    check = check_learning(truth, found, CLASSES, map50=0.3)
    assert check.num_objects == 3 and check.found_objects == 2
    assert check.class_accuracy == pytest.approx(0.5)
    assert check.per_class_accuracy == {"car": 1.0, "pedestrian": 0.0, "cyclist": None}
    assert check.chance == pytest.approx(1 / 3) and check.majority_rate == pytest.approx(0.5)
    assert check.findings == []  # 2 found objects say nothing about classes


def test_class_agnostic_map_ignores_the_names_and_merges_an_object_named_twice():
    truth = [gt([[10, 10, 50, 50]], [0]), gt([[20, 20, 80, 80]], [1])]
    wrong = [det([[10, 10, 50, 50]], [0.9], [2]), det([[20, 20, 80, 80]], [0.7], [2])]
    assert class_agnostic_map50(truth, wrong) == pytest.approx(1.0)
    # the first object also named "pedestrian" at 0.8, ranked above the second object's hit: unmerged, that
    # duplicate would be a false positive between two hits (AP 0.83)
    twice = [det([[10, 10, 50, 50], [11, 11, 50, 50]], [0.9, 0.8], [0, 1]), det([[20, 20, 80, 80]], [0.7], [1])]
    assert class_agnostic_map50(truth, twice) == pytest.approx(1.0)
    missing = [det([[10, 10, 50, 50]], [0.9], [0]), Detections()]
    assert class_agnostic_map50(truth, missing) == pytest.approx(0.5, abs=0.01)


def test_wrong_classes_are_found_out_and_right_ones_pass():
    count = MIN_FOUND_OBJECTS + 1
    truth, shifted = grid_scene(count, lambda i: (i + 1) % 3)  # every object found, named as the next class
    check = check_learning(truth, shifted, CLASSES, map50=0.0)
    assert check.class_agnostic_map50 == pytest.approx(1.0) and check.class_accuracy == 0.0
    [finding] = check.findings
    assert finding.code == CLASSES_NOT_LEARNED
    assert finding.message.startswith("the model finds objects but cannot tell their classes")
    assert "class-aware mAP@0.5 0.000 is under 0.5 x the class-agnostic 1.000" in finding.message
    assert "names its class right 0.0% of the time, close to or below chance (33.3%" in finding.message
    assert "too few epochs" in finding.message

    truth, right = grid_scene(count, lambda i: i % 3)
    check = check_learning(truth, right, CLASSES, map50=1.0)
    assert check.class_accuracy == 1.0 and check.findings == []


def test_accuracy_is_judged_against_naming_the_most_common_class():
    # 25 objects, 20 of them cars, every one called a car: 80% right, above 1/3 but no better than the prior
    truth = [gt([[10, 10, 60, 60]], [0 if i < 20 else 1]) for i in range(25)]
    found = [det([[10, 10, 60, 60]], [0.9], [0]) for _ in range(25)]
    check = check_learning(truth, found, CLASSES, map50=0.5)  # AP: car 1.0, pedestrian 0.0
    assert check.class_accuracy == pytest.approx(0.8) and check.majority_rate == pytest.approx(0.8)
    assert [f.code for f in check.findings] == [CLASSES_NOT_LEARNED]
    assert "right 80.0% of the time, close to or below chance (80.0%" in check.findings[0].message
    assert "class-aware" not in check.findings[0].message  # 0.5 against 1.0: not under half


def test_no_class_finding_when_the_model_finds_nothing_much_or_has_one_class():
    truth = [gt([[10, 10, 60, 60]], [i % 3]) for i in range(30)]
    nothing = [Detections() for _ in truth]
    check = check_learning(truth, nothing, CLASSES, map50=0.0)
    assert check.class_agnostic_map50 == 0.0 and check.class_accuracy is None and check.findings == []

    truth, found = grid_scene(30, lambda i: 0)
    single = [GroundTruth(t.boxes, np.zeros(1, np.int32)) for t in truth]
    assert check_learning(single, found, ["object"], map50=1.0).findings == []


def test_loss_plateau_with_a_low_map_speaks_up():
    flat = [2.0, 1.2, 1.0, 0.999, 0.998, 0.997]
    assert loss_plateau(flat) == pytest.approx(0.003)
    [finding] = plateau_findings(flat, val_map50=0.12)
    assert finding.code == LOSS_PLATEAU and "stopped falling (+0.3% over the last 3 epochs)" in finding.message
    assert plateau_findings(flat, val_map50=0.8) == []  # flat because it has learned
    assert plateau_findings([2.0, 1.5, 1.2, 1.0, 0.9, 0.8], val_map50=0.12) == []  # still falling
    assert loss_plateau([1.0, 0.9, 0.9]) is None and plateau_findings([1.0, 0.9, 0.9], 0.0) == []


def test_findings_become_tags_and_markdown():
    truth, shifted = grid_scene(MIN_FOUND_OBJECTS, lambda i: (i + 1) % 3)
    check = check_learning(truth, shifted, CLASSES, map50=0.0)
    tags = findings_tags(check.findings)
    assert tags["qatpipe.findings"] == CLASSES_NOT_LEARNED
    assert tags[f"qatpipe.finding.{CLASSES_NOT_LEARNED}"] == check.findings[0].message
    assert findings_tags([]) == {"qatpipe.findings": "none"}

    result = {"map50": 0.0, "map": 0.0, "diagnostics": check.to_dict(),
              "per_class": {name: {"num_gt": 7, "ap50": 0.0, "ap": None} for name in CLASSES}}
    text = evaluation_markdown("qat", result)
    assert text.startswith("# qat: mAP@0.5 0.0000, mAP@[.5:.95] 0.0000")
    assert "| car | 7 | 0.0000 | n/a | 0.000 |" in text
    assert "| class | car | pedestrian | cyclist | missed |" in text and "| car | 0 | 7 | 0 | 0 |" in text
    assert f"**Warning:** {check.findings[0].message}" in text
    result["diagnostics"]["findings"] = []
    assert "No findings." in evaluation_markdown("qat", result)


def shuffle_class_channels(model, shift: int = 1):
    """Output channel c of the coverage and bbox heads computes what channel c+shift did: every object is
    found, with a good box, under the next class's name."""
    num_classes = model.get_layer("conv_cov").get_weights()[1].shape[0]
    order = np.roll(np.arange(num_classes), -shift)
    kernel, bias = model.get_layer("conv_cov").get_weights()
    model.get_layer("conv_cov").set_weights([kernel[..., order], bias[order]])
    bbox_order = (4 * order[:, None] + np.arange(4)).ravel()
    kernel, bias = model.get_layer("conv_bbox").get_weights()
    model.get_layer("conv_bbox").set_weights([kernel[..., bbox_order], bias[bbox_order]])
    return model


@pytest.mark.slow
def test_evaluate_speaks_up_on_shuffled_classes_and_stays_quiet_on_the_trained_model(trained_tiny, tmp_path,
                                                                                     caplog):
    import tf_keras as keras

    from qatpipe.stages.evaluate import evaluate
    from qatpipe.tracking.records import StageRecord

    spec, model_path = trained_tiny
    with caplog.at_level(logging.WARNING):
        good = evaluate(spec, model_path, tmp_path / "good")
    assert good["diagnostics"]["findings"] == [] and "cannot tell their classes" not in caplog.text
    assert good["diagnostics"]["class_accuracy"] > 0.7
    record = StageRecord.read(tmp_path / "good")
    assert record.tags == {"qatpipe.findings": "none"}
    assert record.metrics["class_accuracy"] == good["diagnostics"]["class_accuracy"]

    shuffled_path = tmp_path / "shuffled.keras"
    shuffle_class_channels(keras.models.load_model(model_path, compile=False)).save(shuffled_path)
    with caplog.at_level(logging.WARNING):
        bad = evaluate(spec, shuffled_path, tmp_path / "bad")
    diagnostics = json.loads((tmp_path / "bad" / "metrics.json").read_text())["diagnostics"]
    # boxes are as good as before: the class-agnostic score hardly moves, the classes are all wrong
    assert diagnostics["class_agnostic_map50"] == pytest.approx(good["diagnostics"]["class_agnostic_map50"], abs=0.05)
    assert diagnostics["class_accuracy"] < 0.2 and bad["map50"] < 0.5 * good["map50"]
    [finding] = diagnostics["findings"]
    assert finding["code"] == CLASSES_NOT_LEARNED
    assert "is under 0.5 x the class-agnostic" in finding["message"] and "below chance" in finding["message"]
    assert "shuffled.keras: the model finds objects but cannot tell their classes" in caplog.text
    record = StageRecord.read(tmp_path / "bad")
    assert record.tags["qatpipe.findings"] == CLASSES_NOT_LEARNED
    assert record.metrics["class_agnostic_map50"] == diagnostics["class_agnostic_map50"]
