"""DetectNet_v2 (TAO's PeopleNet architecture): a stride-16 grid with per-class coverage and bbox heads.

Every output cell predicts, for each class, a coverage value (is this cell inside the centre of an object?)
and four distances from the cell centre to the object's edges, in units of `bbox_norm` pixels. The decoder
turns covered cells into candidate boxes and clusters them (NMS, or DBSCAN as TAO does).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import tf_keras as keras

from qatpipe.boxes import cell_boxes, dbscan_cluster, nms
from qatpipe.errors import ModelFileError
from qatpipe.models.base import INPUT_NAME, Detections, DetectorArchitecture
from qatpipe.models.blocks import weight_regularizer
from qatpipe.models.distill import binary_kl, soft_count
from qatpipe.models.backbones import backbone_module
from qatpipe.spec import OUTPUT_STRIDE, DecoderSpec, ExperimentSpec

COVERAGE = "output_cov"
BBOX = "output_bbox"


class DetectNetV2(DetectorArchitecture):
    output_names = (COVERAGE, BBOX)
    resume_keys = ("model.loss", "model.target")
    # model.loss keys added after checkpoints were written, and what a spec.yaml without them trained with
    keys_added_later = {"model.loss.coverage_normalizer": "cells", "model.loss.class_weight": 0.0}

    def __init__(self, spec: ExperimentSpec):
        self.spec = spec
        self.num_classes = spec.num_classes
        self.height = spec.dataset.image_size.height
        self.width = spec.dataset.image_size.width
        self.input_hw = (self.height, self.width)
        self.stride = OUTPUT_STRIDE
        self.grid_h, self.grid_w = self.height // self.stride, self.width // self.stride
        self.coverage_ratio = spec.model.target.coverage_ratio
        self.bbox_norm = spec.model.target.bbox_norm

    # ----------------------------------------------------------------------------------------- model

    def build_model(self) -> keras.Model:
        backbone = self.spec.model.backbone
        module = backbone_module(backbone.name)
        regularizer = weight_regularizer(self.spec)
        inputs = keras.Input((self.height, self.width, 3), name=INPUT_NAME)
        features = module.build(inputs, backbone, regularizer)
        bbox = keras.layers.Conv2D(4 * self.num_classes, 1, name="conv_bbox", kernel_regularizer=regularizer)(
            features
        )
        cov = keras.layers.Conv2D(
            self.num_classes, 1, name="conv_cov", kernel_regularizer=regularizer,
            # start near the background prior so early training is not swamped by false positives
            bias_initializer=keras.initializers.Constant(-4.0),
        )(features)
        # float32 outputs keep the losses stable under mixed precision
        cov = keras.layers.Activation("sigmoid", dtype="float32", name=COVERAGE)(cov)
        bbox = keras.layers.Activation("linear", dtype="float32", name=BBOX)(bbox)
        return keras.Model(inputs, [cov, bbox], name=f"detectnet_v2_{module.label(backbone)}")

    def check_model(self, model, source: str) -> None:
        names = tuple(name.split("/")[0] for name in model.output_names)
        if names != self.output_names:
            raise ModelFileError(f"{source}: outputs {list(names)} are not DetectNet_v2's {list(self.output_names)}")
        height, width = model.input_shape[1:3]
        if (height, width) != (self.height, self.width):
            raise ModelFileError(
                f"{source}: model input is {height}x{width}, the spec's dataset.image_size is "
                f"{self.height}x{self.width}"
            )
        classes = model.output_shape[0][-1]
        if classes != self.num_classes:
            raise ModelFileError(
                f"{source}: model predicts {classes} classes, the spec's dataset.classes has {self.num_classes}"
            )

    # ---------------------------------------------------------------------------------------- encoder

    def cell_centres(self):
        ys = (tf.range(self.grid_h, dtype=tf.float32) + 0.5) * self.stride
        xs = (tf.range(self.grid_w, dtype=tf.float32) + 0.5) * self.stride
        return tf.meshgrid(xs, ys)  # each (grid_h, grid_w)

    def encode(self, boxes, classes) -> dict:
        """Padded boxes (M,4) and class ids (M,) with -1 for padding -> coverage and bbox targets.

        A cell is covered for class c when its centre lies in the central `coverage_ratio` part of a box of
        class c (at least the cell holding the box centre, so small objects are never lost). Where boxes of
        one class overlap, the cell regresses the smallest of them: it is usually the one in front.
        """
        boxes = tf.cast(boxes, tf.float32)
        cx, cy = self.cell_centres()
        cx, cy = cx[..., None], cy[..., None]  # (gh, gw, 1) against M boxes
        x1, y1, x2, y2 = (boxes[:, i] for i in range(4))
        bx, by = (x1 + x2) / 2, (y1 + y2) / 2
        half_w = tf.maximum((x2 - x1) * self.coverage_ratio / 2, self.stride / 2)
        half_h = tf.maximum((y2 - y1) * self.coverage_ratio / 2, self.stride / 2)
        inside = (tf.abs(cx - bx) <= half_w) & (tf.abs(cy - by) <= half_h) & (classes >= 0)  # (gh, gw, M)

        one_hot = tf.one_hot(classes, self.num_classes, on_value=True, off_value=False, dtype=tf.bool)  # (M, C)
        inside_c = inside[..., None] & one_hot  # (gh, gw, M, C)
        area = (x2 - x1) * (y2 - y1)
        masked_area = tf.where(inside_c, area[:, None], np.float32(np.inf))
        chosen = tf.argmin(masked_area, axis=2, output_type=tf.int32)  # (gh, gw, C)
        coverage = tf.cast(tf.reduce_any(inside_c, axis=2), tf.float32)

        chosen_boxes = tf.gather(boxes, chosen)  # (gh, gw, C, 4)
        distances = tf.stack(  # cx, cy are (gh, gw, 1) against C classes here
            [cx - chosen_boxes[..., 0], cy - chosen_boxes[..., 1],
             chosen_boxes[..., 2] - cx, chosen_boxes[..., 3] - cy],
            axis=-1,
        ) / self.bbox_norm
        distances = distances * coverage[..., None]
        bbox = tf.reshape(distances, (self.grid_h, self.grid_w, 4 * self.num_classes))
        # The bbox loss needs the coverage mask: Keras gives each loss only its own output's target, so
        # the mask rides along as extra channels of the bbox target.
        return {COVERAGE: coverage, BBOX: tf.concat([bbox, coverage], axis=-1)}

    # ----------------------------------------------------------------------------------------- losses

    def losses(self) -> dict:
        loss = self.spec.model.loss
        num_classes = self.num_classes

        def coverage_loss(y_true, y_pred):
            # weighted BCE per cell and class; positive cells are a few percent of the grid
            eps = keras.backend.epsilon()
            y_pred = tf.clip_by_value(y_pred, eps, 1 - eps)
            bce = -(y_true * tf.math.log(y_pred) + (1 - y_true) * tf.math.log(1 - y_pred))
            weighted = bce * (1.0 + (loss.positive_weight - 1.0) * y_true)
            object_mask = tf.reduce_max(y_true, axis=-1)  # (batch, gh, gw): 1 at object cells
            object_cells = tf.maximum(tf.reduce_sum(object_mask), 1.0)
            if loss.coverage_normalizer == "cells":  # TAO: the mean over every cell and class
                total = loss.coverage_weight * tf.reduce_mean(weighted)
            else:
                # summed and divided by the object cells, as the bbox loss is (RetinaNet, FCOS): the mean over
                # cells x classes shrinks each object's share, and with it the only signal that tells classes
                # apart, with the grid size and the number of classes (docs/design/recipe-notes.md)
                total = loss.coverage_weight * tf.reduce_sum(weighted) / object_cells
            if loss.class_weight and num_classes > 1:
                total += loss.class_weight * _class_cross_entropy(y_true, y_pred, object_mask) / object_cells
            return total

        def bbox_loss(y_true, y_pred):
            target, mask = y_true[..., : 4 * num_classes], y_true[..., 4 * num_classes :]
            mask4 = tf.repeat(mask, 4, axis=-1)
            l1 = tf.reduce_sum(tf.abs(y_pred - target) * mask4)
            return loss.bbox_weight * l1 / tf.maximum(tf.reduce_sum(mask4), 1.0)

        coverage_loss.__name__ = "coverage_loss"
        bbox_loss.__name__ = "bbox_loss"
        return {COVERAGE: coverage_loss, BBOX: bbox_loss}

    def distill_losses(self) -> dict:
        """coverage: binary KL from the teacher's coverage, over every cell and class, normalised as the task's
        coverage loss is (coverage_normalizer: the teacher's soft count of object cells, or the mean) and
        weighted as it is; bbox: the task's bbox loss (L1 per coordinate) with the teacher's boxes as the target
        and the teacher's coverage of each class as the mask."""
        loss = self.spec.model.loss
        bbox_loss = self.losses()[BBOX]

        def coverage_distill(teacher, student):
            kl = binary_kl(teacher[COVERAGE], student[COVERAGE])
            if loss.coverage_normalizer == "cells":
                return loss.coverage_weight * tf.reduce_mean(kl)
            return loss.coverage_weight * tf.reduce_sum(kl) / soft_count(tf.reduce_max(teacher[COVERAGE], axis=-1))

        def bbox_distill(teacher, student):
            return bbox_loss(tf.concat([teacher[BBOX], teacher[COVERAGE]], axis=-1), student[BBOX])

        return {COVERAGE: coverage_distill, BBOX: bbox_distill}

    # ---------------------------------------------------------------------------------------- decoder

    def decode(self, outputs: dict[str, np.ndarray]) -> list[Detections]:
        coverage, bbox = np.asarray(outputs[COVERAGE]), np.asarray(outputs[BBOX])
        return [
            decode_detectnet(coverage[i], bbox[i], self.stride, self.bbox_norm, self.spec.model.decoder,
                             (self.height, self.width))
            for i in range(coverage.shape[0])
        ]

    def nvinfer_layout(self):
        """nvinfer's built-in DetectNet_v2 parser (models/detectnet_v2_deepstream.py); no decoding record: the
        engines output the heads."""
        from qatpipe.models.detectnet_v2_deepstream import DetectNetV2Layout

        return DetectNetV2Layout(self.stride, self.bbox_norm, self.spec.model.decoder)


def _class_cross_entropy(y_true, y_pred, object_mask):
    """Summed over the object cells: softmax cross-entropy of the class logits against the cell's classes.

    The per-class sigmoids are trained one class at a time; at an object cell this term makes the classes
    compete, so the features must say *which* class covers the cell. It sees only differences between the
    logits of one cell, so it does not raise or lower coverage as a whole; background is the BCE's job. A cell
    covered by several classes shares the target between them. `y_pred` is the clipped sigmoid output."""
    logits = tf.math.log(y_pred) - tf.math.log1p(-y_pred)
    target = y_true / tf.maximum(tf.reduce_sum(y_true, axis=-1, keepdims=True), 1.0)
    cross_entropy = -tf.reduce_sum(target * tf.nn.log_softmax(logits, axis=-1), axis=-1)
    return tf.reduce_sum(cross_entropy * object_mask)


# ------------------------------------------------------------------------------------ NumPy decoding


def decode_detectnet(
    coverage: np.ndarray, bbox: np.ndarray, stride: int, bbox_norm: float, cfg: DecoderSpec,
    image_hw: tuple[int, int],
) -> Detections:
    """One image's coverage (gh,gw,C) and bbox (gh,gw,4C) -> clustered detections in input pixels."""
    grid_h, grid_w, num_classes = coverage.shape
    height, width = image_hw
    all_boxes, all_scores, all_classes = [], [], []
    for c in range(num_classes):
        ys, xs = np.nonzero(coverage[:, :, c] > cfg.coverage_threshold)
        if len(ys) == 0:
            continue
        scores = coverage[ys, xs, c].astype(np.float32)
        boxes = np.clip(cell_boxes(bbox, ys, xs, c, stride, bbox_norm), 0, [width, height, width, height])
        boxes = boxes.astype(np.float32)
        keep = ((boxes[:, 2] - boxes[:, 0]) >= max(cfg.min_box_size, 1e-3)) & (
            (boxes[:, 3] - boxes[:, 1]) >= max(cfg.min_box_size, 1e-3)
        )
        boxes, scores = boxes[keep], scores[keep]
        if cfg.method == "nms":
            boxes, scores = nms(boxes, scores, cfg.nms_iou)
        else:
            boxes, scores = dbscan_cluster(boxes, scores, cfg.dbscan_eps, cfg.dbscan_min_samples)
        all_boxes.append(boxes)
        all_scores.append(scores)
        all_classes.append(np.full(len(scores), c, np.int32))
    if not all_scores:
        return Detections()
    boxes, scores, classes = np.concatenate(all_boxes), np.concatenate(all_scores), np.concatenate(all_classes)
    order = np.argsort(-scores, kind="stable")[: cfg.max_detections]
    return Detections(boxes[order], scores[order], classes[order])
