"""A learning check that speaks up: has the detector learned to tell its classes apart, and is training still
getting anywhere?

mAP alone cannot tell "finds nothing" from "finds everything but names it wrongly". Beside the class-aware
mAP@0.5 this computes:
- the class-agnostic mAP@0.5: every class merged into one (cross-class duplicates merged by NMS), so it
  scores finding objects, whatever they are called;
- the class confusion at objects: for each ground-truth object, the class of the highest-scoring detection of
  any class that overlaps it with IoU >= MATCH_IOU, or "missed"; hence the class accuracy among found objects,
  per class and overall, next to chance.
From these (and, after training, the training loss history) come findings: plain sentences that go to the log
as warnings, to metrics.json / train_summary.json and to the tracking records.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from qatpipe.boxes import iou_matrix, nms
from qatpipe.metrics.coco import GroundTruth, mean_ap50
from qatpipe.models.base import Detections

if TYPE_CHECKING:
    from qatpipe.spec import ExperimentSpec

log = logging.getLogger(__name__)

# A detection "finds" an object when it overlaps it as much as mAP@0.5 requires of a true positive.
MATCH_IOU = 0.5
# Below this class-agnostic mAP@0.5 the model hardly finds objects at all: comparing it with the class-aware
# mAP then says nothing about classes (a poor localiser scores low either way, and both figures are noise).
MEANINGFUL_AGNOSTIC_MAP50 = 0.1
# Class-aware mAP@0.5 under this fraction of the class-agnostic one: naming the classes costs the model more
# than half of what it finds. A model that has learned its classes loses a few points, not half.
CLASS_GAP_RATIO = 0.5
# Class accuracy counts as "near chance" while it has come less than this fraction of the way from chance to
# perfect (3 classes: below 0.50; 10 classes: below 0.33).
NEAR_CHANCE_MARGIN = 0.25
# Fewer found objects than this make the class accuracy too noisy to judge (its standard error is ~0.1 at 20).
MIN_FOUND_OBJECTS = 20
# The training loss has "stopped falling" when the last PLATEAU_EPOCHS epochs brought it down by less than
# PLATEAU_MIN_DROP of its value before them: an annealed schedule's last epochs still fall by several percent.
PLATEAU_EPOCHS = 3
PLATEAU_MIN_DROP = 0.02
# A val mAP@0.5 under this after training is low: a detector that has learned its data scores well above it
# (0.6-0.9 on KITTI-like data); harder data sets that merely reach moderate scores are not flagged.
LOW_MAP50 = 0.3

CLASSES_NOT_LEARNED = "classes_not_learned"
LOSS_PLATEAU = "loss_plateau"
_TAG_CHARS = 5000  # MLflow's limit on a tag value (older servers)


@dataclass
class Finding:
    code: str  # stable identifier, e.g. "classes_not_learned"
    message: str  # what a user reads


@dataclass
class LearningCheck:
    """The numbers of the check and its findings (`to_dict` is what metrics.json holds under `diagnostics`)."""

    map50: float
    class_agnostic_map50: float
    num_objects: int
    found_objects: int
    class_accuracy: float | None  # among found objects; None when none was found
    chance: float  # 1 / number of classes
    majority_rate: float | None  # accuracy of always naming the most common class among found objects
    per_class_accuracy: dict[str, float | None]
    classes: list[str]
    confusion: list[list[int]]  # rows: true class; columns: predicted class, then "missed"
    findings: list[Finding] = field(default_factory=list)

    @property
    def found_fraction(self) -> float:
        return self.found_objects / self.num_objects if self.num_objects else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["found_fraction"] = round(self.found_fraction, 6)
        data["confusion"] = {"rows": self.classes, "columns": [*self.classes, "missed"], "matrix": self.confusion}
        return data


def merge_classes(detections: Detections, nms_iou: float) -> Detections:
    """One image's detections as one class: overlapping boxes of different classes (one object named twice)
    merged by NMS, so a model unsure of the class is not charged a false positive for each guess."""
    boxes, scores = nms(np.asarray(detections.boxes, np.float32), np.asarray(detections.scores, np.float32),
                        nms_iou)
    return Detections(boxes, scores, np.zeros(len(scores), np.int32))


def class_agnostic_map50(ground_truth: Sequence[GroundTruth], detections: Sequence[Detections],
                         max_detections: int = 100, nms_iou: float = 0.5) -> float:
    """mAP@0.5 with every class merged into one (pycocotools, as the class-aware figure)."""
    merged_truth = [GroundTruth(gt.boxes, np.zeros(len(gt.classes), np.int64)) for gt in ground_truth]
    merged = [merge_classes(det, nms_iou) for det in detections]
    return mean_ap50(merged_truth, merged, ["object"], max_detections=max_detections)


def class_confusion(ground_truth: Sequence[GroundTruth], detections: Sequence[Detections],
                    num_classes: int) -> np.ndarray:
    """(K, K+1) counts: row = an object's class, column = the class of the highest-scoring detection of any
    class overlapping it with IoU >= MATCH_IOU, or K ("missed") when none does."""
    matrix = np.zeros((num_classes, num_classes + 1), np.int64)
    for gt, det in zip(ground_truth, detections, strict=True):
        if not len(gt.classes):
            continue
        overlaps = (iou_matrix(np.asarray(gt.boxes, np.float32), np.asarray(det.boxes, np.float32)) >= MATCH_IOU
                    if len(det) else np.zeros((len(gt.classes), 0), bool))
        scores = np.asarray(det.scores)
        for row, cls in zip(overlaps, gt.classes):
            hits = np.nonzero(row)[0]
            predicted = int(det.classes[hits[np.argmax(scores[hits])]]) if len(hits) else num_classes
            matrix[int(cls), predicted] += 1
    return matrix


def check_learning(ground_truth: Sequence[GroundTruth], detections: Sequence[Detections],
                   class_names: Sequence[str], map50: float, max_detections: int = 100,
                   nms_iou: float = 0.5) -> LearningCheck:
    """The learning check of one evaluation; `map50` is its class-aware mAP@0.5."""
    num_classes = len(class_names)
    confusion = class_confusion(ground_truth, detections, num_classes)
    found_per_class = confusion[:, :num_classes].sum(axis=1)
    found = int(found_per_class.sum())
    correct = int(np.trace(confusion[:, :num_classes]))
    check = LearningCheck(
        map50=float(map50),
        class_agnostic_map50=class_agnostic_map50(ground_truth, detections, max_detections, nms_iou),
        num_objects=int(confusion.sum()), found_objects=found,
        class_accuracy=correct / found if found else None,
        chance=1.0 / num_classes,
        majority_rate=float(found_per_class.max()) / found if found else None,
        per_class_accuracy={name: float(confusion[k, k] / found_per_class[k]) if found_per_class[k] else None
                            for k, name in enumerate(class_names)},
        classes=list(class_names), confusion=confusion.tolist(),
    )
    check.findings = class_findings(check)
    return check


def learning_check(spec: ExperimentSpec, ground_truth: Sequence[GroundTruth], detections: Sequence[Detections],
                   map50: float) -> LearningCheck:
    """`check_learning` of detections decoded with the spec's decoder (its top-k and NMS IoU), as the evaluate
    stage and validation during training run it."""
    decoder = spec.model.decoder
    return check_learning(ground_truth, detections, spec.dataset.classes, map50,
                          max_detections=decoder.max_detections, nms_iou=decoder.nms_iou)


def class_findings(check: LearningCheck) -> list[Finding]:
    """"The model finds objects but cannot tell their classes", when the numbers say so."""
    if len(check.classes) < 2:
        return []
    reasons = []
    agnostic = check.class_agnostic_map50
    if agnostic >= MEANINGFUL_AGNOSTIC_MAP50 and check.map50 < CLASS_GAP_RATIO * agnostic:
        reasons.append(f"class-aware mAP@0.5 {check.map50:.3f} is under {CLASS_GAP_RATIO:g} x the class-agnostic "
                       f"{agnostic:.3f}")
    # always naming the most common class is as good as chance: the baseline is the better of the two
    baseline = max(check.chance, check.majority_rate or 0.0)
    if (check.found_objects >= MIN_FOUND_OBJECTS
            and check.class_accuracy <= baseline + NEAR_CHANCE_MARGIN * (1.0 - baseline)):
        reasons.append(f"the best detection at a found object names its class right {check.class_accuracy:.1%} of "
                       f"the time, close to or below chance ({baseline:.1%}; {check.found_objects} of "
                       f"{check.num_objects} objects found)")
    if not reasons:
        return []
    return [Finding(CLASSES_NOT_LEARNED, (
        "the model finds objects but cannot tell their classes: " + "; ".join(reasons) + ". Likely causes: the "
        "class signal in the loss is too weak (model.loss), too few epochs (train.epochs), classes that differ "
        "only in details the input resolution (dataset.image_size) loses, or label noise / a wrong class mapping "
        "(dataset.class_mapping, the order of dataset.classes)"))]


def loss_plateau(losses: Sequence[float]) -> float | None:
    """The relative drop of the training loss over its last PLATEAU_EPOCHS epochs, or None with too few."""
    if len(losses) <= PLATEAU_EPOCHS:
        return None
    before = float(losses[-PLATEAU_EPOCHS - 1])
    return (before - float(min(losses[-PLATEAU_EPOCHS:]))) / max(abs(before), 1e-12)


def plateau_findings(losses: Sequence[float], val_map50: float) -> list[Finding]:
    """"Training stopped improving while the model is still poor": the loss has flattened, val mAP is low."""
    drop = loss_plateau(losses)
    if drop is None or drop >= PLATEAU_MIN_DROP or val_map50 >= LOW_MAP50:
        return []
    return [Finding(LOSS_PLATEAU, (
        f"the training loss stopped falling ({drop:+.1%} over the last {PLATEAU_EPOCHS} epochs) while val "
        f"mAP@0.5 is {val_map50:.3f}: more epochs at this learning rate will not help. Likely causes: a learning "
        "rate too low or annealed too early (train.learning_rate), a model too small for the data "
        "(model.backbone), labels or class mapping wrong, or objects too small for the input resolution"))]


def log_findings(findings: Sequence[Finding | dict], where: str) -> None:
    for finding in findings:
        message = finding["message"] if isinstance(finding, dict) else finding.message
        log.warning("%s: %s", where, message)


def diagnostics_metrics(diagnostics: dict | None) -> dict[str, float]:
    """A learning check's numbers worth a tracked metric: class-agnostic mAP@0.5 and class accuracy."""
    return {key: diagnostics[key] for key in ("class_agnostic_map50", "class_accuracy")
            if (diagnostics or {}).get(key) is not None}


def findings_tags(findings: Sequence[Finding | dict]) -> dict[str, str]:
    """Run tags that make the findings visible in MLflow: `qatpipe.findings` (codes, or "none") and one
    `qatpipe.finding.<code>` with each message."""
    items = [finding if isinstance(finding, dict) else asdict(finding) for finding in findings]
    tags = {"qatpipe.findings": ",".join(item["code"] for item in items) or "none"}
    for item in items:
        tags[f"qatpipe.finding.{item['code']}"] = item["message"][:_TAG_CHARS]
    return tags


__all__ = ["Finding", "LearningCheck", "check_learning", "learning_check", "class_agnostic_map50", "class_confusion",
           "class_findings", "plateau_findings", "loss_plateau", "log_findings", "findings_tags",
           "diagnostics_metrics"]
