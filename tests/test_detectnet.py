"""DetectNet_v2: model shapes, target encoder -> decoder round trip, clustering, model files."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from qatpipe.boxes import dbscan_cluster, iou_matrix, nms
from qatpipe.errors import ModelFileError
from qatpipe.models import get_architecture
from qatpipe.models.detectnet_v2 import decode_detectnet
from qatpipe.models.io import load_keras_model
from qatpipe.spec import parse_spec


def make_spec(**decoder):
    return parse_spec({
        "dataset": {"train": "t", "val": "v", "classes": ["car", "pedestrian", "cyclist"],
                    "image_size": {"height": 192, "width": 320}},
        "model": {"arch": "detectnet_v2", "backbone": {"depth": 10, "width": 0.25}, "pretrained": None,
                  "decoder": decoder},
    })


def encode(arch, boxes, classes, max_boxes=16):
    padded = np.zeros((max_boxes, 4), np.float32)
    padded_cls = np.full(max_boxes, -1, np.int32)
    padded[: len(boxes)], padded_cls[: len(classes)] = boxes, classes
    return {k: v.numpy() for k, v in arch.encode(tf.constant(padded), tf.constant(padded_cls)).items()}


def roundtrip(arch, targets):
    c = arch.num_classes
    outputs = {"output_cov": targets["output_cov"][None], "output_bbox": targets["output_bbox"][None][..., : 4 * c]}
    return arch.decode(outputs)[0]


@pytest.mark.parametrize("method", ["nms", "dbscan"])
def test_encoder_decoder_roundtrip_recovers_boxes(method):
    arch = get_architecture(make_spec(method=method))
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = rng.integers(1, 6)
        boxes, classes = [], []
        while len(boxes) < n:  # well-separated boxes of mixed sizes, 18..120 px
            w, h = rng.uniform(18, 120, 2)
            x1, y1 = rng.uniform(0, 320 - w), rng.uniform(0, 192 - h)
            box = np.array([x1, y1, x1 + w, y1 + h], np.float32)
            if boxes and iou_matrix(box[None], np.array(boxes)).max() > 0.0:
                continue
            boxes.append(box)
            classes.append(int(rng.integers(0, 3)))
        boxes = np.array(boxes)
        dets = roundtrip(arch, encode(arch, boxes, classes))
        assert len(dets) == len(boxes)
        ious = iou_matrix(boxes, dets.boxes)
        best = ious.argmax(axis=1)
        assert (ious.max(axis=1) > 0.9).all()
        assert (dets.classes[best] == np.array(classes)).all()


def test_overlapping_boxes_of_different_classes_are_both_recovered():
    arch = get_architecture(make_spec())
    boxes = np.array([[100, 40, 220, 120], [150, 50, 190, 150]], np.float32)  # a car and a pedestrian across it
    dets = roundtrip(arch, encode(arch, boxes, [0, 1]))
    assert sorted(dets.classes.tolist()) == [0, 1]
    assert (iou_matrix(boxes, dets.boxes).max(axis=1) > 0.9).all()


def test_tiny_object_still_gets_a_covered_cell():
    arch = get_architecture(make_spec())
    targets = encode(arch, np.array([[101, 51, 107, 59]], np.float32), [2])
    assert targets["output_cov"][..., 2].sum() >= 1
    assert targets["output_cov"][..., :2].sum() == 0
    mask = targets["output_bbox"][..., 12:]  # the coverage mask rides along for the bbox loss
    np.testing.assert_array_equal(mask, targets["output_cov"])


def test_padding_is_ignored():
    arch = get_architecture(make_spec())
    targets = encode(arch, np.zeros((0, 4), np.float32), [])
    assert targets["output_cov"].sum() == 0 and np.abs(targets["output_bbox"]).sum() == 0


def test_nms_and_dbscan_cluster():
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [50, 50, 60, 60], [0, 0, 10, 9]], np.float32)
    scores = np.array([0.6, 0.9, 0.5, 0.7], np.float32)
    kept, kept_scores = nms(boxes, scores, 0.5)
    np.testing.assert_array_equal(kept, boxes[[1, 2]])
    np.testing.assert_allclose(kept_scores, [0.9, 0.5])
    clustered, cluster_scores = dbscan_cluster(boxes, scores, eps=0.3, min_samples=1)
    assert len(clustered) == 2
    np.testing.assert_allclose(cluster_scores, [0.9, 0.5])
    weights = scores[[0, 1, 3]]
    np.testing.assert_allclose(clustered[0], (boxes[[0, 1, 3]] * weights[:, None]).sum(0) / weights.sum(), rtol=1e-6)
    # min_samples=3 needs 3 neighbours (itself included): the lone box at (50, 50) is noise
    clustered, _ = dbscan_cluster(boxes, scores, eps=0.3, min_samples=3)
    assert len(clustered) == 1


def test_decoder_threshold_and_max_detections():
    spec = make_spec(coverage_threshold=0.5, max_detections=1)
    coverage = np.zeros((12, 20, 3), np.float32)
    coverage[2, 3, 0], coverage[8, 15, 1], coverage[5, 5, 2] = 0.9, 0.7, 0.4  # the last is below threshold
    bbox = np.full((12, 20, 12), 0.5, np.float32)
    dets = decode_detectnet(coverage, bbox, 16, 35.0, spec.model.decoder, (192, 320))
    assert len(dets) == 1 and dets.classes.tolist() == [0]
    np.testing.assert_allclose(dets.boxes[0], [56 - 17.5, 40 - 17.5, 56 + 17.5, 40 + 17.5])


def test_model_outputs_and_plain_reload(tmp_path):
    arch = get_architecture(make_spec())
    model = arch.build_model()
    cov, bbox = model(np.zeros((2, 192, 320, 3), np.float32))
    assert cov.shape == (2, 12, 20, 3) and bbox.shape == (2, 12, 20, 12)
    assert {layer.name for layer in model.layers} >= {"conv1", "block_1a_conv_1", "block_4a_conv_shortcut"}
    path = tmp_path / "m.keras"
    model.save(path)
    reloaded = load_keras_model(path, arch)  # no custom objects needed
    x = np.random.default_rng(0).random((1, 192, 320, 3), np.float32)
    np.testing.assert_allclose(reloaded(x)[0], model(x)[0], atol=1e-6)


def test_model_file_errors(tmp_path):
    with pytest.raises(ModelFileError, match="missing.keras: model file not found"):
        load_keras_model(tmp_path / "missing.keras")
    corrupt = tmp_path / "corrupt.keras"
    corrupt.write_bytes(b"not a zip")
    with pytest.raises(ModelFileError, match="corrupt.keras: corrupt model file"):
        load_keras_model(corrupt)
    wrong = tmp_path / "model.onnx"
    wrong.write_bytes(b"\x08\x07")
    with pytest.raises(ModelFileError, match=r"model.onnx: not a Keras model file"):
        load_keras_model(wrong)
    import tf_keras as keras

    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="logits")])
    other.save(tmp_path / "classifier.keras")
    arch = get_architecture(make_spec())
    with pytest.raises(ModelFileError, match=r"classifier.keras: outputs \['logits'\] are not DetectNet_v2's"):
        load_keras_model(tmp_path / "classifier.keras", arch)
    arch.build_model().save(tmp_path / "detector.keras")
    two_classes = parse_spec({"dataset": {"train": "t", "val": "v", "classes": ["a", "b"],
                                          "image_size": {"height": 192, "width": 320}},
                              "model": {"arch": "detectnet_v2"}})
    with pytest.raises(ModelFileError, match="model predicts 3 classes, the spec's dataset.classes has 2"):
        load_keras_model(tmp_path / "detector.keras", get_architecture(two_classes))
    other_size = make_spec().model_copy(deep=True)
    other_size.dataset.image_size.height = 96
    with pytest.raises(ModelFileError, match="model input is 192x320, the spec's dataset.image_size is 96x320"):
        load_keras_model(tmp_path / "detector.keras", get_architecture(other_size))


def test_backbone_width_scales_filters_with_a_floor():
    import tf_keras as keras

    from qatpipe.models.resnet import resnet_backbone

    def stage_filters(width):
        model = keras.Model(*(lambda i: (i, resnet_backbone(i, 10, width)))(keras.Input((64, 64, 3))))
        return [model.get_layer(f"block_{s}a_conv_1").filters for s in range(1, 5)]

    assert stage_filters(1.0) == [64, 128, 256, 512]
    assert stage_filters(0.5) == [32, 64, 128, 256]
    assert stage_filters(0.0625) == [16, 16, 16, 32]  # floor of 16 (see MIN_FILTERS)


@pytest.mark.parametrize("normalizer", ["objects", "cells"])
def test_coverage_loss_class_signal_and_the_number_of_classes(normalizer):
    """What naming the wrong class at an object costs: with `objects` the same for 3 or 10 classes and any grid;
    with TAO's `cells` mean it shrinks as classes (and cells) are added, which left 10 classes unlearnt."""
    costs = {}
    for classes, size in ((3, (192, 320)), (10, (192, 320)), (10, (384, 640))):
        spec = parse_spec({"dataset": {"train": "t", "val": "v", "classes": [f"c{k}" for k in range(classes)],
                                       "image_size": {"height": size[0], "width": size[1]}},
                           "model": {"arch": "detectnet_v2",
                                     "loss": {"coverage_normalizer": normalizer, "class_weight": 0.0}}})
        arch = get_architecture(spec)
        target = encode(arch, np.array([[100, 50, 140, 90]], np.float32), [1])["output_cov"][None]
        background = np.full_like(target, 0.01)
        right, wrong = background.copy(), background.copy()
        cell = target[0].max(axis=-1) > 0
        right[0][cell, 1], wrong[0][cell, 0] = 0.9, 0.9
        loss = arch.losses()["output_cov"]
        costs[classes, size] = float(loss(tf.constant(target), tf.constant(wrong))) - float(
            loss(tf.constant(target), tf.constant(right)))
    base = costs[3, (192, 320)]
    assert base > 0
    if normalizer == "objects":
        assert costs[10, (192, 320)] == pytest.approx(base, rel=1e-4)
        assert costs[10, (384, 640)] == pytest.approx(base, rel=1e-4)
    else:
        assert costs[10, (192, 320)] == pytest.approx(base * 3 / 10, rel=1e-4)
        assert costs[10, (384, 640)] == pytest.approx(base * 3 / 40, rel=1e-4)


