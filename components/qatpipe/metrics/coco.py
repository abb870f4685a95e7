"""Detection mAP through pycocotools: AP@0.5 (TAO/VOC-style headline), AP@[.5:.95], per class, PR curves."""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from qatpipe.models.base import Detections

log = logging.getLogger(__name__)


@dataclass
class GroundTruth:
    boxes: np.ndarray  # (N, 4) x1 y1 x2 y2
    classes: np.ndarray  # (N,)


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


def _xywh(box: np.ndarray) -> list[float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1, y1, x2 - x1, y2 - y1]


def evaluate_detections(
    ground_truth: Sequence[GroundTruth], detections: Sequence[Detections], class_names: Sequence[str],
    max_detections: int = 100,
) -> DetectionMetrics:
    """COCO-style evaluation of detections against ground truth, image by image (same order).

    `max_detections` per image count (COCO's maxDets), so it must match the decoder's limit.
    """
    if len(ground_truth) != len(detections):
        raise ValueError(f"{len(ground_truth)} ground-truth images but {len(detections)} detection lists")
    if not any(len(gt.classes) for gt in ground_truth):
        raise ValueError("no ground-truth objects: mAP is undefined")
    images, annotations, results = [], [], []
    for image_id, (gt, det) in enumerate(zip(ground_truth, detections), start=1):
        images.append({"id": image_id})
        for box, cls in zip(gt.boxes, gt.classes):
            xywh = _xywh(box)
            annotations.append({
                "id": len(annotations) + 1, "image_id": image_id, "category_id": int(cls) + 1,
                "bbox": xywh, "area": xywh[2] * xywh[3], "iscrowd": 0,
            })
        for box, score, cls in zip(det.boxes, det.scores, det.classes):
            results.append({"image_id": image_id, "category_id": int(cls) + 1, "bbox": _xywh(box),
                            "score": float(score)})

    gt_counts = np.bincount([a["category_id"] - 1 for a in annotations], minlength=len(class_names))
    if not results:
        # pycocotools cannot load an empty result list; with no detections every AP is 0
        per_class = {
            name: {"ap50": 0.0 if gt_counts[k] else None, "ap": 0.0 if gt_counts[k] else None,
                   "num_gt": int(gt_counts[k])}
            for k, name in enumerate(class_names)
        }
        return DetectionMetrics(0.0, 0.0, per_class, len(images), 0)

    coco_gt = COCO()
    coco_gt.dataset = {
        "images": images, "annotations": annotations,
        "categories": [{"id": k + 1, "name": name} for k, name in enumerate(class_names)],
    }
    with contextlib.redirect_stdout(io.StringIO()) as chatter:  # pycocotools prints progress
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(results)
        evaluator = COCOeval(coco_gt, coco_dt, iouType="bbox")
        evaluator.params.maxDets = [1, 10, max_detections]
        evaluator.evaluate()
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
