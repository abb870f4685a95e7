"""SSD (TAO's second detector, NVIDIA's SSD320): class and box heads on feature maps at several strides.

The backbone gives the maps at strides 8 and 16; extra stride-2 layers give the coarser ones, and an optional
top-down path (model.ssd.fpn) adds each coarser map into its finer neighbour. Each map's cells carry priors
(boxes.prior_boxes); per prior a softmax over background and the classes, and four offsets from the prior
(boxes.encode_offsets). The heads' outputs are reshaped and concatenated into two model outputs, prior by
prior: `output_cls` (N, P, 1 + C) and `output_loc` (N, P, 4). Matching (each object to its best prior and to
every prior above pos_iou_threshold) runs in tf.data; the decoder (per-class top-k and NMS) in NumPy.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
import tf_keras as keras

from qatpipe.boxes import (NMS_BOXES, NMS_IMAGES, NMS_INDICES, NMS_SCORES, centres_to_corners, decode_offsets,
                           per_class_nms, prior_boxes, priors_per_cell)
from qatpipe.errors import ModelFileError
from qatpipe.models.backbones import backbone_module
from qatpipe.models.base import INPUT_NAME, Detections, DetectorArchitecture
from qatpipe.models.blocks import bn, conv, scaled_filters, weight_regularizer
from qatpipe.models.decoding import CLS, LOC, PriorBoxDecoding
from qatpipe.models.distill import categorical_kl, soft_count
from qatpipe.spec import ExperimentSpec

BACKBONE_STRIDES = (8, 16)  # the maps taken from the backbone; larger strides come from extra layers
# post-activation layers make the backbone's taps (an SSDLite-style expansion output on MobileNetV2)
_TAP_TYPES = (keras.layers.Activation, keras.layers.ReLU, keras.layers.Add)
BACKGROUND_PRIOR = 0.99  # the cls head starts out saying "background" at this probability


class SSD(DetectorArchitecture):
    output_names = (CLS, LOC)
    resume_keys = ("model.loss", "model.target", "model.ssd")

    def __init__(self, spec: ExperimentSpec):
        self.spec = spec
        self.cfg = spec.model.ssd
        self.num_classes = spec.num_classes
        self.height, self.width = spec.dataset.image_size.height, spec.dataset.image_size.width
        self.input_hw = (self.height, self.width)
        self.strides = list(self.cfg.feature_strides)
        self.stride = self.strides[0]
        self.map_hws = [(self.height // s, self.width // s) for s in self.strides]
        self.anchors = [priors_per_cell(self.cfg.ratios_of(k), self.cfg.two_boxes_for_ar1)
                        for k in range(len(self.strides))]
        self.variances = np.asarray(self.cfg.variances, np.float32)
        # (P, 4) cx cy w h, fractions of the image
        self.priors = prior_boxes(self.input_hw, self.map_hws, self.cfg.scales,
                                  [self.cfg.ratios_of(k) for k in range(len(self.strides))],
                                  self.cfg.two_boxes_for_ar1, self.cfg.clip_boxes)
        self.num_priors = len(self.priors)

    # ----------------------------------------------------------------------------------------- model

    def build_model(self) -> keras.Model:
        backbone = self.spec.model.backbone
        module = backbone_module(backbone.name)
        regularizer = weight_regularizer(self.spec)
        inputs = keras.Input((self.height, self.width, 3), name=INPUT_NAME)
        maps = self._feature_maps(inputs, module.build(inputs, backbone, regularizer), regularizer)
        if self.cfg.fpn:
            maps = self._top_down(maps, regularizer)
        cls_heads, loc_heads = [], []
        for stride, anchors, features in zip(self.strides, self.anchors, maps):
            # small initial kernels (RetinaNet's): the heads start at their biases, background for the classes
            def head(filters, name):
                return keras.layers.Conv2D(filters, 3, padding="same", name=name, kernel_regularizer=regularizer,
                                           kernel_initializer=keras.initializers.RandomNormal(stddev=0.01))

            cls = head(anchors * (1 + self.num_classes), f"ssd_conv_cls_{stride}")(features)
            loc = head(anchors * 4, f"ssd_conv_loc_{stride}")(features)
            cls_heads.append(keras.layers.Reshape((-1, 1 + self.num_classes), name=f"ssd_cls_reshape_{stride}")(cls))
            loc_heads.append(keras.layers.Reshape((-1, 4), name=f"ssd_loc_reshape_{stride}")(loc))
        if len(self.strides) > 1:
            cls = keras.layers.Concatenate(axis=1, name="ssd_cls_concat")(cls_heads)
            loc = keras.layers.Concatenate(axis=1, name="ssd_loc_concat")(loc_heads)
        else:
            cls, loc = cls_heads[0], loc_heads[0]
        # float32 outputs keep the losses stable under mixed precision
        cls = keras.layers.Activation("softmax", dtype="float32", name=CLS)(cls)
        loc = keras.layers.Activation("linear", dtype="float32", name=LOC)(loc)
        model = keras.Model(inputs, [cls, loc], name=f"ssd_{module.label(backbone)}")
        self._start_at_background(model)
        return model

    def _feature_maps(self, inputs, features, regularizer) -> list:
        """The maps at self.strides: the backbone's (its last post-activation layer at each stride), then
        extra stride-2 blocks (1x1 squeeze, 3x3 stride 2; SSD's extra layers) on the coarsest."""
        taps = {}
        for layer in keras.Model(inputs, features).layers:
            shape = layer.output.shape
            if isinstance(layer, _TAP_TYPES) and len(shape) == 4 and self.height % shape[1] == 0:
                taps[self.height // shape[1]] = layer.output  # in topological order: the last one wins
        taps[16] = features
        width = self.spec.model.backbone.width
        filters = scaled_filters(self.cfg.extra_filters, width)
        maps, x, stride = [], features, 16
        for wanted in self.strides:
            if wanted in BACKBONE_STRIDES:
                if wanted not in taps:
                    raise ModelFileError(f"backbone {self.spec.model.backbone.name} has no layer at stride {wanted}")
                maps.append(taps[wanted])
                continue
            while stride < wanted:
                stride *= 2
                name = f"ssd_extra_{stride}"
                x = conv(filters // 2, 1, 1, f"{name}_conv_1", regularizer)(x)
                x = bn(f"{name}_bn_1")(x)
                x = keras.layers.Activation("relu", name=f"{name}_relu_1")(x)
                x = conv(filters, 3, 2, f"{name}_conv_2", regularizer)(x)
                x = bn(f"{name}_bn_2")(x)
                x = keras.layers.Activation("relu", name=f"{name}_relu_2")(x)
            maps.append(x)
        return maps

    def _top_down(self, maps, regularizer) -> list:
        """FPN: every map to fpn_filters (1x1), each plus its upsampled coarser result, then a 3x3 conv."""
        filters = scaled_filters(self.cfg.fpn_filters, self.spec.model.backbone.width)
        out, above = [None] * len(maps), None
        for k in reversed(range(len(maps))):
            stride = self.strides[k]
            x = conv(filters, 1, 1, f"ssd_fpn_lateral_{stride}", regularizer, use_bias=True)(maps[k])
            if above is not None:
                up = keras.layers.UpSampling2D(self.strides[k + 1] // stride, interpolation="nearest",
                                               name=f"ssd_fpn_up_{stride}")(above)
                x = keras.layers.Add(name=f"ssd_fpn_add_{stride}")([x, up])
            above = x
            y = conv(filters, 3, 1, f"ssd_fpn_conv_{stride}", regularizer)(x)
            y = bn(f"ssd_fpn_bn_{stride}")(y)
            out[k] = keras.layers.Activation("relu", name=f"ssd_fpn_relu_{stride}")(y)
        return out

    def _start_at_background(self, model) -> None:
        """Background logit log(p/(1-p) x C): softmax says background at BACKGROUND_PRIOR, so early training
        is not swamped by thousands of false positives (RetinaNet's prior initialisation)."""
        background = math.log(BACKGROUND_PRIOR / (1 - BACKGROUND_PRIOR) * max(self.num_classes, 1))
        for stride, anchors in zip(self.strides, self.anchors):
            layer = model.get_layer(f"ssd_conv_cls_{stride}")
            bias = np.zeros((anchors, 1 + self.num_classes), np.float32)
            bias[:, 0] = background
            layer.bias.assign(bias.ravel())

    def check_model(self, model, source: str) -> None:
        names = tuple(name.split("/")[0] for name in model.output_names)
        if names != self.output_names:
            raise ModelFileError(f"{source}: outputs {list(names)} are not SSD's {list(self.output_names)} "
                                 "(a model of another model.arch?)")
        height, width = model.input_shape[1:3]
        if (height, width) != (self.height, self.width):
            raise ModelFileError(f"{source}: model input is {height}x{width}, the spec's dataset.image_size is "
                                 f"{self.height}x{self.width}")
        priors, classes = model.output_shape[0][1:3]
        if classes != 1 + self.num_classes:
            raise ModelFileError(f"{source}: model predicts {classes - 1} classes, the spec's dataset.classes "
                                 f"has {self.num_classes}")
        if priors != self.num_priors:
            raise ModelFileError(f"{source}: model has {priors} priors, the spec's model.ssd (feature_strides, "
                                 f"aspect ratios, two_boxes_for_ar1) makes {self.num_priors}")

    # ---------------------------------------------------------------------------------------- encoder

    def encode(self, boxes, classes) -> dict:
        """Padded boxes (M,4) in input pixels and class ids (M,), -1 for padding -> per-prior targets.

        Each object claims its best prior whatever the IoU (so no object goes unmatched; where two objects
        share a best prior the later one keeps it), and every prior whose best IoU reaches pos_iou_threshold
        regresses that object. Priors below neg_iou_limit with every object are background; those between
        get an all-zero class target and are ignored. The box target carries the positive mask as a fifth
        channel (Keras gives each loss only its own output's target)."""
        target = self.spec.model.target
        size = tf.constant([self.width, self.height, self.width, self.height], tf.float32)
        boxes = tf.cast(boxes, tf.float32) / size
        classes = tf.cast(classes, tf.int32)
        # the objects only, then one padding row (an image without objects): the IoUs cost objects x priors,
        # not max_boxes x priors, which made this the input pipeline's slowest step; the targets are the same
        keep = classes >= 0
        boxes = tf.concat([tf.boolean_mask(boxes, keep), tf.zeros((1, 4))], axis=0)
        classes = tf.concat([tf.boolean_mask(classes, keep), [-1]], axis=0)
        valid = classes >= 0
        ious = _iou(boxes, tf.constant(centres_to_corners(self.priors)))  # (M, P)
        ious = tf.where(valid[:, None], ious, -1.0)
        best_object = tf.argmax(ious, axis=0, output_type=tf.int32)  # (P,)
        best_iou = tf.reduce_max(ious, axis=0)
        forced = tf.boolean_mask(tf.argmax(ious, axis=1, output_type=tf.int32), valid)[:, None]
        objects = tf.boolean_mask(tf.range(tf.shape(classes)[0]), valid)
        best_object = tf.tensor_scatter_nd_update(best_object, forced, objects)
        best_iou = tf.tensor_scatter_nd_update(best_iou, forced, tf.fill(tf.shape(objects), 2.0))

        positive = best_iou >= target.pos_iou_threshold
        negative = best_iou < target.neg_iou_limit
        label = tf.where(positive, tf.gather(classes, best_object) + 1, 0)
        one_hot = tf.one_hot(label, 1 + self.num_classes)
        cls = one_hot * tf.cast(positive | negative, tf.float32)[:, None]

        matched = _corners_to_centres(tf.gather(boxes, best_object))
        offsets = encode_offsets_tf(matched, tf.constant(self.priors), self.variances)
        mask = tf.cast(positive, tf.float32)[:, None]
        return {CLS: cls, LOC: tf.concat([offsets * mask, mask], axis=-1)}

    # ----------------------------------------------------------------------------------------- losses

    def losses(self) -> dict:
        loss = self.spec.model.loss

        def cls_loss(y_true, y_pred):
            return ssd_class_loss(y_true, y_pred, loss)

        def loc_loss(y_true, y_pred):
            return loss.alpha * ssd_box_loss(y_true, y_pred)

        cls_loss.__name__ = "cls_loss"
        loc_loss.__name__ = "loc_loss"
        return {CLS: cls_loss, LOC: loc_loss}

    def distill_losses(self) -> dict:
        """cls: KL from the teacher's softmax at every prior, divided by the teacher's soft count of object
        priors (the sum of 1 - its background probability), as the task's class loss divides by the positives;
        loc: the task's box loss (smooth L1, x alpha) with the teacher's offsets as the target and that object
        probability as the mask."""
        loss = self.spec.model.loss

        def cls_distill(teacher, student):
            objects = 1.0 - teacher[CLS][..., 0]
            return tf.reduce_sum(categorical_kl(teacher[CLS], student[CLS])) / soft_count(objects)

        def loc_distill(teacher, student):
            objects = 1.0 - teacher[CLS][..., :1]
            return loss.alpha * ssd_box_loss(tf.concat([teacher[LOC], objects], axis=-1), student[LOC])

        return {CLS: cls_distill, LOC: loc_distill}

    # ---------------------------------------------------------------------------------------- decoder

    def decode(self, outputs: dict[str, np.ndarray]) -> list[Detections]:
        """The heads (output_cls, output_loc: per-class top-k and NMS here, in NumPy), or an engine's NMS results
        (boxes.NMS_INDICES and company, engines/tensorrt_backend.py: the best max_detections of each image kept)
        -> detections per image, in input pixels."""
        cfg = self.spec.model.decoder
        size = np.array([self.width, self.height, self.width, self.height], np.float32)
        if NMS_INDICES in outputs:
            return nms_detections(outputs, size, cfg.max_detections)
        cls, loc = np.asarray(outputs[CLS]), np.asarray(outputs[LOC])
        detections = []
        for i in range(cls.shape[0]):
            boxes = centres_to_corners(decode_offsets(loc[i], self.priors, self.variances)) * size
            boxes = np.clip(boxes, 0, size)
            boxes, scores, classes = per_class_nms(boxes, cls[i, :, 1:], cfg.confidence_threshold, cfg.top_k,
                                                   cfg.nms_iou, cfg.max_detections)
            detections.append(Detections(boxes, scores, classes))
        return detections


    def decoding(self) -> PriorBoxDecoding:
        """The priors' settings, the variances and model.decoder's thresholds: an engine backend adds the decoded
        boxes and its NMS from them (engines/tensorrt_backend.py), DeepStream its NMS plugin."""
        size, priors, decoder = self.spec.dataset.image_size, self.cfg, self.spec.model.decoder
        return PriorBoxDecoding(
            image_hw=(size.height, size.width), map_hws=tuple(tuple(hw) for hw in self.map_hws),
            scales=tuple(priors.scales),
            aspect_ratios=tuple(tuple(priors.ratios_of(k)) for k in range(len(priors.feature_strides))),
            two_boxes_for_ar1=priors.two_boxes_for_ar1, clip_boxes=priors.clip_boxes,
            variances=tuple(priors.variances), num_classes=self.num_classes,
            confidence_threshold=decoder.confidence_threshold, nms_iou=decoder.nms_iou, top_k=decoder.top_k,
            max_detections=decoder.max_detections)

    def nvinfer_layout(self):
        """TAO's SSD parser on the model ending in TensorRT's NMS plugin (models/ssd_deepstream.py)."""
        from qatpipe.models.ssd_deepstream import SsdLayout

        return SsdLayout(self.decoding())


def nms_detections(outputs: dict[str, np.ndarray], size: np.ndarray, max_detections: int) -> list[Detections]:
    """An engine's NMS results for a batch (boxes.NMS_INDICES, NMS_BOXES, NMS_SCORES, NMS_IMAGES) -> detections
    per image: its rows, best first, at most max_detections, boxes scaled by `size` (w h w h) and clipped to it."""
    indices = np.asarray(outputs[NMS_INDICES]).reshape(-1, 3)
    boxes = np.asarray(outputs[NMS_BOXES], np.float32).reshape(-1, 4)
    scores = np.asarray(outputs[NMS_SCORES], np.float32).reshape(-1)
    detections = []
    for image in range(len(outputs[NMS_IMAGES])):
        rows = np.nonzero(indices[:, 0] == image)[0]
        rows = rows[np.argsort(-scores[rows], kind="stable")[:max_detections]]
        detections.append(Detections(np.clip(boxes[rows] * size, 0, size).astype(np.float32), scores[rows],
                                     indices[rows, 1].astype(np.int32)))
    return detections


# ------------------------------------------------------------------------------------ TF box maths


def _iou(a, b):
    """IoU (N, M) of corner boxes a (N, 4) and b (M, 4): boxes.iou_matrix in TensorFlow."""
    tl = tf.maximum(a[:, None, :2], b[None, :, :2])
    br = tf.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = tf.reduce_prod(tf.maximum(br - tl, 0.0), axis=2)
    area_a = tf.reduce_prod(a[:, 2:] - a[:, :2], axis=1)
    area_b = tf.reduce_prod(b[:, 2:] - b[:, :2], axis=1)
    return inter / tf.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-9)


def _corners_to_centres(boxes):
    return tf.concat([(boxes[..., :2] + boxes[..., 2:]) / 2, boxes[..., 2:] - boxes[..., :2]], axis=-1)


def encode_offsets_tf(boxes, priors, variances):
    """boxes.encode_offsets in TensorFlow (the tf.data targets)."""
    v = tf.constant(variances, tf.float32)
    return tf.concat([(boxes[..., :2] - priors[..., :2]) / priors[..., 2:] / v[:2],
                      tf.math.log(tf.maximum(boxes[..., 2:], 1e-8) / priors[..., 2:]) / v[2:]], axis=-1)


# ------------------------------------------------------------------------------------------ losses


def ssd_class_loss(y_true, y_pred, loss):
    """Softmax cross-entropy over the batch's priors, divided by its positives. hard_negative_mining (TAO): the
    positives plus the neg_pos_ratio x as many background priors with the highest loss; the rest of the
    background and the ignored priors add nothing. focal: every non-ignored prior, weighted by (1 - p)^gamma
    and focal_alpha (background 1 - focal_alpha)."""
    eps = keras.backend.epsilon()
    log_p = tf.math.log(tf.clip_by_value(y_pred, eps, 1.0))
    positive = tf.reduce_sum(y_true[..., 1:], axis=-1)  # (B, P)
    negative = y_true[..., 0]
    positives = tf.reduce_sum(positive)
    if loss.type == "focal":
        p_true = tf.reduce_sum(y_true * y_pred, axis=-1)
        weight = loss.focal_alpha * positive + (1 - loss.focal_alpha) * negative
        focal = -weight * tf.pow(1.0 - p_true, loss.focal_gamma) * tf.reduce_sum(y_true * log_p, axis=-1)
        return tf.reduce_sum(focal) / tf.maximum(positives, 1.0)
    cross_entropy = -tf.reduce_sum(y_true * log_p, axis=-1)  # (B, P): 0 at ignored priors
    negatives = tf.reshape(tf.where(negative > 0, cross_entropy, -1.0), [-1])
    keep = tf.minimum(tf.cast(loss.neg_pos_ratio * positives, tf.int32),
                      tf.cast(tf.reduce_sum(negative), tf.int32))
    hardest = tf.math.top_k(negatives, k=keep, sorted=False).values
    return (tf.reduce_sum(cross_entropy * positive) + tf.reduce_sum(hardest)) / tf.maximum(positives, 1.0)


def ssd_box_loss(y_true, y_pred):
    """Smooth L1 (Huber, delta 1) of the positive priors' offsets, summed and divided by the positives."""
    target, mask = y_true[..., :4], y_true[..., 4:]
    diff = tf.abs(y_pred - target)
    smooth = tf.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5)
    return tf.reduce_sum(smooth * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)
