"""SSD deployment (issue 35 items 5 and 7): the decoded boxes as ONNX ops, the decoding an export carries for the
engine backends, SSD's per-class NMS against a reference written here from its definition, TensorRT's NMS in the
engine (its outputs decoded like the heads; the build itself only where TensorRT runs), and the DeepStream config
and model in the form TAO's NvDsInferParseCustomNMSTLT reads."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from qatpipe.boxes import (NMS_BOXES, NMS_IMAGES, NMS_INDICES, NMS_SCORES, centres_to_corners, decode_offsets,
                           per_class_nms)
from qatpipe.engines.tensorrt_backend import TensorRTBackend, join_batches
from qatpipe.errors import ModelFileError, QatpipeError
from qatpipe.models import get_architecture
from qatpipe.models.decoding import (BOXES, DECODING_KEY, LEGACY_KEY, SCORES, PriorBoxDecoding, add_decoded_boxes,
                                     read_decoding)
from qatpipe.spec import bundled_spec_path, load_spec

TENSORRT_MISSING = TensorRTBackend.unavailable_reason()
needs_tensorrt = pytest.mark.skipif(TENSORRT_MISSING is not None, reason=f"TensorRT: {TENSORRT_MISSING}")
VARIANCES = (0.1, 0.1, 0.2, 0.2)


def ssd_spec(*overrides: str):
    """The tiny spec as an SSD at 128x192 (maps 16x24, 8x12, 4x6, 2x3: 2,040 priors)."""
    return load_spec(bundled_spec_path("tiny"), ["model.arch=ssd", "dataset.image_size.height=128",
                                                 "dataset.image_size.width=192", *overrides])


def run(model, feeds: dict) -> dict:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A random-weight SSD through the export stage (FP32 ONNX, checked against TensorFlow), heads scaled up so
    that its boxes and classes spread; with a batch of random images and ONNX Runtime's outputs on it."""
    from qatpipe.stages.export import export

    spec = ssd_spec("export.fp16_onnx=false")  # the FP16 form's guard reads training images
    arch = get_architecture(spec)
    model = arch.build_model()
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if layer.name.startswith(("ssd_conv_cls_", "ssd_conv_loc_")):
            kernel, bias = layer.get_weights()
            layer.set_weights([rng.normal(0, 0.05, kernel.shape).astype(np.float32),
                               rng.normal(0, 0.5, bias.shape).astype(np.float32)])
    folder = tmp_path_factory.mktemp("ssd_export")
    model.save(folder / "ssd.keras")
    report = export(spec, folder / "ssd.keras", folder / "ssd.onnx")
    images = rng.uniform(size=(3, *arch.input_hw, 3)).astype(np.float32)
    proto = onnx.load(folder / "ssd.onnx")
    return SimpleNamespace(spec=spec, arch=arch, onnx=folder / "ssd.onnx", proto=proto, report=report,
                           images=images, outputs=run(proto, {"input_1": images}))


# ------------------------------------------------------------------------------------------- decoded boxes


