"""The FP16 form (qatpipe.export.fp16): casts land where the FP16 guard allows and nowhere else, on small ONNX graphs
with a planted overflow and with Q/DQ, run for real in ONNX Runtime; and the export stage's FP16 form of the tiny
detector's QAT model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qatpipe.export import fp16, precision
from qatpipe.export.qdq import check_explicit_quantization


def _model(nodes, inputs, outputs, initializers, shape=(None, 3, 4, 4)):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in outputs],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _run(model, x):
    """The model's outputs as written: ONNX Runtime's graph optimisations off (they may fuse FP16 arithmetic into
    float32 kernels)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))


def _tensor(model, name, x):
    """An intermediate tensor's value, as the model holds it (float16 or float32)."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.append(helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None))
    kinds = fp16._float16_outputs(model)
    writer = next(node.name for node in model.graph.node if name in node.output)
    exposed.graph.output[-1].type.tensor_type.elem_type = TensorProto.FLOAT16 if kinds[writer] else TensorProto.FLOAT
    value = _run(exposed, x)[name]
    assert value.dtype == (np.float16 if kinds[writer] else np.float32)
    return value


def _writes_fp16(model) -> dict[str, bool]:
    return {name: bool(value) for name, value in fp16._float16_outputs(model).items() if value is not None}


def _batches():
    rng = np.random.default_rng(0)
    return [rng.uniform(0.1, 1.0, (4, 3, 4, 4)).astype(np.float32) for _ in range(3)]


def test_a_planted_overflow_stays_fp32_and_everything_else_computes_in_fp16(tmp_path):
    """x -> amplify (x 1e3) -> boost (x 1e3: up to 1e6, beyond FP16's 65,504) -> relu -> attenuate (x 1e-6) ->
    conv_y -> y, and x -> double -> conv_p -> sigmoid -> p."""
    model = _model([helper.make_node("Mul", ["x", "thousand"], ["amplified"], name="amplify"),
                    helper.make_node("Mul", ["amplified", "thousand"], ["boosted"], name="boost"),
                    helper.make_node("Relu", ["boosted"], ["rectified"], name="relu"),
                    helper.make_node("Mul", ["rectified", "small"], ["attenuated"], name="attenuate"),
                    helper.make_node("Conv", ["attenuated", "w"], ["y"], name="conv_y"),
                    helper.make_node("Mul", ["x", "two"], ["doubled"], name="double"),
                    helper.make_node("Conv", ["doubled", "w"], ["logits"], name="conv_p"),
                    helper.make_node("Sigmoid", ["logits"], ["p"], name="sigmoid")],
                   ["x"], ["y", "p"], [_const("thousand", 1e3), _const("small", 1e-6), _const("two", 2.0),
                                       _const("w", np.eye(3).reshape(3, 3, 1, 1) * 0.5)])
    path = tmp_path / "planted.onnx"
    onnx.save(model, path)
    flags = precision.fp16_flags(precision.record_ranges(path, _batches()))
    assert set(flags) == {"boosted", "rectified"}  # the guard names the planted tensors, and only them

    converted, plan = fp16.convert(model, flags)
    # kept FP32: the writers and readers of the flagged tensors, and the sigmoid between the last compute layer
    # and an output, each with its reason; FP16: the rest
    assert set(plan.fp32) == {"boost", "relu", "attenuate", "sigmoid"}
    assert sorted(plan.fp16) == ["amplify", "conv_p", "conv_y", "double"]
    assert plan.fp32["boost"].startswith("guard: writes boosted (overflow")
    assert plan.fp32["attenuate"].startswith("guard: reads rectified")
    assert plan.fp32["sigmoid"].startswith("output: ")
    original = {node.name for node in model.graph.node}
    assert {name: fp for name, fp in _writes_fp16(converted).items() if name in original} == {
        "amplify": True, "boost": False, "relu": False, "attenuate": False, "conv_y": True, "double": True,
        "conv_p": True, "sigmoid": False}
    # the model's interface stays float32
    assert [i.type.tensor_type.elem_type for i in [*converted.graph.input, *converted.graph.output]] == [
        TensorProto.FLOAT] * 3

    x = _batches()[0]
    reference, deployed = _run(model, x), _run(converted, x)
    np.testing.assert_allclose(deployed["y"], reference["y"], rtol=2e-3)  # FP16's resolution, from amplify
    np.testing.assert_allclose(deployed["p"], reference["p"], atol=1e-3)
    # the planted tensor: float32 and finite with the guard; held in FP16, infinite, without it
    assert np.isfinite(_tensor(converted, "boosted", x)).all()
    unguarded = fp16.convert(model, {})[0]
    assert np.isinf(_tensor(unguarded, "boosted", x)).all()
    # ... yet ONNX Runtime's CPU build runs the unguarded FP16 form to a finite y: it computes the Mul -> Relu -> Mul
    # run in float32 (no FP16 kernels), casting only at its ends. The rounded form holds every value as FP16 would:
    # y is not finite there without the guard (inf, and NaN where conv_y's zero weights meet it), and right with it
    assert np.isfinite(_run(unguarded, x)["y"]).all()
    assert not np.isfinite(_run(fp16.rounded_form(model, unguarded), x)["y"]).any()
    rounded = _run(fp16.rounded_form(model, converted), x)
    np.testing.assert_allclose(rounded["y"], reference["y"], rtol=2e-3)
    np.testing.assert_allclose(rounded["p"], reference["p"], atol=1e-3)


def test_near_certain_scores_keep_their_order_in_the_fp16_form():
    """conv -> sigmoid -> p with logits 8 to 11.5: FP16 holds those sigmoids (0.99966 to 0.99999) as two values
    (0.99951 and 1), tying the near-certain detections; the FP16 form keeps the sigmoid FP32, so that its scores, as
    FP16 gives them (the rounded form), stay as many and in the same order as float32's."""
    model = _model([helper.make_node("Conv", ["x", "w"], ["logits"], name="conv"),
                    helper.make_node("Sigmoid", ["logits"], ["p"], name="sigmoid")],
                   ["x"], ["p"], [_const("w", np.ones((1, 1, 1, 1)))], shape=(None, 1, 1, 8))
    x = np.arange(8.0, 12.0, 0.5, dtype=np.float32).reshape(1, 1, 1, 8)
    converted, plan = fp16.convert(model, {})
    assert plan.fp16 == ["conv"] and plan.fp32["sigmoid"].startswith("output: ")
    reference = _run(model, x)["p"].ravel()
    deployed = _run(fp16.rounded_form(model, converted), x)["p"].ravel()
    assert len(np.unique(deployed)) == 8 and (np.diff(deployed) > 0).all()
    np.testing.assert_allclose(deployed, reference, atol=1e-6)


def _qdq(name, tensor, scale="s", zero="zp"):
    return [helper.make_node("QuantizeLinear", [tensor, scale, zero], [f"{name}_q"], name=f"{name}_quantize"),
            helper.make_node("DequantizeLinear", [f"{name}_q", scale, zero], [f"{name}_dq"], name=f"{name}_dequantize")]


def _int8_weights(rng, count):
    """(DequantizeLinear nodes, initializers): int8 1x1 weights w0q.. dequantized per channel into w0.., with the
    scales and zero points every test graph reads (activations "s" / "zp", weights "ws" / "wz")."""
    weights = [numpy_helper.from_array(rng.integers(-100, 100, (3, 3, 1, 1)).astype(np.int8), f"w{i}q")
               for i in range(count)]
    nodes = [helper.make_node("DequantizeLinear", [f"w{i}q", "ws", "wz"], [f"w{i}"], name=f"w{i}_dequantize", axis=0)
             for i in range(count)]
    return nodes, [*weights, _const("s", 0.02), _const("zp", 0, np.int8), _const("ws", [0.01, 0.02, 0.03]),
                   _const("wz", [0, 0, 0], np.int8)]


def test_a_qdq_model_keeps_its_int8_region_and_computes_only_its_float_layer_in_fp16(tmp_path):
    """x -> Q/DQ -> conv_a and conv_b (one DQ feeds both, as a residual block's shortcut and first conv do) ->
    add -> relu -> Q/DQ -> conv_head -> conv_float -> sigmoid -> transpose -> y. INT8: the convs that read DQs;
    their epilogues (add, relu) feed a Q. conv_float, a layer kept float (ptq.keep_float), is the FP16 region; the
    sigmoid and transpose after it, the output tail, stay FP32 so that the scores keep their order."""
    rng = np.random.default_rng(1)
    dequantize, initializers = _int8_weights(rng, 3)
    nodes = [*_qdq("x", "x"), *dequantize,
             helper.make_node("Conv", ["x_dq", "w0"], ["a"], name="conv_a"),
             helper.make_node("Conv", ["x_dq", "w1"], ["b"], name="conv_b"),
             helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
             helper.make_node("Relu", ["sum"], ["r"], name="relu"),
             *_qdq("r", "r"),
             helper.make_node("Conv", ["r_dq", "w2"], ["head"], name="conv_head"),
             helper.make_node("Conv", ["head", "wf"], ["logits"], name="conv_float"),
             helper.make_node("Sigmoid", ["logits"], ["p"], name="sigmoid"),
             helper.make_node("Transpose", ["p"], ["y"], name="transpose", perm=[0, 2, 3, 1])]
    model = _model(nodes, ["x"], [], [*initializers, _const("wf", rng.normal(0, 0.5, (3, 3, 1, 1)))])
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4, 4, 3]))

    converted, plan = fp16.convert(model, {})
    assert plan.fp16 == ["conv_float"]
    reasons = {name: why.split(":")[0] for name, why in plan.fp32.items()}
    assert {n: reasons[n] for n in ("conv_a", "conv_b", "conv_head", "add", "relu", "sigmoid", "transpose")} == {
        "conv_a": "int8", "conv_b": "int8", "conv_head": "int8", "add": "int8 epilogue", "relu": "int8 epilogue",
        "sigmoid": "output", "transpose": "output"}
    assert all(reasons[n.name] == "quantization" for n in model.graph.node if n.op_type in fp16.QDQ_OPS)
    # every quantized conv still reads its DequantizeLinears directly (the converter's float32 -> float16 ->
    # float32 round trip on the shared DQ was removed): TensorRT's rules hold
    assert plan.round_trips_removed == 2 and not check_explicit_quantization(converted).problems
    producers = {out: node.op_type for node in converted.graph.node for out in node.output}
    assert all(producers[i] == "DequantizeLinear" for n in converted.graph.node
               if n.name in ("conv_a", "conv_b", "conv_head") for i in n.input[:2])
    onnx.save(converted, tmp_path / "converted.onnx")
    assert precision.layer_precision(tmp_path / "converted.onnx") == {"int8": 3, "fp16": 1, "fp32": 0}
    # two casts: into FP16 before conv_float, back to float32 after it
    assert plan.casts == 2
    x = _batches()[0]
    np.testing.assert_allclose(_run(converted, x)["y"], _run(model, x)["y"], atol=1e-3)


