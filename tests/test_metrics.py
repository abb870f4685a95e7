"""mAP through pycocotools on hand-built cases whose answer is known."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
from conftest import random_evaluation
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from qatpipe.metrics.coco import GroundTruth, evaluate_detections, mean_ap50, plot_pr_curves, write_coco_files
from qatpipe.models.base import Detections

CLASSES = ["car", "pedestrian"]


def gt(boxes, classes):
    return GroundTruth(np.array(boxes, np.float32).reshape(-1, 4), np.array(classes, np.int32))


def det(boxes, scores, classes):
    return Detections(np.array(boxes, np.float32).reshape(-1, 4), np.array(scores, np.float32),
                      np.array(classes, np.int32))


def test_perfect_detections_score_one():
    truth = [gt([[10, 10, 50, 50], [60, 60, 100, 120]], [0, 1])]
    result = evaluate_detections(truth, [det(truth[0].boxes, [0.9, 0.8], [0, 1])], CLASSES)
    assert result.map50 == pytest.approx(1.0)
    assert result.map == pytest.approx(1.0)
    assert result.per_class["car"]["ap50"] == pytest.approx(1.0)


def test_one_false_positive_between_two_hits():
    # ranked: hit (P=1, R=.5), false positive, hit (P=2/3, R=1). COCO's 101-point interpolation:
    # recall 0..0.50 (51 points) at precision 1, 0.51..1.00 (50 points) at 2/3.
    truth = [gt([[10, 10, 50, 50]], [0]), gt([[20, 20, 80, 80]], [0])]
    dets = [det([[10, 10, 50, 50], [100, 100, 140, 140]], [0.9, 0.8], [0, 0]), det([[20, 20, 80, 80]], [0.7], [0])]
    result = evaluate_detections(truth, dets, ["car"])
    expected = (51 * 1.0 + 50 * (2 / 3)) / 101
    assert result.map50 == pytest.approx(expected, abs=1e-6)
    assert result.per_class["car"]["ap50"] == pytest.approx(expected, abs=1e-6)
    recall, precision = result.pr_curves["car"]
    assert recall[0] == 0.0 and precision[0] == pytest.approx(1.0) and precision[-1] == pytest.approx(2 / 3)
    assert recall[-1] == pytest.approx(1.0) and len(recall) == 101


def test_pr_curve_ends_at_the_highest_recall_reached():
    truth = [gt([[10, 10, 50, 50], [60, 60, 100, 100]], [0, 0])]  # one of two found: recall stops at 0.5
    result = evaluate_detections(truth, [det([[10, 10, 50, 50]], [0.9], [0])], ["car"])
    recall, precision = result.pr_curves["car"]
    assert recall[-1] == pytest.approx(0.5) and min(precision) == pytest.approx(1.0)


def test_iou_threshold_sweep():
    # IoU of the detection with its box is exactly 0.64 (40x32 inside 40x40, sharing three edges):
    # counted at IoU thresholds .50 .55 .60 (3 of 10) -> AP@[.5:.95] = 0.3, AP@0.5 = 1.
    truth = [gt([[0, 0, 40, 40]], [0])]
    result = evaluate_detections(truth, [det([[0, 0, 40, 25.6]], [0.9], [0])], ["car"])
    assert result.map50 == pytest.approx(1.0)
    assert result.map == pytest.approx(0.3)


def test_wrong_class_and_missing_detections():
    truth = [gt([[10, 10, 50, 50]], [0])]
    result = evaluate_detections(truth, [det([[10, 10, 50, 50]], [0.9], [1])], CLASSES)
    assert result.map50 == pytest.approx(0.0)
    assert result.per_class["car"]["ap50"] == pytest.approx(0.0)
    assert result.per_class["pedestrian"]["ap50"] is None  # no ground truth: undefined, not zero
    empty = evaluate_detections(truth, [Detections()], CLASSES)
    assert empty.map50 == 0.0 and empty.num_detections == 0 and empty.per_class["car"]["ap50"] == 0.0


def test_mismatched_lengths_and_plot(tmp_path):
    with pytest.raises(ValueError, match="2 ground-truth images but 1"):
        evaluate_detections([gt([[0, 0, 5, 5]], [0]), gt([], [])], [Detections()], CLASSES)
    truth = [gt([[10, 10, 50, 50]], [0])]
    result = evaluate_detections(truth, [det([[10, 10, 50, 50]], [0.9], [0])], CLASSES)
    png = plot_pr_curves(result, tmp_path / "pr.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_max_detections_beyond_coco_default_count():
    # the true positive ranks 151st: it counts only when maxDets covers 151 detections per image
    truth = [gt([[0, 0, 20, 20]], [0])]
    fps = [[100 + i, 100, 110 + i, 110] for i in range(150)]
    dets = [det(fps + [[0, 0, 20, 20]], [0.9] * 150 + [0.1], [0] * 151)]
    assert evaluate_detections(truth, dets, ["car"]).map50 == pytest.approx(0.0)
    beyond = evaluate_detections(truth, dets, ["car"], max_detections=200)
    assert beyond.map50 > 0.0 and beyond.map > 0.0  # not COCO's stats[0], which counts 100 detections only


@pytest.mark.parametrize("seed", range(4))
def test_map50_alone_is_the_full_evaluations_to_the_last_bit(seed):
    """mean_ap50 evaluates at IoU 0.5 only, over every area and the largest maxDets: on detector-like cases with
    small and medium boxes, ties, wrong classes, a class without objects and more detections than the limit, it
    is evaluate_detections' mAP@0.5 exactly."""
    truth, detections = random_evaluation(seed, max_detections=30)
    for limit in (10, 100):
        full = evaluate_detections(truth, detections, ["car", "pedestrian", "cyclist"], max_detections=limit)
        assert mean_ap50(truth, detections, ["car", "pedestrian", "cyclist"], max_detections=limit) == full.map50
    nothing = [det([], [], []) for _ in truth]
    assert mean_ap50(truth, nothing, ["car", "pedestrian", "cyclist"]) == 0.0
    with pytest.raises(ValueError, match="detection lists"):
        mean_ap50(truth, detections[:-1], ["car", "pedestrian", "cyclist"])