def _heads_graph(priors: int, classes: int):
    """output_cls and output_loc as graph inputs passed through (the SSD ONNX's outputs, without a network)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["cls"], ["output_cls"]), helper.make_node("Identity", ["loc"], ["output_loc"])],
        "heads", [helper.make_tensor_value_info("cls", TensorProto.FLOAT, ["batch", priors, 1 + classes]),
                  helper.make_tensor_value_info("loc", TensorProto.FLOAT, ["batch", priors, 4])],
        [helper.make_tensor_value_info("output_cls", TensorProto.FLOAT, ["batch", priors, 1 + classes]),
         helper.make_tensor_value_info("output_loc", TensorProto.FLOAT, ["batch", priors, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_decoded_boxes_are_boxes_py_decoding_in_standard_onnx_ops():
    rng = np.random.default_rng(1)
    priors = np.concatenate([rng.uniform(0, 1, (300, 2)), rng.uniform(0.02, 0.6, (300, 2))], axis=1).astype(np.float32)
    model = add_decoded_boxes(_heads_graph(300, 3), priors, VARIANCES, scores=True)
    onnx.checker.check_model(model, full_check=True)
    ops = {node.op_type for node in model.graph.node} - {"Identity"}
    assert ops <= {"Slice", "Mul", "Add", "Clip", "Exp", "Sub", "Concat"}  # what TensorRT's parser reads
    loc = rng.normal(0, 2, (2, 300, 4)).astype(np.float32)
    loc[1, :10, 2:] = rng.choice([-500.0, 500.0], size=(10, 2))  # beyond decode_offsets' exp clip
    cls = rng.uniform(size=(2, 300, 4)).astype(np.float32)
    out = run(model, {"loc": loc, "cls": cls})
    assert [o.name for o in model.graph.output] == ["output_cls", "output_loc", BOXES, SCORES]
    expected = centres_to_corners(decode_offsets(loc, priors, VARIANCES))
    np.testing.assert_allclose(out[BOXES][0], expected[0], atol=1e-5)
    np.testing.assert_allclose(out[BOXES][1], expected[1], rtol=1e-5, atol=1e-5)  # the clipped ones are large
    np.testing.assert_array_equal(out[SCORES], cls[..., 1:])
    np.testing.assert_array_equal(out["output_loc"], loc)  # the heads stay as they were
    with pytest.raises(QatpipeError, match="not an SSD ONNX: no output output_loc"):
        add_decoded_boxes(helper.make_model(helper.make_graph([], "g", [], [])), priors, VARIANCES)


def test_decoded_boxes_of_an_exported_ssd_match_numpy_on_onnx_runtime(exported):
    arch = exported.arch
    model = add_decoded_boxes(exported.proto, arch.priors, arch.variances, scores=True)
    out = run(model, {"input_1": exported.images})
    loc = exported.outputs["output_loc"]
    assert np.abs(loc).max() > 0.5  # offsets that move the boxes off their priors
    np.testing.assert_allclose(out[BOXES], centres_to_corners(decode_offsets(loc, arch.priors, arch.variances)),
                               atol=1e-5)
    np.testing.assert_array_equal(out[SCORES], exported.outputs["output_cls"][..., 1:])


def test_the_export_carries_the_ssd_decoding_and_ptq_keeps_it(exported, tmp_path):
    from qatpipe.stages.ptq import _finish

    decoding = read_decoding(exported.proto)
    assert isinstance(decoding, PriorBoxDecoding)
    assert decoding == exported.arch.decoding() and exported.report["metadata"] == [DECODING_KEY]
    np.testing.assert_array_equal(decoding.priors(), exported.arch.priors)  # the SSD's own priors, exactly
    assert decoding.variances == VARIANCES and decoding.num_classes == 3
    decoder = exported.spec.model.decoder
    assert (decoding.confidence_threshold, decoding.nms_iou, decoding.top_k, decoding.max_detections) == (
        decoder.confidence_threshold, decoder.nms_iou, decoder.top_k, decoder.max_detections)
    # DetectNet_v2 has no decoding record: its engines output its heads
    assert get_architecture(load_spec(bundled_spec_path("tiny"))).decoding() is None
    # a quantizer that drops the FP32 model's metadata: PTQ's finish gives it back beside what made the model
    stripped = onnx.ModelProto.FromString(exported.proto.SerializeToString())
    del stripped.metadata_props[:]
    onnx.save(stripped, tmp_path / "int8.onnx")
    _finish(tmp_path / "int8.onnx", "a quantizer", exported.onnx)
    assert read_decoding(onnx.load(tmp_path / "int8.onnx")) == decoding


def test_an_ssd_exported_before_the_decoding_had_a_kind_is_still_read(exported):
    """Exports before the record was typed wrote the SSD's fields, without a kind, under LEGACY_KEY."""
    import json

    decoding = read_decoding(exported.proto)
    old = onnx.ModelProto.FromString(exported.proto.SerializeToString())
    fields = json.loads(decoding.to_json())
    assert fields.pop("kind") == "prior_boxes"
    onnx.helper.set_model_props(old, {LEGACY_KEY: json.dumps(fields, sort_keys=True)})
    assert [p.key for p in old.metadata_props] == [LEGACY_KEY] and read_decoding(old) == decoding
    onnx.helper.set_model_props(old, {DECODING_KEY: json.dumps({**fields, "kind": "yolo_grid"})})
    with pytest.raises(ModelFileError, match="decoding kind 'yolo_grid' is not one of prior_boxes"):
        read_decoding(old)


# ------------------------------------------------------------------------------------ the engine's NMS results