def test_a_shape_read_of_an_int8_head_keeps_the_head_output_float32():
    """x -> Q/DQ -> conv_head (INT8) -> transpose -> reshape -> y, the reshape's shape taken from the head's output by
    Shape (SSD's head reshapes): the Shape reads the float32 head output as it is. Converted in FP16 it made the
    converter round the head output to FP16 for it, and the transpose read it back through that rounding."""
    dequantize, initializers = _int8_weights(np.random.default_rng(2), 1)
    nodes = [*_qdq("x", "x"), *dequantize,
             helper.make_node("Conv", ["x_dq", "w0"], ["head"], name="conv_head"),
             helper.make_node("Shape", ["head"], ["head_shape"], name="shape", start=0, end=1),
             helper.make_node("Concat", ["head_shape", "minus_one"], ["target"], name="target", axis=0),
             helper.make_node("Transpose", ["head"], ["t"], name="transpose", perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", ["t", "target"], ["y"], name="reshape")]
    model = _model(nodes, ["x"], [], [*initializers, _const("minus_one", [-1], np.int64)])
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None]))

    converted, plan = fp16.convert(model, {})
    assert plan.fp16 == [] and plan.fp32["shape"].startswith("shape: ") and plan.casts == 0
    assert not fp16._round_trips(converted)
    x = _batches()[0]
    np.testing.assert_array_equal(_run(converted, x)["y"], _run(model, x)["y"])


