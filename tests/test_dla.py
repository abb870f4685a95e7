"""Jetson DLA export (export/dla.py): the DLA form, its placement rules, the full-tensor calibration cache, the
DeepStream DLA keys and how TensorRT 10 is asked to build it. TensorRT and a DLA are not here: the builder
settings are checked up to the TensorRT calls (dla_build), which run only on a Jetson."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qatpipe.errors import QatpipeError
from qatpipe.export.bundle import ExportBundle
from qatpipe.export.dla import (DLA_RULES, dla_form, dla_placement, full_tensor_scales, fused_interiors, input_layout,
                                tensors_needing_scales)
from qatpipe.export.qdq import read_calibration_cache


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _nhwc_conv_model():
    """NHWC input -> transpose -> 3x3 conv -> BatchNormalization -> ReLU -> transpose back (a tf2onnx export's
    shape)."""
    rng = np.random.default_rng(0)
    params = [numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w"),
              numpy_helper.from_array(rng.normal(size=4).astype(np.float32), "b"),
              *(numpy_helper.from_array(values.astype(np.float32), name) for name, values in (
                  ("gamma", rng.uniform(0.5, 2, 4)), ("beta", rng.normal(size=4)), ("mean", rng.normal(size=4)),
                  ("var", rng.uniform(0.5, 2, 4))))]
    nodes = [helper.make_node("Transpose", ["input_1"], ["x_nchw"], perm=[0, 3, 1, 2], name="to_nchw"),
             helper.make_node("Conv", ["x_nchw", "w", "b"], ["conv"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                              name="conv"),
             helper.make_node("BatchNormalization", ["conv", "gamma", "beta", "mean", "var"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["relu"], name="relu"),
             helper.make_node("Transpose", ["relu"], ["out"], perm=[0, 2, 3, 1], name="to_nhwc")]
    return _model(nodes, [helper.make_tensor_value_info("input_1", TensorProto.FLOAT, ["batch", 8, 10, 3])],
                  [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 8, 10, 4])], params)


def test_the_dla_form_has_a_fixed_batch_an_nchw_input_and_computes_the_same(tmp_path):
    import onnxruntime as ort

    original = _nhwc_conv_model()
    form = dla_form(original, batch=2)
    assert input_layout(form) == "NCHW" and input_layout(original) == "NHWC"
    assert [d.dim_value for d in form.graph.input[0].type.tensor_type.shape.dim] == [2, 3, 8, 10]
    assert [d.dim_value for d in form.graph.output[0].type.tensor_type.shape.dim][0] == 2
    # the input transpose is gone and BatchNormalization folded into the conv, whose output is now inside the
    # fused conv + ReLU layer: no scale for it
    assert [n.name for n in form.graph.node] == ["conv", "relu", "to_nhwc"]
    assert fused_interiors(form) == {"bn"} and "bn" not in tensors_needing_scales(form, dla_placement(form))
    images = np.random.default_rng(1).uniform(size=(2, 8, 10, 3)).astype(np.float32)
    expected = ort.InferenceSession(original.SerializeToString()).run(None, {"input_1": images})[0]
    got = ort.InferenceSession(form.SerializeToString()).run(None, {"input_1": images.transpose(0, 3, 1, 2)})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _placed(nodes, inputs, outputs, initializers=()):
    return {p.node: p for p in dla_placement(_model(nodes, inputs, outputs, initializers))}


def _input(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_each_rule_places_a_small_graph_on_dla_or_the_gpu_with_its_reason():
    rng = np.random.default_rng(0)
    big_kernel = numpy_helper.from_array(rng.normal(size=(2, 2, 33, 1)).astype(np.float32), "wk")
    depthwise = numpy_helper.from_array(rng.normal(size=(2, 1, 3, 3)).astype(np.float32), "wd")
    scale = numpy_helper.from_array(np.ones((1, 2, 1, 1), np.float32), "s")
    bounds = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("zero", 0), ("six", 6), ("big", 200))]
    placed = _placed(
        [helper.make_node("Conv", ["x", "wk"], ["a"], kernel_shape=[33, 1], pads=[16, 0, 16, 0], name="conv33"),
         helper.make_node("Conv", ["x", "wd"], ["b"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=2, name="dw"),
         helper.make_node("Clip", ["b", "zero", "six"], ["relu6"], name="relu6"),
         helper.make_node("Clip", ["b", "zero", "big"], ["clip200"], name="clip200"),
         helper.make_node("Sigmoid", ["b"], ["c"], name="sigmoid"),
         helper.make_node("Mul", ["b", "c"], ["silu"], name="silu_mul"),
         helper.make_node("GlobalAveragePool", ["silu"], ["gap"], name="gap"),
         helper.make_node("Mul", ["silu", "s"], ["per_channel"], name="per_channel"),
         helper.make_node("MaxPool", ["x"], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
                          name="pool3"),
         helper.make_node("MaxPool", ["x"], ["pool9"], kernel_shape=[9, 9], name="pool9"),
         helper.make_node("Softplus", ["x"], ["sp"], name="softplus"),
         helper.make_node("Concat", ["x", "b"], ["cat"], axis=1, name="cat_c"),
         helper.make_node("Concat", ["x", "b"], ["cat_h"], axis=2, name="cat_h")],
        [_input("x", [1, 2, 12, 40])],
        [_input(n, None) for n in ("a", "relu6", "clip200", "gap", "per_channel", "pool", "pool9", "sp", "cat",
                                   "cat_h")],
        [big_kernel, depthwise, scale, *bounds])
    on_dla = {name for name, p in placed.items() if p.device == "DLA"}
    assert on_dla == {"dw", "relu6", "sigmoid", "silu_mul", "pool3", "cat_c"}
    assert placed["conv33"].rule == "convolution" and "kernel [33]" in placed["conv33"].why
    assert "clip to [0.0, 200.0]" in placed["clip200"].why
    assert placed["gap"].rule == "reduce-average" and "DLA reduces with max only" in placed["gap"].why
    assert "a broadcast" in placed["per_channel"].why  # DLA documents element-wise on equal shapes only
    assert "window [9, 9]" in placed["pool9"].why
    assert placed["softplus"].rule == "unsupported" and "Softplus has no DLA layer" in placed["softplus"].why
    assert "channel axis only" in placed["cat_h"].why
    assert len({rule.name for rule in DLA_RULES}) == len(DLA_RULES)  # named, one object per restriction


def test_dla_int8_element_wise_inputs_and_pooling_share_one_range():
    from qatpipe.export.dla import equal_ranges

    nodes = [helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
             helper.make_node("MaxPool", ["sum"], ["pooled"], kernel_shape=[2, 2], name="pool")]
    model = _model(nodes, [_input("a", [1, 2, 4, 4]), _input("b", [1, 2, 4, 4])], [_input("pooled", None)])
    scales = {"a": 0.01, "b": 0.03, "sum": 0.05, "pooled": 0.04}
    assert equal_ranges(model, dla_placement(model), scales) == 2
    assert scales == {"a": 0.03, "b": 0.03, "sum": 0.05, "pooled": 0.05}


def test_scales_keep_the_qat_ones_and_calibrate_the_rest():
    scales = full_tensor_scales({"conv_in": 0.02, "gone": 0.5}, {"conv_in": 10.0, "relu": 12.7, "dead": 0.0})
    assert scales["conv_in"] == 0.02 and scales["relu"] == pytest.approx(0.1)
    assert 0 < scales["dead"] < 1e-12 and "gone" not in scales  # only tensors the DLA form has


@pytest.fixture(scope="module")
def dla_export(qat_export, tmp_path_factory):
    """The tiny QAT model exported with export.target dla: (spec, folder, export report)."""
    from qatpipe.stages.export import export

    spec, keras_model, _, _ = qat_export
    spec = spec.model_copy(deep=True)
    spec.export.target, spec.export.dla_batch, spec.export.dla_calibration_images = "dla", 2, 8
    spec.export.fp16_onnx = False  # not what these tests are about
    folder = tmp_path_factory.mktemp("dla")
    return spec, folder, export(spec, keras_model, folder / "qat.onnx")


@pytest.mark.slow
def test_the_qat_export_for_dla_writes_a_full_tensor_cache_and_the_report(dla_export):
    spec, tmp_path, report = dla_export
    bundle = ExportBundle(tmp_path / "qat.onnx")
    form_path, cache_path = bundle.dla, bundle.dla_cache
    assert report["dla"]["onnx"] == str(form_path) and report["dla"]["batch"] == 2
    header, cached = read_calibration_cache(cache_path.read_text())
    assert header == f"TRT-{spec.export.calibration_cache_trt_version}-EntropyCalibration2"
    form = onnx.load(form_path)
    placements = dla_placement(form)
    needed = tensors_needing_scales(form, placements)
    assert needed and needed <= set(cached)  # every tensor a DLA layer reads or writes has its scale
    assert all(scale > 0 for scale in cached.values())
    kept = set(read_calibration_cache(bundle.cache.read_text())[1]) & set(cached)
    assert kept and report["dla"]["qat_scales"] == len(kept)  # the QAT model's own scales, where the form has them
    assert report["dla"]["calibrated_scales"] == len(cached) - len(kept) > 0
    # the detector runs on DLA but for the output transposes (NHWC for qatpipe's decoder)
    on_gpu = [p for p in placements if p.device == "GPU"]
    assert {p.op for p in on_gpu} == {"Transpose"} and report["dla"]["on_gpu"] == len(on_gpu)
    assert bundle.dla_report.is_file() and "Layers TensorRT runs on the GPU" in bundle.dla_report_markdown.read_text()
    record = json.loads((tmp_path / "tracking.json").read_text())
    assert {form_path.name, cache_path.name, bundle.dla_report.name, bundle.dla_report_markdown.name} <= set(
        record["artifacts"])


@pytest.mark.slow
def test_validate_scores_int8_on_every_tensor_and_writes_the_dla_deepstream_config(dla_export, tmp_path):
    from qatpipe.stages.build_engine import build_engine
    from qatpipe.stages.validate import validate

    spec, folder, _ = dla_export
    build_engine(spec, folder / "qat.onnx", tmp_path / "engine", backend="onnxruntime")
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"map50": 0.0, "map": 0.0}))  # this test is about what is reported
    report = validate(spec, tmp_path / "engine", baseline, tmp_path / "out", variant="qat",
                      onnx_model=folder / "qat.onnx")
    # INT8 on every tensor (the heads too) against the QAT model's own Q/DQ: close, and scored, not assumed
    assert 0 < report["map50_dla_emulated"] and abs(report["map50_dla_emulated"] - report["map50"]) < 0.1
    assert report["map50_dla_emulated_drop"] == pytest.approx(-report["map50_dla_emulated"], abs=1e-6)
    dla_cache = ExportBundle(folder / "qat.onnx").dla_cache.name
    assert dla_cache in report["dla_emulation"]
    assert (tmp_path / "out" / "dla_emulated" / "detections.json").is_file()
    assert "| qat, Orin DLA's INT8 (emulated) |" in (tmp_path / "out" / "validation.md").read_text()
    dla_config = tmp_path / "out" / "deepstream" / "config_infer_primary_qat_dla.txt"
    keys = dict(line.split("=", 1) for line in dla_config.read_text().splitlines() if "=" in line)
    assert keys["enable-dla"] == "1" and keys["use-dla-core"] == str(spec.engine.dla_core)
    assert keys["int8-calib-file"] == dla_cache and keys["batch-size"] == "2"
    assert (tmp_path / "out" / "deepstream" / "config_infer_primary_qat.txt").is_file()  # the GPU one stays


def test_the_gate_needs_the_dla_emulated_map_when_there_is_a_dla_form():
    from qatpipe.stages.validate import gate_message

    report = {"variant": "qat", "map50": 0.80, "map50_drop": 0.005, "map50_dla_emulated": 0.77,
              "map50_dla_emulated_drop": 0.035, "baseline_map50": 0.805, "max_map_drop": 0.01}
    message = gate_message(report)
    assert "DLA-emulated mAP@0.5 (INT8 on every tensor) 0.7700 is 3.50 points below" in message
    assert "mAP@0.5 0.8000" not in message  # only the figure that failed


@pytest.mark.slow
def test_the_deepstream_dla_config_names_the_core_the_cache_and_the_fixed_batch(qat_export, tmp_path):
    from qatpipe.deploy.deepstream import write_nvinfer_config
    from qatpipe.export.dla import write_dla_export
    from qatpipe.export.qdq import strip_qdq

    spec, _, qat_onnx, _ = qat_export
    implicit = onnx.load(qat_onnx)
    scales = strip_qdq(implicit)
    size = spec.dataset.image_size
    images = [np.random.default_rng(0).uniform(size=(4, size.height, size.width, 3)).astype(np.float32)]
    bundle = ExportBundle(tmp_path / "qat.onnx")
    onnx.save(implicit, bundle.implicit)
    write_dla_export(bundle.onnx, bundle.implicit, scales, images, batch=4, trt_version=100300, images=4)
    form, cache = bundle.dla, bundle.dla_cache
    config = write_nvinfer_config(spec, form, tmp_path / "ds", "qat_dla", "int8", calibration_cache=cache, dla_core=1)
    keys = dict(line.split("=", 1) for line in config.read_text().splitlines() if "=" in line)
    assert keys["enable-dla"] == "1" and keys["use-dla-core"] == "1" and keys["network-mode"] == "1"
    assert keys["int8-calib-file"] == cache.name and (tmp_path / "ds" / cache.name).is_file()
    assert keys["batch-size"] == "4" and keys["network-input-order"] == "0"  # NCHW, the DLA form's fixed batch
    assert keys["model-engine-file"].endswith("_b4_dla1_int8.engine")
    with pytest.raises(QatpipeError, match="needs the DLA form"):  # the NHWC, dynamic-batch export is not one
        write_nvinfer_config(spec, qat_onnx, tmp_path / "ds2", "qat", "int8", calibration_cache=cache, dla_core=0)


def test_dla_build_settings_for_tensorrt_10_read_the_form_and_its_cache_and_11_refuses_them(tmp_path):
    """dla_build, the settings a TensorRT build of the DLA form would use (no TensorRT build runs here): the core,
    the GPU fallback, the form's fixed batch and the calibration cache beside it; TensorRT 11 is refused."""
    from qatpipe.engines.tensorrt_backend import dla_build
    from qatpipe.spec import EngineSpec

    form = dla_form(_nhwc_conv_model(), batch=2)
    bundle = ExportBundle(tmp_path / "model.onnx")
    path, cache = bundle.dla, bundle.dla_cache
    onnx.save(form, path)
    settings = EngineSpec(dla_core=1, gpu_fallback=False)
    assert dla_build(tmp_path / "model.onnx", settings, 10) is None  # not a DLA form: the GPU build
    with pytest.raises(QatpipeError, match=f"{cache.name} is not beside it"):
        dla_build(path, settings, 10)
    cache.write_text("TRT-100300-EntropyCalibration2\nx: 3c010204\n")
    build = dla_build(path, settings, 10)
    assert (build.core, build.gpu_fallback, build.batch) == (1, False, 2)
    assert build.calibration_cache == cache.read_bytes()
    with pytest.raises(QatpipeError, match="TensorRT 11 builds DLA only strongly typed"):
        dla_build(path, settings, 11)