def test_decode_reads_an_engines_nms_results():
    """NMS results of a batch of three (rows of image, class, prior; boxes as fractions), the last image keeping
    nothing: per image best first, boxes in input pixels clipped to the image, at most max_detections."""
    arch = get_architecture(ssd_spec("model.decoder.max_detections=2"))
    outputs = {NMS_INDICES: np.array([[0, 1, 9], [1, 2, 7], [0, 0, 3], [1, 0, 4], [0, 2, 5]], np.int32),
               NMS_BOXES: np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 1.2, 0.9], [-0.1, 0.0, 0.5, 0.5],
                                    [0.0, 0.0, 1.0, 1.0], [0.2, 0.2, 0.4, 0.4]], np.float32),
               NMS_SCORES: np.array([0.6, 0.9, 0.8, 0.3, 0.1], np.float32),
               NMS_IMAGES: np.zeros(3, np.float32)}
    first, second, third = arch.decode(outputs)
    np.testing.assert_array_equal(first.scores, np.float32([0.8, 0.6]))  # image 0's best two of three
    np.testing.assert_array_equal(first.classes, [0, 1])
    np.testing.assert_allclose(first.boxes, [[0, 0, 96, 64], [19.2, 25.6, 57.6, 51.2]], rtol=1e-6)
    np.testing.assert_array_equal(second.classes, [2, 0])
    np.testing.assert_allclose(second.boxes[0], [96, 64, 192, 115.2], rtol=1e-6)  # x2 clipped to the width
    assert len(third) == 0 and third.boxes.shape == (0, 4)
    empty = {NMS_INDICES: np.zeros((0, 3), np.int32), NMS_BOXES: np.zeros((0, 4), np.float32),
             NMS_SCORES: np.zeros(0, np.float32), NMS_IMAGES: np.zeros(2, np.float32)}
    assert [len(d) for d in arch.decode(empty)] == [0, 0]


def test_chunks_of_a_batch_join_with_their_image_indices_counted_from_the_batch_start():
    part = {NMS_INDICES: np.array([[0, 1, 2], [1, 0, 3]], np.int32), NMS_BOXES: np.zeros((2, 4), np.float32),
            NMS_SCORES: np.array([0.5, 0.4], np.float32), NMS_IMAGES: np.zeros(2, np.float32)}
    later = {NMS_INDICES: np.array([[0, 2, 5]], np.int32), NMS_BOXES: np.ones((1, 4), np.float32),
             NMS_SCORES: np.array([0.7], np.float32), NMS_IMAGES: np.zeros(1, np.float32)}
    joined = join_batches([part, later])
    np.testing.assert_array_equal(joined[NMS_INDICES][:, 0], [0, 1, 2])
    assert len(joined[NMS_IMAGES]) == 3 and part[NMS_INDICES][0, 0] == 0  # the parts are left alone
    heads = join_batches([{"output_cls": np.zeros((2, 5, 4))}, {"output_cls": np.ones((1, 5, 4))}])
    assert heads["output_cls"].shape == (3, 5, 4)


def test_an_engine_is_checked_by_what_the_architecture_decodes(monkeypatch, tmp_path):
    import qatpipe.engines
    from qatpipe.inference import engine_forward

    arch = get_architecture(ssd_spec())

    class Runner:
        def __init__(self, outputs):
            self.outputs, self.metadata = outputs, SimpleNamespace(engine_file="model.engine")

        def run(self, batch):
            return self.outputs

    nms = {NMS_INDICES: np.zeros((0, 3), np.int32), NMS_BOXES: np.zeros((0, 4), np.float32),
           NMS_SCORES: np.zeros(0, np.float32), NMS_IMAGES: np.zeros(1, np.float32)}
    monkeypatch.setattr(qatpipe.engines, "load_engine", lambda folder: Runner(nms))
    forward, _ = engine_forward(tmp_path, arch)
    assert forward(SimpleNamespace(numpy=lambda: None)) is nms
    monkeypatch.setattr(qatpipe.engines, "load_engine", lambda folder: Runner({"other": np.zeros(1)}))
    with pytest.raises(ModelFileError, match=r"engine outputs \['other'\] lack \['output_cls', 'output_loc'\]"):
        engine_forward(tmp_path, arch)