def test_no_ground_truth_is_an_error_not_minus_one():
    with pytest.raises(ValueError, match="no ground-truth objects"):
        evaluate_detections([gt([], [])], [det([[0, 0, 5, 5]], [0.9], [0])], ["car"])


def rescore(ground_truth_file, detections_file) -> tuple[float, float]:
    """Plain pycocotools on the two files, as anyone would run it: (mAP@0.5, mAP@[.5:.95])."""
    with contextlib.redirect_stdout(io.StringIO()):
        truth = COCO(str(ground_truth_file))
        evaluator = COCOeval(truth, truth.loadRes(str(detections_file)), iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return evaluator.stats[1], evaluator.stats[0]


def test_coco_files_rescore_to_the_reported_map(tmp_path):
    truth, detections = random_evaluation(8, classes=3)
    truth = [GroundTruth(gt.boxes, gt.classes, f"{i:06d}.jpg", 640, 480) for i, gt in enumerate(truth)]
    names = ["car", "pedestrian", "cyclist"]
    write_coco_files(truth, detections, names, tmp_path / "gt.json", tmp_path / "det.json")
    metrics = evaluate_detections(truth, detections, names)
    rescored = rescore(tmp_path / "gt.json", tmp_path / "det.json")
    assert rescored == pytest.approx((metrics.map50, metrics.map), abs=1e-12) and metrics.map50 > 0.05
    dataset, results = json.loads((tmp_path / "gt.json").read_text()), json.loads((tmp_path / "det.json").read_text())
    assert dataset["images"][1] == {"id": 2, "file_name": "000001.jpg", "width": 640, "height": 480}
    assert dataset["categories"] == [{"id": 1, "name": "car"}, {"id": 2, "name": "pedestrian"},
                                     {"id": 3, "name": "cyclist"}]
    assert len(dataset["annotations"]) == sum(len(gt.classes) for gt in truth)
    assert len(results) == metrics.num_detections
    first = next(i for i, det in enumerate(detections) if len(det))  # boxes as [x, y, w, h] in image pixels
    x1, y1, x2, y2 = detections[first].boxes[0].tolist()
    assert results[0] == {"image_id": first + 1, "category_id": int(detections[first].classes[0]) + 1,
                          "bbox": pytest.approx([x1, y1, x2 - x1, y2 - y1]),
                          "score": pytest.approx(float(detections[first].scores[0]))}


@pytest.mark.slow
def test_evaluate_writes_coco_files_that_rescore_to_its_metrics(trained_tiny, tmp_path):
    from qatpipe.data.splits import load_split
    from qatpipe.metrics.report import evaluation_markdown
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.tracking.records import StageRecord

    spec, model = trained_tiny
    result = evaluate(spec, model, tmp_path, variant="fp32")
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["num_detections"] > 0
    rescored = rescore(tmp_path / "ground_truth.json", tmp_path / "detections.json")
    assert rescored == pytest.approx((saved["map50"], saved["map"]), abs=1e-12)
    samples = load_split(spec, "val")
    images = json.loads((tmp_path / "ground_truth.json").read_text())["images"]
    assert images == [{"id": i, "file_name": s.image_path.name, "width": s.width, "height": s.height}
                      for i, s in enumerate(samples, start=1)]
    assert {"detections.json", "ground_truth.json", "report.md"} <= set(StageRecord.read(tmp_path).artifacts)
    assert (tmp_path / "report.md").read_text() == evaluation_markdown("fp32", result)  # the KFP UI's report


def test_pr_curves_are_titled_with_the_variant_and_what_scored_it(tiny_spec, tmp_path, monkeypatch):
    """Every pr_curves.png used to read `model.onnx`: now the variant and the engine (or runtime) it scores."""
    from qatpipe.engines.base import EngineMetadata
    from qatpipe.export.onnx_export import export_onnx
    from qatpipe.models import get_architecture
    from qatpipe.stages import evaluate as stage
    from qatpipe.stages.build_engine import build_engine

    titles = []
    monkeypatch.setattr(stage, "plot_pr_curves", lambda metrics, path, title="": titles.append(title) or
                        plot_pr_curves(metrics, path, title=title))
    spec = tiny_spec("model.backbone.width=0.125")
    onnx_path = export_onnx(get_architecture(spec).build_model(), tmp_path / "model.onnx", 17)
    build_engine(spec, onnx_path, tmp_path / "engine", backend="onnxruntime")
    stage.evaluate(spec, onnx_path, tmp_path / "onnx", variant="fp32")
    stage.evaluate(spec, tmp_path / "engine", tmp_path / "engine_eval", variant="qat")
    stage.evaluate(spec, onnx_path, tmp_path / "plain")
    runtime = stage.scored_by(onnx_path)  # "onnxruntime cpu fp32" on a CPU build
    engine = EngineMetadata.read(tmp_path / "engine").label
    assert runtime.startswith("onnxruntime ") and runtime.endswith(" fp32") and engine.startswith("onnxruntime ")
    assert titles == [f"fp32 on {runtime}: PR @ IoU 0.5", f"qat on {engine}: PR @ IoU 0.5",
                      f"model.onnx on {runtime}: PR @ IoU 0.5"]
    assert (tmp_path / "engine_eval" / "report.md").read_text().startswith("# qat")
