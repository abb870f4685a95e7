"""Detection mAP through pycocotools: AP@0.5 (TAO/VOC-style headline), AP@[.5:.95], per class, PR curves."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from qatpipe.fileio import atomic_write_text
from qatpipe.models.base import Detections

log = logging.getLogger(__name__)


@dataclass
class GroundTruth:
    boxes: np.ndarray  # (N, 4) x1 y1 x2 y2
    classes: np.ndarray  # (N,)
    # the image, for ground_truth.json (optional: the metrics do not need it)
    file_name: str | None = None
    width: int | None = None
    height: int | None = None


@dataclass
class DetectionMetrics:
    map50: float
    map: float
    per_class: dict[str, dict[str, float | int | None]]
    num_images: int
    num_detections: int
    # class name -> (recall thresholds, precision at IoU 0.5) up to the highest recall reached
    pr_curves: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict, repr=False)

    def to_dict(self, with_curves: bool = False) -> dict:
        out = {
            "map50": self.map50, "map": self.map, "per_class": self.per_class,
            "num_images": self.num_images, "num_detections": self.num_detections,
        }
        if with_curves:
            out["pr_curves"] = {k: {"recall": r, "precision": p} for k, (r, p) in self.pr_curves.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "DetectionMetrics":
        """The metrics `to_dict(with_curves=True)` wrote (an evaluation's metrics.json)."""
        curves = {name: (curve["recall"], curve["precision"]) for name, curve in data.get("pr_curves", {}).items()}
        return cls(data["map50"], data["map"], data["per_class"], data["num_images"], data["num_detections"], curves)


def _xywh(box: np.ndarray) -> list[float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1, y1, x2 - x1, y2 - y1]


def coco_ground_truth(ground_truth: Sequence[GroundTruth], class_names: Sequence[str]) -> dict:
    """The ground truth as a COCO dataset (ground_truth.json): image ids 1..N in the given order,
    category id = class index + 1, boxes [x, y, w, h]."""
    images, annotations = [], []
    for image_id, gt in enumerate(ground_truth, start=1):
        about = {"file_name": gt.file_name, "width": gt.width, "height": gt.height}
        images.append({"id": image_id, **{key: value for key, value in about.items() if value is not None}})
        for box, cls in zip(gt.boxes, gt.classes):
            xywh = _xywh(box)
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id, "category_id": int(cls) + 1,
                "bbox": xywh, "area": xywh[2] * xywh[3], "iscrowd": 0,
            })
    categories = [{"id": k + 1, "name": name} for k, name in enumerate(class_names)]
    return {"images": images, "annotations": annotations, "categories": categories}


def coco_results(detections: Sequence[Detections]) -> list[dict]:
    """Detections in COCO's results format (detections.json), with coco_ground_truth's ids."""
    return [{"image_id": image_id, "category_id": int(cls) + 1, "bbox": _xywh(box), "score": float(score)}
            for image_id, det in enumerate(detections, start=1)
            for box, score, cls in zip(det.boxes, det.scores, det.classes)]


def write_coco_files(ground_truth: Sequence[GroundTruth], detections: Sequence[Detections],
                     class_names: Sequence[str], ground_truth_path: str | Path, detections_path: str | Path) -> None:
    """ground_truth.json and detections.json, which plain pycocotools re-scores to evaluate_detections' mAP.
    Compact JSON: a val set's detections run to megabytes."""
    for path, data in ((ground_truth_path, coco_ground_truth(ground_truth, class_names)),
                       (detections_path, coco_results(detections))):
        atomic_write_text(path, json.dumps(data, separators=(",", ":")))


def coco_evaluator(dataset: dict, results: list[dict], max_detections: int, at50_only: bool = False,
                   area_ranges: bool = True) -> COCOeval:
    """pycocotools' bbox COCOeval of `results` against a COCO `dataset`, matched image by image (evaluate()
    done, not accumulated); `max_detections` per image and class is its largest maxDets. `area_ranges` False:
    the area range "all" only (a quarter of the matching; each range is matched on its own, so "all" is the
    same). `at50_only`: that, IoU 0.5 and `max_detections` only (each threshold too is matched on its own, so
    its mAP@0.5 is the full evaluation's, for about a tenth of the work)."""
    coco_gt = COCO()
    coco_gt.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()) as chatter:  # pycocotools prints progress
        coco_gt.createIndex()
        # loadRes adds keys to the dicts it gets: copies, so the caller's results stay as they were
        evaluator = COCOeval(coco_gt, coco_gt.loadRes([dict(r) for r in results]), iouType="bbox")
        evaluator.params.maxDets = [1, 10, max_detections]
        if at50_only:
            evaluator.params.iouThrs, evaluator.params.maxDets = np.array([0.5]), [max_detections]
        if at50_only or not area_ranges:
            evaluator.params.areaRng, evaluator.params.areaRngLbl = evaluator.params.areaRng[:1], ["all"]
        evaluator.evaluate()
    log.debug("pycocotools:\n%s", chatter.getvalue())
    return evaluator