@needs_tensorrt
def test_tensorrt_builds_the_nms_into_an_ssd_engine_and_decodes_like_the_cpu(exported, tmp_path):
    from qatpipe.engines import load_engine
    from qatpipe.stages.build_engine import build_engine

    spec = exported.spec.model_copy(deep=True)
    spec.engine.fp16 = False
    info = build_engine(spec, exported.onnx, tmp_path / "trt", backend="tensorrt")
    assert info["extra"]["nms"]["layer"] == "INMSLayer"
    outputs = load_engine(tmp_path / "trt").run(exported.images)
    assert set(outputs) == {NMS_INDICES, NMS_BOXES, NMS_SCORES, NMS_IMAGES}
    ours, cpu = exported.arch.decode(outputs), exported.arch.decode(exported.outputs)
    assert len(ours) == len(cpu) == len(exported.images)
    for engine_det, cpu_det in zip(ours, cpu):
        assert len(engine_det) and engine_det.classes[0] == cpu_det.classes[0]
        np.testing.assert_allclose(engine_det.boxes[0], cpu_det.boxes[0], atol=1.0)
        assert engine_det.scores[0] == pytest.approx(cpu_det.scores[0], abs=1e-2)


# ---------------------------------------------------------------------------- SSD's NMS, from its definition


def _iou(a, b) -> float:
    """IoU of two boxes x1 y1 x2 y2, from its definition: the shared area over the area either covers."""
    a, b = [float(v) for v in a], [float(v) for v in b]  # in double precision, whatever the boxes' type
    inter = max(min(a[2], b[2]) - max(a[0], b[0]), 0.0) * max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def reference_nms(boxes, scores, confidence_threshold, top_k, nms_iou, max_detections):
    """Greedy per-class NMS as SSD (Caffe's ApplyNMSFast) and TensorRT's NMS plugin define it, written here apart
    from the code under test: per class, the boxes scoring above the threshold, best first (equal scores: the lower
    index first), the first top_k of them; each kept unless its IoU with a box its class already kept is above
    nms_iou; then every class's kept boxes best first (equal scores: class order), the first max_detections.
    Returns (class, box index, score) rows."""
    kept = []
    for c in range(scores.shape[1]):
        ranked = sorted((i for i in range(len(boxes)) if scores[i, c] > confidence_threshold),
                        key=lambda i: (-scores[i, c], i))[:top_k]
        chosen = []
        for i in ranked:
            if all(_iou(boxes[i], boxes[j]) <= nms_iou for j in chosen):
                chosen.append(i)
        kept += [(c, i, scores[i, c]) for i in chosen]
    return sorted(kept, key=lambda row: -row[2])[:max_detections]  # a stable sort: ties stay in class order


def check_against_reference(boxes, scores, confidence_threshold, top_k, nms_iou, max_detections):
    """per_class_nms's boxes, scores and classes are the reference's, in its order; returns the reference's rows."""
    rows = reference_nms(boxes, scores, confidence_threshold, top_k, nms_iou, max_detections)
    kept, kept_scores, kept_classes = per_class_nms(boxes, scores, confidence_threshold, top_k, nms_iou,
                                                    max_detections)
    assert kept_classes.tolist() == [c for c, _, _ in rows]
    np.testing.assert_array_equal(kept_scores, np.array([s for _, _, s in rows], np.float32))
    np.testing.assert_array_equal(kept, boxes[[i for _, i, _ in rows]].reshape(-1, 4).astype(np.float32))
    return rows


def test_ssd_nms_suppresses_within_a_class_and_keeps_other_classes():
    """Box 1 overlaps box 0 (IoU 0.6): suppressed in class 0, where box 0 scores higher, but kept in class 1, where
    box 0 scores below the threshold; box 2 is apart from both and kept; the rows are best first across classes."""
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 6], [20, 20, 30, 30]], np.float32)  # IoU(0, 1) = 60/100
    scores = np.array([[0.9, 0.005], [0.8, 0.7], [0.3, 0.95]], np.float32)
    rows = check_against_reference(boxes, scores, 0.01, 200, 0.5, 100)
    assert [(c, i) for c, i, _ in rows] == [(1, 2), (0, 0), (1, 1), (0, 2)]
    # the same box in another class is not suppressed by the first: classes never suppress each other
    rows = check_against_reference(boxes[:1], np.array([[0.9, 0.8]], np.float32), 0.01, 200, 0.5, 100)
    assert [(c, i) for c, i, _ in rows] == [(0, 0), (1, 0)]
    # a chain: 0 suppresses 1, and 2 (which 1 would have suppressed, but 1 is gone) overlaps 0 little: kept
    chain = np.array([[0, 0, 10, 10], [4, 0, 14, 10], [8, 0, 18, 10]], np.float32)
    rows = check_against_reference(chain, np.array([[0.9], [0.8], [0.7]], np.float32), 0.01, 200, 0.3, 100)
    assert [i for _, i, _ in rows] == [0, 2]
    # nothing above the confidence threshold (a score equal to it included): nothing kept, in the empty forms
    kept, kept_scores, kept_classes = per_class_nms(boxes, np.full((3, 2), 0.01, np.float32), 0.01, 200, 0.5, 100)
    assert kept.shape == (0, 4) and kept_scores.shape == kept_classes.shape == (0,)


