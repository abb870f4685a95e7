"""The FP16 guard and the layer-by-layer precision report (qatpipe.export.precision), on small ONNX graphs with
planted faults, and on the tiny detector's FP32 and PTQ models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qatpipe.export import precision


def _graph(tmp_path, name: str, amplify: float = 1e5, attenuate: float = 1e-5, tiny: float = 1e-9):
    """x (NHWC) -> amplify (Mul) -> Relu -> attenuate (Mul) -> y, and x -> shrink (Mul by `tiny`) -> z."""
    consts = [numpy_helper.from_array(np.array(v, np.float32), n)
              for n, v in (("a", amplify), ("b", attenuate), ("c", tiny))]
    nodes = [helper.make_node("Mul", ["x", "a"], ["amplified"], name="amplify"),
             helper.make_node("Relu", ["amplified"], ["rectified"], name="relu"),
             helper.make_node("Mul", ["rectified", "b"], ["y"], name="attenuate"),
             helper.make_node("Mul", ["x", "c"], ["z"], name="shrink")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4, 4, 3])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, [None, 4, 4, 3]) for o in "yz"],
                              consts)
    path = tmp_path / f"{name}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def _batches(n: int = 3):
    rng = np.random.default_rng(0)
    return [rng.uniform(0.1, 1.0, (4, 4, 4, 3)).astype(np.float32) for _ in range(n)]


def test_a_planted_overflow_and_underflow_are_flagged_by_name_and_nothing_else(tmp_path):
    ranges = precision.record_ranges(_graph(tmp_path, "m"), _batches())
    by_name = {r.name: r for r in ranges}
    assert [r.name for r in ranges] == ["amplified", "rectified", "y", "z"]  # graph order, float tensors only
    assert by_name["amplified"].absmax == pytest.approx(1e5, rel=1e-2) and by_name["amplified"].node == "amplify"
    assert by_name["z"].flushed_share == 1.0  # 1e-9 x values below 1: all below FP16's 2^-24
    flags = precision.fp16_flags(ranges)
    assert set(flags) == {"amplified", "rectified", "z"}
    assert flags["amplified"].startswith("overflow") and flags["z"].startswith("underflow")
    # the same graph without the faults: nothing to keep in FP32
    assert precision.fp16_flags(precision.record_ranges(_graph(tmp_path, "ok", 10.0, 0.1, 1e-2), _batches())) == {}


def test_the_layer_comparison_finds_where_a_derived_model_parts(tmp_path):
    reference = _graph(tmp_path, "ref", 10.0, 0.1, 1e-2)
    deployed = _graph(tmp_path, "dep", 10.0, 0.2, 1e-2)  # the attenuate step differs, the rest is identical
    layers = precision.compare_layers(reference, deployed, _batches())
    errors = {row["tensor"]: row["max_error"] for row in layers["tensors"]}
    assert errors["amplified"] == errors["rectified"] == errors["z"] == 0.0
    assert errors["y"] == pytest.approx(1.0, rel=1e-5)  # twice the value: the error equals the range
    assert layers["first_jump"]["tensor"] == "y" and layers["first_jump"]["node"] == "attenuate"


def test_a_retrained_model_cannot_be_compared_layer_by_layer(tmp_path):
    other = tmp_path / "other.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["w"], name="r")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4, 4, 3])],
                              [helper.make_tensor_value_info("w", TensorProto.FLOAT, [None, 4, 4, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), other)
    with pytest.raises(precision.QatpipeError, match="no tensor name in common"):
        precision.compare_layers(_graph(tmp_path, "m"), other, _batches(1))


def test_report_of_the_tiny_detector_and_its_ptq_model(trained_tiny, tmp_path):
    from qatpipe.stages.export import export
    from qatpipe.stages.ptq import ptq

    spec, model = trained_tiny
    spec = spec.model_copy(deep=True)
    spec.ptq.report_images = 8
    export(spec, model, tmp_path / "fp32.onnx")
    result = ptq(spec, tmp_path / "fp32.onnx", tmp_path / "ptq.onnx")  # writes the report beside the model
    json_path, md_path = tmp_path / "precision_report.json", tmp_path / "precision_report.md"
    report = __import__("json").loads(json_path.read_text())
    assert result["fp16_flags"] == 0 and result["precision_report"] == str(json_path)
    assert report["images"] == 8 and report["tensors"] > 20
    assert report["fp16_flags"] == []  # a BatchNorm-folded ResNet's activations fit FP16
    layers = report["layers"]
    assert layers["compared"] > 20 and layers["worst"]["max_error"] > 0  # INT8 differs from FP32 somewhere
    text = md_path.read_text()
    assert "# Precision report" in text and "Layer by layer against the float32 model" in text


def test_layer_precision_counts_int8_fp16_and_fp32_layers(tmp_path):
    """Three convs: one behind Q/DQ on data and weight, one on float16 data, one float32."""
    w = numpy_helper.from_array(np.ones((3, 3, 1, 1), np.float32), "w")
    w16 = numpy_helper.from_array(np.ones((3, 3, 1, 1), np.float16), "w16")
    wq = numpy_helper.from_array(np.ones((3, 3, 1, 1), np.int8), "wq")
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, np.int8), "zp")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "s", "zp"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd"], ["a"], name="int8_conv"),
             helper.make_node("Cast", ["a"], ["a16"], to=TensorProto.FLOAT16),
             helper.make_node("Conv", ["a16", "w16"], ["b16"], name="fp16_conv"),
             helper.make_node("Cast", ["b16"], ["b"], to=TensorProto.FLOAT),
             helper.make_node("Conv", ["b", "w"], ["y"], name="fp32_conv")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [w, w16, wq, scale, zero])
    path = tmp_path / "mixed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    assert precision.layer_precision(path) == {"int8": 1, "fp16": 1, "fp32": 1}