def test_an_epilogue_read_by_its_quantizer_and_a_float_layer_reaches_the_quantizer_unrounded():
    """x -> Q/DQ -> conv_a (INT8) -> relu -> (Q/DQ -> conv_head -> y) and (conv_float -> z): the relu, the INT8
    epilogue, stays float32 and also feeds conv_float, a layer kept float (a partial PTQ model). The converter
    casts the relu's output to FP16 for conv_float and, through that cast, back to float32 for the quantizer: the
    quantizer must read the relu's float32 output itself, while conv_float keeps its FP16 input."""
    rng = np.random.default_rng(3)
    dequantize, initializers = _int8_weights(rng, 2)
    nodes = [*_qdq("x", "x"), *dequantize,
             helper.make_node("Conv", ["x_dq", "w0"], ["a"], name="conv_a"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             *_qdq("r", "r"),
             helper.make_node("Conv", ["r_dq", "w1"], ["y"], name="conv_head"),
             helper.make_node("Conv", ["r", "wf"], ["z"], name="conv_float")]
    model = _model(nodes, ["x"], ["y", "z"], [*initializers, _const("wf", rng.normal(0, 0.5, (3, 3, 1, 1)))])

    converted, plan = fp16.convert(model, {})
    assert plan.fp16 == ["conv_float"] and plan.round_trips_removed >= 1
    assert not fp16._round_trips(converted) and not check_explicit_quantization(converted).problems
    nodes = {n.name: n for n in converted.graph.node}
    assert nodes["r_quantize"].input[0] == nodes["relu"].output[0]  # the relu's float32 output, no cast between
    x = _batches()[0]
    original, fp16_form = _run(model, x), _run(converted, x)
    np.testing.assert_array_equal(fp16_form["y"], original["y"])
    np.testing.assert_allclose(fp16_form["z"], original["z"], atol=1e-2)


def test_a_round_trip_into_a_graph_output_becomes_an_identity_of_the_float32_value():
    """relu -> Cast(float16) -> Cast(float32) -> y, the float16 cast also read by a float16 Neg -> z: y is written
    by an Identity of the relu's float32 output (its name stays), and the float16 cast stays for the Neg."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Cast", ["r"], ["r16"], name="to16", to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["r16"], ["y"], name="to32", to=TensorProto.FLOAT),
             helper.make_node("Neg", ["r16"], ["z"], name="neg")]
    model = _model(nodes, ["x"], ["y"], [])
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT16, (None, 3, 4, 4)))
    x = _batches()[0] - 0.5

    assert fp16._drop_round_trips(model) == 1 and not fp16._round_trips(model)
    ops = {n.name: (n.op_type, list(n.input)) for n in model.graph.node}
    assert ops == {"relu": ("Relu", ["x"]), "to16": ("Cast", ["r"]), "to32": ("Identity", ["r"]),
                   "neg": ("Neg", ["r16"])}
    np.testing.assert_array_equal(_run(model, x)["y"], np.maximum(x, 0))


def test_the_export_writes_the_qat_models_fp16_form(qat_export):
    """The tiny detector's QAT export (export.fp16_onnx is on by default): its FP16 form passes TensorRT's Q/DQ
    rules and computes nothing in FP16 (every compute layer is INT8, and the output tail after the last one stays
    FP32), and its outputs match the float32 form's."""
    _, _, path, report = qat_export
    form = report["fp16"]
    fp16_model = onnx.load(form["onnx"])
    assert not check_explicit_quantization(fp16_model).problems
    assert form["fp16_nodes"] == 0 and form["guard_flags"] == 0
    written = json.loads((path.parent / "precision_report.json").read_text())
    assert written["fp16_form"]["fp32_reasons"].keys() == {"quantization", "int8", "int8 epilogue", "output"}
    # the FP16 form's outputs against the float32 form's, on the guard's images: within FP16's resolution
    outputs = {o.name for o in fp16_model.graph.output}
    worst = {row["tensor"]: row["max_error"] for row in written["layers"]["tensors"] if row["tensor"] in outputs}
    assert worst.keys() == outputs and max(worst.values()) < 0.01
    assert precision.layer_precision(form["onnx"]) == precision.layer_precision(path)  # all INT8 still


def test_engine_source_is_the_fp16_form_for_tensorrt_and_the_float32_model_for_onnx_runtime(tmp_path):
    """The engine's source is the backend's choice (EngineBackend.source, read here without building anything):
    TensorRT with engine.fp16 takes the FP16 form beside the export when there is one; ONNX Runtime, engine.fp16
    off, or no FP16 form: the model given."""
    from qatpipe.engines.onnxruntime_backend import OnnxRuntimeBackend
    from qatpipe.engines.tensorrt_backend import TensorRTBackend
    from qatpipe.export.bundle import ExportBundle
    from qatpipe.spec import bundled_spec_path, load_spec

    spec = load_spec(bundled_spec_path("tiny"))
    bundle = ExportBundle(tmp_path / "model.onnx")
    assert TensorRTBackend.source(bundle, spec.engine) == bundle.onnx  # no FP16 form written
    bundle.fp16.write_bytes(b"")
    assert TensorRTBackend.source(bundle, spec.engine) == bundle.fp16
    assert OnnxRuntimeBackend.source(bundle, spec.engine) == bundle.onnx
    spec.engine.fp16 = False
    assert TensorRTBackend.source(bundle, spec.engine) == bundle.onnx