def test_ssd_nms_takes_each_classes_top_k_before_suppressing_and_max_detections_after():
    """top_k is per class and before NMS: box 1 (inside top_k 2) is suppressed by box 0 and box 2, apart from both
    but outside top_k, is not kept in its place; max_detections cuts the best of every class."""
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [50, 50, 60, 60], [80, 80, 90, 90]], np.float32)
    one_class = np.array([[0.9], [0.8], [0.7], [0.6]], np.float32)
    assert [i for _, i, _ in check_against_reference(boxes, one_class, 0.01, 2, 0.5, 100)] == [0]
    assert [i for _, i, _ in check_against_reference(boxes, one_class, 0.01, 3, 0.5, 100)] == [0, 2]
    assert [i for _, i, _ in check_against_reference(boxes, one_class, 0.01, 4, 0.5, 100)] == [0, 2, 3]
    two = np.concatenate([one_class, one_class[::-1] - 0.05], axis=1)  # class 1 ranks the boxes the other way
    rows = check_against_reference(boxes, two, 0.01, 1, 0.5, 100)  # top_k 1: each class's best alone
    assert [(c, i) for c, i, _ in rows] == [(0, 0), (1, 3)]
    rows = check_against_reference(boxes, two, 0.01, 4, 0.5, 3)
    assert [(c, i) for c, i, _ in rows] == [(0, 0), (1, 3), (1, 2)]  # scores 0.9, 0.85, 0.75 of the six kept


def test_ssd_nms_orders_by_score_not_by_index():
    """Boxes given worst first: the best one is kept and suppresses the others, and the rows come best first."""
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 9], [0, 0, 10, 8], [30, 30, 40, 40], [60, 60, 70, 70]], np.float32)
    scores = np.array([[0.2], [0.3], [0.9], [0.4], [0.5]], np.float32)
    rows = check_against_reference(boxes, scores, 0.01, 200, 0.5, 100)
    assert [i for _, i, _ in rows] == [2, 4, 3]
    assert [s for _, _, s in rows] == sorted((s for _, _, s in rows), reverse=True)


@pytest.mark.parametrize(("shift", "threshold", "suppressed"), [
    (1.0, 0.5, False),                          # IoU exactly at the threshold: kept (suppressed only above it)
    (1.0, float(np.nextafter(0.5, 0.0)), True),  # the threshold just below the IoU: suppressed
    (1.0, float(np.nextafter(0.5, 1.0)), False),  # the threshold just above the IoU: kept
    (1.0 - 1e-4, 0.5, True),                      # IoU just above 0.5 (the box moved 1e-4 closer): suppressed
    (1.0 + 1e-4, 0.5, False),                     # IoU just below 0.5: kept
])
def test_ssd_nms_at_the_iou_threshold(shift, threshold, suppressed):
    """Boxes 3x1 apart by `shift` along x: IoU (3 - shift) / (3 + shift), exactly 0.5 at shift 1."""
    boxes = np.array([[0, 0, 3, 1], [shift, 0, 3 + shift, 1]], np.float64)
    iou = _iou(boxes[0], boxes[1])
    assert (iou == 0.5) == (shift == 1.0) and (iou > threshold) == suppressed
    rows = check_against_reference(boxes, np.array([[0.9], [0.8]], np.float32), 0.01, 200, threshold, 100)
    assert [i for _, i, _ in rows] == ([0] if suppressed else [0, 1])