def test_without_a_dla_here_the_engine_comes_from_the_usual_form(tmp_path):
    from qatpipe.engines.onnxruntime_backend import OnnxRuntimeBackend
    from qatpipe.engines.tensorrt_backend import TensorRTBackend
    from qatpipe.spec import bundled_spec_path, load_spec

    spec = load_spec(bundled_spec_path("tiny"))
    bundle = ExportBundle(tmp_path / "model.onnx")
    for path in (bundle.onnx, bundle.dla, bundle.dla_cache, bundle.fp16):
        Path(path).write_bytes(b"")
    assert TensorRTBackend.source(bundle, spec.engine) == bundle.fp16  # no DLA core here
    assert OnnxRuntimeBackend.source(bundle, spec.engine) == bundle.onnx


def test_the_export_bundle_names_each_file_after_the_onnx(tmp_path):
    """One type names every file an export writes; the DLA form and the report lead back to their bundle."""
    bundle = ExportBundle(tmp_path / "qat.onnx")
    assert {name: getattr(bundle, name).name for name in ("report", "fp16", "implicit", "cache", "scales", "dla",
                                                          "dla_cache", "dla_report", "dla_report_markdown")} == {
        "report": "qat_export.json", "fp16": "qat_fp16.onnx", "implicit": "qat_implicit.onnx", "cache": "qat.cache",
        "scales": "qat_scales.json", "dla": "qat_dla.onnx", "dla_cache": "qat_dla.cache",
        "dla_report": "dla_report.json", "dla_report_markdown": "dla_report.md"}
    assert all(getattr(bundle, name).parent == tmp_path for name in ("fp16", "dla_cache", "dla_report"))
    assert ExportBundle.of_dla_form(bundle.dla) == bundle and ExportBundle.of_dla_form(bundle.onnx) is None
    assert ExportBundle.of_report(bundle.report) == bundle
