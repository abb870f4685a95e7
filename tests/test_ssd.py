"""SSD (model.arch: ssd): priors, matching, the losses, encoding and decoding, the model on every backbone,
pruning and the QAT ONNX, and the spec's and checkpoints' errors (issue 35's list)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import tensorflow as tf
import tf_keras as keras

from qatpipe.boxes import centres_to_corners, corners_to_centres, decode_offsets, encode_offsets, iou_matrix, prior_boxes
from qatpipe.errors import ModelFileError, SpecError
from qatpipe.models import get_architecture
from qatpipe.models.backbones import BACKBONES
from qatpipe.models.ssd import CLS, LOC, encode_offsets_tf, ssd_box_loss, ssd_class_loss
from qatpipe.spec import PruneSpec, QatSpec, SsdLossSpec, bundled_spec_path, load_spec

VARIANCES = [0.1, 0.1, 0.2, 0.2]


def ssd_spec(*overrides: str):
    """The tiny spec as an SSD at 128x192 (maps 16x24, 8x12, 4x6, 2x3)."""
    return load_spec(bundled_spec_path("tiny"), ["model.arch=ssd", "dataset.image_size.height=128",
                                                 "dataset.image_size.width=192", *overrides])


# -------------------------------------------------------------------------------------------------- priors


def test_priors_of_one_map_match_a_hand_computation():
    priors = prior_boxes((100, 200), [(2, 4)], [0.3, 0.5], [[1.0, 2.0]], two_boxes_for_ar1=True, clip=False)
    assert priors.shape == (2 * 4 * 3, 4)
    # cell (0, 0): centre (0.5/4, 0.5/2); ar 1: 0.3 x the shorter side (100 px) square; then the second ar-1 box,
    # sqrt(0.3 x 0.5) x 100 px; then ar 2: 30 sqrt(2) px wide, 30 / sqrt(2) px high; widths over 200, heights 100
    second = math.sqrt(0.3 * 0.5) * 100
    expected = [[0.125, 0.25, 30 / 200, 30 / 100], [0.125, 0.25, second / 200, second / 100],
                [0.125, 0.25, 30 * math.sqrt(2) / 200, 30 / math.sqrt(2) / 100]]
    np.testing.assert_allclose(priors[:3], expected, rtol=1e-6)
    # the last cell (row 1, column 3) comes last, row-major as the heads' reshape lays them out
    np.testing.assert_allclose(priors[-3:, :2], [[0.875, 0.75]] * 3)
    clipped = prior_boxes((100, 200), [(2, 4)], [0.3, 0.5], [[1.0, 2.0]], two_boxes_for_ar1=True, clip=True)
    corners = centres_to_corners(clipped)
    assert corners.min() >= 0 and corners.max() <= 1
    assert np.allclose(clipped[-1], priors[-1])  # inside the image already: unchanged


def test_prior_count_follows_the_spec():
    arch = get_architecture(ssd_spec())
    cells = 16 * 24 + 8 * 12 + 4 * 6 + 2 * 3
    assert arch.num_priors == cells * 4  # ratios 1, 2, 0.5 and the second ar-1 box
    arch = get_architecture(ssd_spec("model.ssd.two_boxes_for_ar1=false", "model.ssd.aspect_ratios_global=[1.0]"))
    assert arch.num_priors == cells


# ------------------------------------------------------------------------------------- encoding and decoding


def test_encode_then_decode_returns_the_boxes_in_numpy_and_tensorflow():
    rng = np.random.default_rng(0)
    priors = prior_boxes((128, 192), [(4, 6)], [0.2, 0.4], [[1.0, 2.0, 0.5]], True, False)
    xs, ys = np.sort(rng.uniform(0, 1, (2, len(priors), 2)), axis=2)
    boxes = corners_to_centres(np.stack([xs[:, 0], ys[:, 0], xs[:, 1], ys[:, 1]], axis=1).astype(np.float32))
    offsets = encode_offsets(boxes, priors, VARIANCES)
    np.testing.assert_allclose(decode_offsets(offsets, priors, VARIANCES), boxes, atol=1e-6)
    np.testing.assert_allclose(encode_offsets_tf(tf.constant(boxes), tf.constant(priors), VARIANCES).numpy(),
                               offsets, rtol=1e-5, atol=1e-5)


def test_matching_keeps_each_objects_best_prior_below_the_threshold():
    spec = ssd_spec()
    arch = get_architecture(spec)
    # a thin object no prior overlaps by 0.4; one on a stride-32 cell, the size of its ar-1 prior (0.36 x 128 px),
    # so that prior and the cell's second ar-1 one (0.6 IoU) overlap it by >= 0.5; and padding
    boxes = np.array([[100, 40, 104, 80], [57, 25, 103, 71], [0, 0, 0, 0]], np.float32)
    classes = np.array([2, 0, -1], np.int32)
    targets = {k: v.numpy() for k, v in arch.encode(tf.constant(boxes), tf.constant(classes)).items()}
    cls, loc = targets[CLS], targets[LOC]
    ious = iou_matrix(boxes[:2] / [192, 128, 192, 128], centres_to_corners(arch.priors))
    thin_best = int(np.argmax(ious[0]))
    assert ious[0].max() < spec.model.target.neg_iou_limit
    assert cls[thin_best].argmax() == 1 + 2 and loc[thin_best, 4] == 1  # positive, class cyclist
    above = set(np.nonzero(ious[1] >= spec.model.target.pos_iou_threshold)[0]) | {int(np.argmax(ious[1]))}
    positive = set(np.nonzero(loc[:, 4])[0])
    assert positive == above | {thin_best} and len(above) > 1
    assert all(cls[p].argmax() == 1 for p in above)  # class car
    best = ious.max(axis=0)
    background = np.nonzero((best < spec.model.target.neg_iou_limit) & (loc[:, 4] == 0))[0]
    assert (cls[background, 0] == 1).all() and cls[background].sum() == len(background)
    ignored = np.nonzero((best >= spec.model.target.neg_iou_limit) & (best < spec.model.target.pos_iou_threshold)
                         & (loc[:, 4] == 0))[0]
    assert len(ignored) and (cls[ignored] == 0).all()
    # the positives' offsets decode to their objects
    for prior in (thin_best, *above):
        matched = boxes[0] if prior == thin_best else boxes[1]
        decoded = centres_to_corners(decode_offsets(loc[prior, :4], arch.priors[prior], VARIANCES))
        np.testing.assert_allclose(decoded * [192, 128, 192, 128], matched, atol=1e-3)


def _reference_targets(arch, spec, boxes, classes):
    """SSD's matching in numpy, as encode's docstring states it, on the objects alone (padding rows dropped)."""
    target = spec.model.target
    objects = classes >= 0
    boxes, classes = boxes[objects] / np.array([arch.width, arch.height] * 2, np.float32), classes[objects]
    num_priors = len(arch.priors)
    best_object, best_iou = np.zeros(num_priors, int), np.full(num_priors, -1.0)
    if len(boxes):
        ious = iou_matrix(boxes, centres_to_corners(arch.priors))
        best_object, best_iou = ious.argmax(axis=0), ious.max(axis=0)
        for i, prior in enumerate(ious.argmax(axis=1)):  # each object's best prior, the later object last
            best_object[prior], best_iou[prior] = i, 2.0
    positive, negative = best_iou >= target.pos_iou_threshold, best_iou < target.neg_iou_limit
    cls = np.zeros((num_priors, 1 + arch.num_classes), np.float32)
    cls[positive, 1 + classes[best_object[positive]]] = 1
    cls[negative & ~positive, 0] = 1
    loc = np.zeros((num_priors, 5), np.float32)
    if positive.any():
        matched = corners_to_centres(boxes[best_object[positive]].astype(np.float32))
        loc[positive, :4] = encode_offsets(matched, arch.priors[positive], VARIANCES)
        loc[positive, 4] = 1
    return cls, loc


def test_encode_matches_a_numpy_matching_with_padding_anywhere_and_without_objects():
    spec = ssd_spec()
    arch = get_architecture(spec)
    rng = np.random.default_rng(3)
    for count in (0, 1, 2, 5, 9):
        x1, y1 = rng.uniform(0, 150, count), rng.uniform(0, 90, count)
        w, h = rng.uniform(6, 60, count), rng.uniform(6, 60, count)
        objects = np.stack([x1, y1, np.minimum(x1 + w, 192), np.minimum(y1 + h, 128)], axis=1)
        # padding rows between the objects too, as augmentation leaves them (a dropped object's class is -1)
        rows = rng.permutation(12)[:count]
        boxes, classes = np.zeros((12, 4), np.float32), np.full(12, -1, np.int32)
        boxes[rows], classes[rows] = objects, rng.integers(0, arch.num_classes, count)
        targets = arch.encode(tf.constant(boxes), tf.constant(classes))
        cls, loc = _reference_targets(arch, spec, boxes, classes)
        np.testing.assert_array_equal(targets[CLS].numpy(), cls, err_msg=f"{count} objects")
        np.testing.assert_allclose(targets[LOC].numpy(), loc, atol=1e-5, err_msg=f"{count} objects")


def test_decode_returns_the_planted_box_and_class():
    spec = ssd_spec()
    arch = get_architecture(spec)
    box = np.array([40, 30, 90, 70], np.float32)
    prior = 500
    cls = np.zeros((1, arch.num_priors, 4), np.float32)
    cls[..., 0] = 1.0
    cls[0, prior] = [0.1, 0.0, 0.9, 0.0]
    loc = np.zeros((1, arch.num_priors, 4), np.float32)
    loc[0, prior] = encode_offsets(corners_to_centres(box / [192, 128, 192, 128]), arch.priors[prior], VARIANCES)
    [found] = arch.decode({CLS: cls, LOC: loc})
    assert len(found) == 1 and found.classes[0] == 1 and found.scores[0] == pytest.approx(0.9)
    np.testing.assert_allclose(found.boxes[0], box, atol=1e-3)


# ------------------------------------------------------------------------------------------------- losses


def _softmax(logits):
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_hard_negative_mining_keeps_exactly_the_ratio_and_matches_a_hand_computation():
    rng = np.random.default_rng(1)
    batch, priors, classes = 2, 50, 3
    y_pred = _softmax(rng.normal(size=(batch, priors, 1 + classes))).astype(np.float32)
    kind = rng.permutation(np.array([1] * 3 + [0] * 40 + [-1] * 57))[: batch * priors].reshape(batch, priors)
    kind.flat[rng.choice(batch * priors, 3, replace=False)] = 1  # three positives, the rest negative or ignored
    labels = rng.integers(1, 1 + classes, size=(batch, priors))
    y_true = np.zeros_like(y_pred)
    for (b, p), k in np.ndenumerate(kind):
        if k == 1:
            y_true[b, p, labels[b, p]] = 1
        elif k == 0:
            y_true[b, p, 0] = 1
    positives = int((kind == 1).sum())
    ce = -np.log(np.clip((y_true * y_pred).sum(-1), 1e-7, 1))
    negative_ce = np.sort(ce[kind == 0])[::-1]
    for ratio in (3.0, 1.0, 1000.0):  # 1000: more than there are negatives, so all of them
        kept = min(int(ratio * positives), len(negative_ce))
        expected = (ce[kind == 1].sum() + negative_ce[:kept].sum()) / positives
        loss = ssd_class_loss(tf.constant(y_true), tf.constant(y_pred), SsdLossSpec(neg_pos_ratio=ratio))
        assert float(loss) == pytest.approx(expected, rel=1e-5)
    # focal: every non-ignored prior, (1 - p)^gamma-weighted, alpha for objects and 1 - alpha for background
    focal = SsdLossSpec(type="focal", focal_gamma=2.0, focal_alpha=0.25)
    p_true = (y_true * y_pred).sum(-1)
    weight = np.where(kind == 1, 0.25, np.where(kind == 0, 0.75, 0.0))
    expected = (weight * (1 - p_true) ** 2 * ce).sum() / positives
    assert float(ssd_class_loss(tf.constant(y_true), tf.constant(y_pred), focal)) == pytest.approx(expected, rel=1e-5)


def test_box_loss_is_smooth_l1_over_the_positives():
    target = np.array([[[0.0, 0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]],
                      np.float32)
    pred = np.array([[[0.5, -2.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0], [0.0, 0.0, 0.0, 3.0]]], np.float32)
    # positives 0 and 2: 0.5 x 0.5^2 + (2 - 0.5) + (3 - 0.5) over 2 positives; prior 1 (negative) adds nothing
    expected = (0.125 + 1.5 + 2.5) / 2
    assert float(ssd_box_loss(tf.constant(target), tf.constant(pred))) == pytest.approx(expected)


# -------------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_every_backbone_gives_the_maps_and_the_model_loads_without_custom_objects(backbone, tmp_path):
    spec = ssd_spec(f"model.backbone.name={backbone}", "model.ssd.fpn=true")
    arch = get_architecture(spec)
    model = arch.build_model()
    assert model.output_shape == [(None, arch.num_priors, 4), (None, arch.num_priors, 4)]
    heads = [layer.name for layer in model.layers if layer.name.startswith("ssd_conv_cls_")]
    assert heads == [f"ssd_conv_cls_{s}" for s in spec.model.ssd.feature_strides]
    assert {layer.name for layer in model.layers} >= {"ssd_fpn_up_8", "ssd_fpn_add_8", "ssd_extra_64_conv_2"}
    images = np.random.default_rng(0).uniform(size=(1, 128, 192, 3)).astype(np.float32)
    cls, _ = model(np.concatenate([images, images[:, ::-1]]), training=True)
    # the class head starts out on background
    assert float(cls.numpy()[..., 0].mean()) == pytest.approx(0.99, abs=0.02)
    model.save(tmp_path / "ssd.keras")
    loaded = keras.models.load_model(tmp_path / "ssd.keras", compile=False)
    np.testing.assert_allclose(loaded(images)[1].numpy(), model(images)[1].numpy(), atol=1e-5)


def test_a_checkpoint_of_the_other_arch_or_other_priors_is_named(tmp_path):
    detectnet = get_architecture(load_spec(bundled_spec_path("tiny"))).build_model()
    ssd = get_architecture(ssd_spec())
    with pytest.raises(ModelFileError, match=r"detectnet\.keras: outputs .* are not SSD's .*another model\.arch"):
        ssd.check_model(detectnet, str(tmp_path / "detectnet.keras"))
    other = get_architecture(ssd_spec("model.ssd.two_boxes_for_ar1=false")).build_model()
    with pytest.raises(ModelFileError, match=r"other\.keras: model has 1530 priors, the spec's model\.ssd"):
        ssd.check_model(other, "other.keras")


@pytest.mark.parametrize("override, message", [
    ("model.ssd.scales=[0.1,0.2,1.5,0.6,0.9]", "model.ssd: .*scales .* must increase within \\(0, 1\\]"),
    ("model.ssd.scales=[0.1,0.2,0.3]", "model.ssd: .*scales has 3 values; feature_strides has 4 maps"),
    ("model.ssd.aspect_ratios_global=[1.0,20.0]", "model.ssd: .*aspect ratios \\[1.0, 20.0\\] .* within \\[1/8, 8\\]"),
    ("model.ssd.feature_strides=[16,8]", "model.ssd: .*feature_strides \\[16, 8\\] must increase"),
    ("model.target.neg_iou_limit=0.7", "model.target: .*neg_iou_limit 0.7 > pos_iou_threshold 0.5"),
    ("dataset.image_size.height=96", "must be a multiple of 64, model.arch ssd's largest stride"),
])
def test_priors_that_cannot_cover_the_image_name_the_key(override, message):
    with pytest.raises(SpecError, match=message):
        ssd_spec(override)


# ------------------------------------------------------------------------------------- pruning and QAT


def _bn_stats(model, seed=0):
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, n), rng.normal(0, 0.3, n), rng.normal(0, 0.2, n),
                               rng.uniform(0.5, 2.0, n)])


def test_pruning_keeps_the_heads_whole_and_the_fpn_adds_aligned():
    from qatpipe.pruning import prune_model
    from qatpipe.pruning.graph import analyse

    keras.utils.set_random_seed(0)
    model = get_architecture(ssd_spec("model.ssd.fpn=true")).build_model()
    graph = analyse(model, set())
    head = graph.groups[graph.group_of_output["ssd_conv_cls_8"]]
    assert not head.prunable and "ssd_cls_reshape_8 (Reshape) reads them" in head.reason
    # the top-down path ties each map's lateral conv to the upsampled coarser one
    lateral = graph.group_of_output["ssd_fpn_lateral_8"]
    assert graph.group_of_output["ssd_fpn_add_8"] == lateral == graph.group_of_output["ssd_fpn_lateral_16"]
    pruned, report = prune_model(model, PruneSpec(threshold=0.9, min_filters=8))
    assert report.params_after < report.params_before
    assert pruned.output_shape == model.output_shape
    images = np.random.default_rng(0).uniform(size=(2, 128, 192, 3)).astype(np.float32)
    assert all(np.isfinite(o.numpy()).all() for o in pruned(images))


def test_the_qat_onnx_passes_the_rule_and_layer_checks(tmp_path):
    from qatpipe.export.layer_check import layer_differences
    from qatpipe.export.onnx_export import export_onnx, save_onnx
    from qatpipe.export.qdq import check_explicit_quantization, fold_weight_quantizers
    from qatpipe.quantization.transform import calibrate, quantize_model

    keras.utils.set_random_seed(0)
    model = get_architecture(ssd_spec("model.ssd.fpn=true")).build_model()
    _bn_stats(model)
    images = np.random.default_rng(4).uniform(size=(4, 128, 192, 3)).astype(np.float32)
    qat = quantize_model(model, QatSpec())
    calibrate(qat, [images], 1)
    path = export_onnx(qat, tmp_path / "qat.onnx", 17)
    proto = onnx.load(path)
    fold_weight_quantizers(proto)
    check = check_explicit_quantization(proto)
    save_onnx(proto, path)
    weighted = [layer for layer in model.layers if type(layer) in (keras.layers.Conv2D,
                                                                   keras.layers.DepthwiseConv2D)]
    assert check.problems == [] and check.float_ == [] and len(check.quantized) == len(weighted)
    # every Add quantizes its inputs: the backbone's residual adds and the top-down path's
    assert len(check.residual_adds) == sum(type(layer) is keras.layers.Add for layer in model.layers)
    assert layer_differences(qat, onnx.load(path), images)["failed"] == []


def test_a_resume_refuses_other_priors_and_accepts_the_same_ssd_spec(tmp_path):
    from qatpipe.errors import QatpipeError
    from qatpipe.spec import dump_spec
    from qatpipe.stages.train import SPEC_FILE, _check_resume_compatible

    dump_spec(ssd_spec(), tmp_path / SPEC_FILE)
    _check_resume_compatible(tmp_path, ssd_spec())  # the same spec resumes
    with pytest.raises(QatpipeError, match=r"whose model\.ssd differs from this spec"):
        _check_resume_compatible(tmp_path, ssd_spec("model.ssd.two_boxes_for_ar1=false"))
    with pytest.raises(QatpipeError, match=r"whose model\.arch, model\.loss, model\.target, model\.ssd differs"):
        _check_resume_compatible(tmp_path, load_spec(bundled_spec_path("tiny"), ["dataset.image_size.height=128",
                                                                                 "dataset.image_size.width=192"]))


def test_the_registered_model_is_named_after_the_arch_unless_the_spec_names_it():
    assert ssd_spec().tracking.registered_model == "qatpipe-ssd"
    assert load_spec(bundled_spec_path("tiny")).tracking.registered_model == "qatpipe-detectnet-v2"
    assert ssd_spec("tracking.registered_model=mine").tracking.registered_model == "mine"


def test_the_bundled_specs_run_as_ssd_with_only_the_arch_changed():
    for name in ("default", "tiny"):
        spec = load_spec(bundled_spec_path(name), ["model.arch=ssd"])
        assert spec.model.arch == "ssd" and spec.model.backbone == load_spec(bundled_spec_path(name)).model.backbone