@pytest.mark.parametrize("seed", range(12))
def test_ssd_nms_matches_the_reference_on_random_boxes(seed):
    """Hundreds of boxes with integer corners crowded into a small image (most overlap several others; some pairs
    at IoU exactly 0.5), a few classes, thresholds that vary (half of them 0.5 or another binary fraction, which
    IoUs of integer boxes can equal); every third seed with scores rounded to 0.05, so that equal scores meet the
    tie order."""
    rng = np.random.default_rng(seed)
    count, classes = int(rng.integers(50, 400)), int(rng.integers(1, 5))
    corners, sizes = rng.integers(0, 60, (count, 2)), rng.integers(8, 40, (count, 2))
    boxes = np.concatenate([corners, corners + sizes], axis=1).astype(np.float32)
    scores = rng.uniform(0, 1, (count, classes)).astype(np.float32)
    if seed % 3 == 0:
        scores = (np.round(scores * 20) / 20).astype(np.float32)
    nms_iou = [0.25, 0.375, 0.5, 0.625][seed // 2 % 4] if seed % 2 else float(rng.uniform(0.2, 0.7))
    confidence = float(rng.uniform(0, 0.5))
    top_k, max_detections = int(rng.integers(20, count + 10)), int(rng.integers(5, 400))
    check_against_reference(boxes, scores, confidence, top_k, nms_iou, max_detections)
    # the case exercises suppression, not only the threshold and the cuts
    candidates = sum(min(int((scores[:, c] > confidence).sum()), top_k) for c in range(classes))
    assert 0 < len(reference_nms(boxes, scores, confidence, top_k, nms_iou, 10**9)) < candidates


# ------------------------------------------------------------------------------------------------ DeepStream


def _nms_plugin(loc_data, conf_data, prior_data, attributes):
    """TensorRT's NMSDynamic_TRT as its README describes it, for CORNER coding with the variance in the target
    (box = prior + loc): per class but the background, the topK most confident above confidenceThreshold, NMS at
    nmsThreshold (reference_nms, not the code under test), then the keepTopK best of the image as rows (image,
    label, score, x1, y1, x2, y2), label -1 padding; and the keep count (int32 bits in a float tensor)."""
    assert attributes["codeType"] == 1 and attributes["varianceEncodedInTarget"] == 1
    assert attributes["backgroundLabelId"] == 0 and attributes["shareLocation"] == 1
    classes, keep = attributes["numClasses"], attributes["keepTopK"]
    boxes_all = loc_data.reshape(len(loc_data), -1, 4) + prior_data[0, 0].reshape(-1, 4)
    scores_all = conf_data.reshape(len(conf_data), -1, classes)
    detections = np.zeros((len(loc_data), 1, keep, 7), np.float32)
    detections[..., 1] = -1
    counts = np.zeros((len(loc_data), 1, 1, 1), np.float32)
    for i, (boxes, scores) in enumerate(zip(boxes_all, scores_all)):
        kept = reference_nms(boxes, scores[:, 1:], attributes["confidenceThreshold"], attributes["topK"],
                             attributes["nmsThreshold"], keep)
        rows = [[i, c + 1, score, *boxes[prior]] for c, prior, score in kept]
        detections[i, 0, :len(rows)] = np.array(rows, np.float32).reshape(-1, 7)
        counts[i].view(np.int32)[:] = len(rows)
    return detections, counts


def test_deepstream_config_for_an_ssd_names_taos_nms_parser(exported, tmp_path):
    from qatpipe.deploy.deepstream import write_nvinfer_config

    spec = exported.spec
    path = write_nvinfer_config(spec, exported.onnx, tmp_path / "ds", "fp32", network_mode="fp32")
    text = path.read_text()
    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    assert values["parse-bbox-func-name"] == "NvDsInferParseCustomNMSTLT"
    assert values["custom-lib-path"] == "libnvds_infercustomparser_tao.so"
    assert "github.com/NVIDIA-AI-IOT/deepstream_tao_apps" in text  # where users get the library
    assert values["output-blob-names"] == "NMS" and values["cluster-mode"] == "3"  # no clustering: NMS is done
    assert values["pre-cluster-threshold"] == str(spec.model.decoder.confidence_threshold)
    # the parser's class ids count the background (the plugin's backgroundLabelId 0): labels.txt lists it first
    assert values["num-detected-classes"] == "4" and values["network-mode"] == "0"
    assert (tmp_path / "ds" / "labels.txt").read_text().split() == ["background", "car", "pedestrian", "cyclist"]
    layout = exported.arch.nvinfer_layout()
    assert set(layout.properties()) | set(layout.class_attributes()) <= set(text.splitlines())
    # DetectNet_v2 keeps nvinfer's built-in parser and its own labels
    detectnet = load_spec(bundled_spec_path("tiny"))
    detectnet_layout = get_architecture(detectnet).nvinfer_layout()
    assert detectnet_layout.labels(["car"]) == ["car"] and not any("parse-bbox" in line
                                                                   for line in detectnet_layout.properties())


def test_ssd_deepstream_onnx_ends_in_the_nms_plugin_the_parser_reads(exported, tmp_path):
    """The plugin node and its outputs as TAO's SSD export writes them; its inputs on ONNX Runtime are the decoded
    boxes and the class scores; and the plugin's results (emulated) through the parser (emulated) are the CPU
    decoder's detections, with class ids that index labels.txt."""
    from qatpipe.deploy.deepstream import write_nvinfer_config
    from qatpipe.models.ssd_deepstream import nms_tlt_objects

    spec, arch = exported.spec, exported.arch
    write_nvinfer_config(spec, exported.onnx, tmp_path / "ds", "fp32", network_mode="fp32")
    model = onnx.load(tmp_path / "ds" / "ssd_deepstream.onnx")
    (nms,) = [node for node in model.graph.node if node.op_type == "NMSDynamic_TRT"]
    attributes = {a.name: helper.get_attribute_value(a) for a in nms.attribute}
    decoder, num_priors = spec.model.decoder, arch.num_priors
    assert attributes == {
        "shareLocation": 1, "varianceEncodedInTarget": 1, "backgroundLabelId": 0, "numClasses": 4,
        "topK": decoder.top_k, "keepTopK": decoder.max_detections, "confidenceThreshold": pytest.approx(0.01),
        "nmsThreshold": pytest.approx(decoder.nms_iou), "codeType": 1, "inputOrder": [0, 1, 2], "confSigmoid": 0,
        "isNormalized": 1, "isBatchAgnostic": 1}
    assert nms.name == "NMS" and list(nms.output) == ["NMS", "NMS_1"]
    shapes = {o.name: ([d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim],
                       o.type.tensor_type.elem_type) for o in model.graph.output}
    assert shapes == {"NMS": (["batch", 1, decoder.max_detections, 7], TensorProto.FLOAT),
                      "NMS_1": (["batch", 1, 1, 1], TensorProto.FLOAT)}  # the keep count: int32 bits, float type
    # the graph up to the plugin on ONNX Runtime
    model.graph.node.remove(nms)
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                              for name in ("loc_data", "conf_data"))
    out = run(model, {"input_1": exported.images})
    prior_data = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "prior_data"))
    assert out["loc_data"].shape == (3, num_priors * 4, 1, 1) and prior_data.shape == (1, 2, num_priors * 4, 1)
    assert not prior_data[0, 0].any() and (prior_data[0, 1] == 1).all()
    corners = centres_to_corners(decode_offsets(exported.outputs["output_loc"], arch.priors, arch.variances))
    np.testing.assert_allclose(out["loc_data"].reshape(3, -1, 4), corners, atol=1e-5)
    np.testing.assert_array_equal(out["conf_data"].reshape(3, num_priors, 4), exported.outputs["output_cls"])
    detections, counts = _nms_plugin(out["loc_data"], out["conf_data"], prior_data, attributes)
    labels = (tmp_path / "ds" / "labels.txt").read_text().split()
    height, width = arch.input_hw
    found = 0
    for i in range(len(exported.images)):
        boxes, scores, classes = nms_tlt_objects(detections[i], counts[i], (height, width),
                                                 decoder.confidence_threshold)
        size = np.array([width, height, width, height], np.float32)
        kept, kept_scores, kept_classes = per_class_nms(corners[i] * size, exported.outputs["output_cls"][i, :, 1:],
                                                        decoder.confidence_threshold, decoder.top_k,
                                                        decoder.nms_iou, decoder.max_detections)
        np.testing.assert_allclose(scores, kept_scores, rtol=1e-6)
        assert [labels[c] for c in classes] == [spec.dataset.classes[c] for c in kept_classes]
        left_top = np.clip(kept[:, :2], 0, [width - 1, height - 1])
        sizes = np.clip(kept[:, 2:] - kept[:, :2], 0, [width - 1, height - 1])
        np.testing.assert_allclose(boxes, np.concatenate([left_top, left_top + sizes], 1), atol=1e-3)
        found += len(scores)
    assert found > 10