def test_class_cross_entropy_term_makes_classes_compete_at_object_cells_only():
    """model.loss.class_weight adds a softmax cross-entropy over the class logits at object cells, averaged over
    them: it equals the hand-computed value, ignores background cells, and a shift of every logit of a cell
    (more or less coverage as a whole) leaves it unchanged."""
    def spec(weight):
        return parse_spec({"dataset": {"train": "t", "val": "v", "classes": [f"c{k}" for k in range(4)],
                                       "image_size": {"height": 192, "width": 320}},
                           "model": {"arch": "detectnet_v2", "loss": {"class_weight": weight}}})

    arch = get_architecture(spec(0.0))
    target = encode(arch, np.array([[100, 50, 140, 90], [200, 100, 260, 150]], np.float32), [1, 3])["output_cov"][None]
    object_cells = target[0].max(axis=-1) > 0
    rng = np.random.default_rng(0)
    logits = rng.normal(-2.0, 1.5, target.shape).astype(np.float32)

    def term(weight, logits):
        pred = tf.constant(1 / (1 + np.exp(-logits)))
        with_term = get_architecture(spec(weight)).losses()["output_cov"](tf.constant(target), pred)
        return float(with_term) - float(arch.losses()["output_cov"](tf.constant(target), pred))

    at_cells = logits[0][object_cells]
    log_softmax = at_cells - np.log(np.exp(at_cells).sum(axis=-1, keepdims=True))
    expected = -(target[0][object_cells] * log_softmax).sum(axis=-1).mean()
    assert term(1.0, logits) == pytest.approx(expected, rel=1e-4)
    assert term(2.0, logits) == pytest.approx(2 * expected, rel=1e-4)

    shifted = logits.copy()
    shifted[0][object_cells] += 1.5  # the same class ranking, more coverage
    background = logits.copy()
    background[0][~object_cells] = rng.normal(0.0, 3.0, background[0][~object_cells].shape)
    assert term(1.0, shifted) == pytest.approx(expected, rel=1e-3)
    assert term(1.0, background) == pytest.approx(expected, rel=1e-4)

    right, wrong = logits.copy(), logits.copy()
    right[0][object_cells] = np.where(target[0][object_cells] > 0, 3.0, -3.0)
    wrong[0][object_cells] = np.where(target[0][object_cells] > 0, -3.0, 3.0)
    assert term(1.0, right) < 0.01 < 5.0 < term(1.0, wrong)