def _check_scorable(ground_truth: Sequence[GroundTruth], detections: Sequence[Detections]) -> None:
    """An image's detections for each ground-truth image, and some ground truth: else mAP is undefined."""
    if len(ground_truth) != len(detections):
        raise ValueError(f"{len(ground_truth)} ground-truth images but {len(detections)} detection lists")
    if not any(len(gt.classes) for gt in ground_truth):
        raise ValueError("no ground-truth objects: mAP is undefined")


def mean_ap50(ground_truth: Sequence[GroundTruth], detections: Sequence[Detections], class_names: Sequence[str],
              max_detections: int = 100) -> float:
    """evaluate_detections' mAP@0.5 alone, evaluated at IoU 0.5 only (coco_evaluator's at50_only): for
    scoring many models, as sensitivity and ptq-partial do, and the learning check's class-agnostic mAP."""
    _check_scorable(ground_truth, detections)
    results = coco_results(detections)
    if not results:
        return 0.0
    evaluator = coco_evaluator(coco_ground_truth(ground_truth, class_names), results, max_detections,
                               at50_only=True)
    with contextlib.redirect_stdout(io.StringIO()):
        evaluator.accumulate()
    at50 = evaluator.eval["precision"][0, :, :, 0, -1]  # [recall thresholds, classes]
    return float(np.mean(at50[at50 > -1]))


def evaluate_detections(
    ground_truth: Sequence[GroundTruth], detections: Sequence[Detections], class_names: Sequence[str],
    max_detections: int = 100,
) -> DetectionMetrics:
    """COCO-style evaluation of detections against ground truth, image by image (same order).

    `max_detections` per image count (COCO's maxDets), so it must match the decoder's limit.
    """
    _check_scorable(ground_truth, detections)
    dataset, results = coco_ground_truth(ground_truth, class_names), coco_results(detections)
    images, annotations = dataset["images"], dataset["annotations"]

    gt_counts = np.bincount([a["category_id"] - 1 for a in annotations], minlength=len(class_names))
    if not results:
        # pycocotools cannot load an empty result list; with no detections every AP is 0
        per_class = {
            name: {"ap50": 0.0 if gt_counts[k] else None, "ap": 0.0 if gt_counts[k] else None,
                   "num_gt": int(gt_counts[k])}
            for k, name in enumerate(class_names)
        }
        return DetectionMetrics(0.0, 0.0, per_class, len(images), 0)

    evaluator = coco_evaluator(dataset, results, max_detections)
    with contextlib.redirect_stdout(io.StringIO()) as chatter:
        evaluator.accumulate()
        evaluator.summarize()
    log.debug("pycocotools:\n%s", chatter.getvalue())

    # precision: [IoU thresholds T, recall thresholds R, classes K, area ranges A, max dets M]
    precision = evaluator.eval["precision"][:, :, :, 0, -1]
    recall_thresholds = evaluator.params.recThrs
    per_class, curves = {}, {}
    for k, name in enumerate(class_names):
        p = precision[:, :, k]
        has_gt = gt_counts[k] > 0
        ap = float(np.mean(p[p > -1])) if has_gt and (p > -1).any() else None
        p50 = p[0]
        ap50 = float(np.mean(p50[p50 > -1])) if has_gt and (p50 > -1).any() else None
        per_class[name] = {"ap50": ap50, "ap": ap, "num_gt": int(gt_counts[k])}
        if has_gt:
            # COCO pads precision with 0 beyond the highest recall reached; the curve ends there instead
            reached = np.nonzero(p50 > 0)[0]
            end = reached[-1] + 1 if len(reached) else 1
            curves[name] = (recall_thresholds[:end].tolist(), np.maximum(p50[:end], 0).tolist())
    at50 = precision[0]  # IoU 0.5
    return DetectionMetrics(
        # COCO's stats[1] and stats[0] at our maxDets (stats[0] always takes maxDets=100: -1 for another limit)
        map50=float(np.mean(at50[at50 > -1])), map=float(np.mean(precision[precision > -1])), per_class=per_class,
        num_images=len(images), num_detections=len(results), pr_curves=curves,
    )


def plot_pr_curves(metrics: DetectionMetrics, path: str | Path, title: str = "") -> Path:
    """Precision-recall curves at IoU 0.5, one line per class, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5), dpi=120)
    for name, (recall, precision) in metrics.pr_curves.items():
        ap50 = metrics.per_class[name]["ap50"]
        ax.plot(recall, precision, label=f"{name} (AP50 {ap50:.3f})")
    ax.set(xlabel="recall", ylabel="precision", xlim=(0, 1), ylim=(0, 1.02),
           title=title or f"PR curves @ IoU 0.5 — mAP50 {metrics.map50:.3f}, mAP {metrics.map:.3f}")
    ax.grid(alpha=0.3)
    if metrics.pr_curves:
        ax.legend(loc="lower left")
    else:  # a model that detects nothing still gets its (empty) plot
        ax.text(0.5, 0.5, "no detections", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
