"""Layer sensitivity (quantization/qdq_graph.py, quantization/sensitivity.py, stages/sensitivity.py, `qatpipe
sensitivity`): the variants keep exactly the Q/DQ they should, read the float tensors behind the bypassed ones,
and a layer planted with a ruinous range is the one the ranking names first."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qatpipe.errors import QatpipeError
from qatpipe.quantization.qdq_graph import (ALL_BUT, DEQUANTIZED_WEIGHT, FP32_WEIGHT, ONLY, fp32_weights, layer_qdq,
                                            qdq_node_names, quantizable_layers, resolve_layers, variant)
from qatpipe.quantization.sensitivity import measure

PLANTED_FACTOR = 500.0  # the planted layer's input steps, times its calibrated ones: under one level covers its range
# a budget (validate.max_map_drop) the planted model meets with the planted layer float and not without it: on
# the fixture's 32-image sample, float 0.223, planted PTQ 0.114, planted layer float 0.166 (PTQ alone 0.154)
PLANTED_BUDGET = 0.08


def _producers(model):
    return {out: node for node in model.graph.node for out in node.output}


def plant_bad_range(model) -> str:
    """Multiply the input scale (its QuantizeLinear's and DequantizeLinear's) of the first quantized layer whose
    input Q/DQ pair it alone reads (the tiny detector's conv1, reading the image) by PLANTED_FACTOR, in place;
    returns the layer's node name. Its int8 input then keeps under one level of the image's range, so the
    planted model finds nothing whatever the tiny detector learnt on this CPU. (At a factor of 50, 3 levels, the
    plant cost too little on some CPUs: on the fixture's 32 val images an AMD EPYC gave mAP@0.5 0.223 float,
    0.154 PTQ, 0.114 planted, while an Intel Xeon with AMX trained a detector scoring 0.170 float, 0.222 PTQ,
    0.112 planted, within the 8-point budget of float. At 500 there: 0.000 planted, 0.214 with it and one
    benign layer float.)"""
    producers = _producers(model)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    alone = [layer for layer in quantizable_layers(model) if readers[_input_dq(model, layer.node).output[0]] == 1
             and readers[producers[_input_dq(model, layer.node).input[0]].output[0]] == 1]
    layer = alone[0]
    dq = _input_dq(model, layer.node)
    q = producers[dq.input[0]]
    inits = {i.name: i for i in model.graph.initializer}
    scale = numpy_helper.to_array(inits[dq.input[1]]) * PLANTED_FACTOR
    model.graph.initializer.append(numpy_helper.from_array(scale.astype(np.float32), "planted_scale"))
    q.input[1] = dq.input[1] = "planted_scale"
    return layer.node


def _requantization(model, node_name) -> set[str]:
    """The Q/DQ pairs (by name) that quantize the node's output."""
    node = next(n for n in model.graph.node if n.name == node_name)
    quantizers = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in node.output]
    return {n.name for q in quantizers for n in model.graph.node
            if n is q or (n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])}


def _input_dq(model, node_name):
    node = next(n for n in model.graph.node if n.name == node_name)
    return _producers(model)[node.input[0]]


@pytest.fixture(scope="module")
def ptq_models(trained_tiny, tmp_path_factory):
    """The tiny detector's FP32 ONNX, its PTQ model (ONNX Runtime, percentile, 32 training images) and a copy
    of that with one planted bad-range layer: (spec, fp32, ptq, planted, planted layer)."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split
    from qatpipe.export.onnx_export import export_onnx
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model
    from qatpipe.quantization.ptq import quantize_ptq

    spec, model = trained_tiny
    folder = tmp_path_factory.mktemp("sensitivity")
    arch = get_architecture(spec)
    export_onnx(load_keras_model(model, arch), folder / "fp32.onnx", spec.export.opset)
    batches = (b.numpy() for b in eval_dataset(sample_split(spec, "train", 32, 0), spec))
    quantize_ptq(folder / "fp32.onnx", folder / "ptq.onnx", batches, "percentile")
    planted = onnx.load(folder / "ptq.onnx")
    layer = plant_bad_range(planted)
    onnx.save(planted, folder / "planted.onnx")
    return spec, folder / "fp32.onnx", folder / "ptq.onnx", folder / "planted.onnx", layer


def test_variants_keep_exactly_the_named_layers_qdq(ptq_models):
    _, _, ptq_path, _, _ = ptq_models
    model = onnx.load(ptq_path)
    every = qdq_node_names(model)
    layers = quantizable_layers(model)
    assert len(layers) == 15  # ResNet-10's 13 convolutions and the two heads
    readers: dict[str, set] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.name)
    requantized_layers = 0
    for layer in layers:
        own = layer_qdq(model, layer.node)
        assert len(own) == 3  # the input's Q and DQ, the weight's DQ (int8 initializer)
        only, _ = variant(model, ONLY, layer.node)
        assert qdq_node_names(only) == own, layer.node
        # only this layer reads through DequantizeLinear; the others read float
        producers = _producers(only)
        for node in only.graph.node:
            dequantized = [producers.get(name) is not None and producers[name].op_type == "DequantizeLinear"
                           for name in node.input]
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                continue
            assert any(dequantized) == (node.name == layer.node), node.name
        # every layer but this one: its Q/DQ go, except a pair another layer reads too, and so does any
        # requantization of its output (a residual Add's quantizer): a float layer's output stays float up to
        # the next layer's input quantizer
        all_but, _ = variant(model, ALL_BUT, layer.node)
        input_dq = _input_dq(model, layer.node)
        pair_shared = len(readers[input_dq.output[0]]) > 1
        requantized = _requantization(model, layer.node)
        expected = every - own - requantized | (
            {input_dq.name, _producers(model)[input_dq.input[0]].name} if pair_shared else set())
        assert qdq_node_names(all_but) == expected, layer.node
        node = next(n for n in all_but.graph.node if n.name == layer.node)
        assert _producers(all_but)[node.input[0]].op_type != "DequantizeLinear"
        assert node.input[1] not in _producers(all_but)  # a float initializer
        assert not any(n.op_type == "QuantizeLinear" and n.input[0] in node.output for n in all_but.graph.node)
        requantized_layers += bool(requantized)
    # PTQ quantizes no layer's output but a residual Add's shortcut input (quantization/ptq.py): the tiny
    # ResNet's 4 Adds each read a projection convolution's output through Q/DQ
    assert requantized_layers == 4
    assert not qdq_node_names(variant(model, "float")[0])


def test_the_screen_counts_the_requantization_of_a_layers_output(ptq_models):
    """A coarse range planted on one layer's output requantization (not its input) makes that layer the
    noisiest: keeping it float drops that Q/DQ too (output_requantization), so the screen counts it."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split
    from qatpipe.quantization.qdq_graph import output_requantization
    from qatpipe.quantization.sensitivity import quantization_noise

    spec, _, ptq_path, _, _ = ptq_models
    model = onnx.load(ptq_path)
    batch = next(iter(eval_dataset(sample_split(spec, "val", 8, 0), spec))).numpy()
    layers = quantizable_layers(model)
    before = quantization_noise(model, layers, batch)
    nodes = {n.name: n for n in model.graph.node}
    # the first layer whose output is quantized again (for a residual Add: PTQ quantizes no other output)
    target = next(layer for layer in layers if output_requantization(model, [nodes[layer.node]]))
    [(reader, index)] = output_requantization(model, [nodes[target.node]])[:1]
    dq = _producers(model)[reader.input[index]]
    q = _producers(model)[dq.input[0]]
    inits = {i.name: i for i in model.graph.initializer}
    scale = numpy_helper.to_array(inits[dq.input[1]]) * PLANTED_FACTOR
    model.graph.initializer.append(numpy_helper.from_array(scale.astype(np.float32), "planted_output_scale"))
    q.input[1] = dq.input[1] = "planted_output_scale"
    after = quantization_noise(model, layers, batch)
    assert max(before, key=before.get) != target.node
    assert max(after, key=after.get) == target.node and after[target.node] > 10 * before[target.node]
    assert {name: after[name] for name in after if name != target.node} == pytest.approx(
        {name: before[name] for name in before if name != target.node})


def test_bypassed_weights_are_the_fp32_models_where_they_match(ptq_models):
    """With the FP32 ONNX, the float variant computes what the FP32 model does; without it, the dequantized
    weights stand in, within half an int8 step of them."""
    import onnxruntime as ort

    _, fp32_path, ptq_path, _, _ = ptq_models
    model, reference = onnx.load(ptq_path), fp32_weights(onnx.load(fp32_path))
    layer = quantizable_layers(model)[4].node
    _, sources = variant(model, ALL_BUT, layer, reference)
    assert list(sources.values()) == [FP32_WEIGHT]
    _, sources = variant(model, ALL_BUT, layer)
    assert list(sources.values()) == [DEQUANTIZED_WEIGHT]
    batch = np.random.default_rng(0).uniform(0, 1, (2, 192, 320, 3)).astype(np.float32)

    def run(proto):
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: batch})

    expected = run(onnx.load(fp32_path))
    for got, want in zip(run(variant(model, "float", reference=reference)[0]), expected):
        np.testing.assert_allclose(got, want, atol=1e-4)
    dequantized = run(variant(model, "float")[0])
    errors = [np.abs(g - w).max() / np.abs(w).max() for g, w in zip(dequantized, expected)]
    assert 0 < max(errors) < 0.05, errors  # relative to each output's range


def test_a_name_that_is_no_layer_fails_naming_it(ptq_models, tmp_path):
    from qatpipe.cli import main

    spec, _, ptq_path, _, _ = ptq_models
    model = onnx.load(ptq_path)
    layer = quantizable_layers(model)[2]
    assert resolve_layers(model, [layer.name]) == [layer]  # the layer's short name does too
    relu = next(n.name for n in model.graph.node if n.op_type == "Relu")
    with pytest.raises(QatpipeError, match="'conv_nope' is no node") as info:
        resolve_layers(model, [layer.node, "conv_nope", relu])
    assert f"{relu!r} is a node, but not one with int8 input and weight" in str(info.value)
    assert layer.node not in str(info.value).split("(its")[0]
    data = ["--set", f"dataset.train={spec.dataset.train}", "--set", f"dataset.val={spec.dataset.val}"]
    assert main(["sensitivity", "-e", "tiny", *data, "-m", str(ptq_path), "--layers", "conv_nope",
                 "-o", str(tmp_path / "out")]) == 2
    # an FP32 model has no quantized layer: said before anything is scored
    with pytest.raises(QatpipeError, match="no layer reads int8 input and weights"):
        measure(ptq_models[1], lambda path: pytest.fail("scored"))


def test_the_planted_layer_ranks_first_and_keeping_it_float_recovers(ptq_models, tmp_path, capsys):
    """The command on the planted model: the layer whose input range is 50 times too wide costs the most mAP on
    its own, and the model with every other layer INT8 wins back most of what the planted model loses."""
    from qatpipe.cli import main
    from qatpipe.stages.sensitivity import CHART_FILE, JSON_FILE, MARKDOWN_FILE

    spec, fp32_path, ptq_path, planted_path, planted = ptq_models
    data = ["--set", f"dataset.train={spec.dataset.train}", "--set", f"dataset.val={spec.dataset.val}"]
    out = tmp_path / "out"
    assert main(["sensitivity", "-e", "tiny", *data, "--set", "sensitivity.val_images=32", "-m", str(planted_path),
                 "--fp32", str(fp32_path), "-o", str(out)]) == 0
    result = json.loads((out / JSON_FILE).read_text())
    assert result["val_images"] == 32 and result["layers_total"] == len(result["layers"]) == 15
    ranked = [row["node"] for row in result["layers"]]
    assert ranked[0] == planted, ranked
    drops = [row["drop_only_int8"] for row in result["layers"]]
    assert drops == sorted(drops, reverse=True)
    row = result["layers"][0]
    assert row["drop_only_int8"] > 0.05  # the planted range costs over 5 points on its own
    # keeping it float wins back the most, and at least what the plant cost: every other layer INT8 scores
    # as well as the PTQ model without the plant, on the same sample in the same exact form
    assert row["recovery"] == max(r["recovery"] for r in result["layers"])
    from qatpipe.models import get_architecture
    from qatpipe.quantization.sensitivity import exact_scorer
    from qatpipe.stages.sensitivity import val_sample

    sampled = spec.model_copy(deep=True)
    sampled.sensitivity.val_images = 32
    unplanted = exact_scorer(val_sample(sampled, get_architecture(sampled))[1], tmp_path)(onnx.load(ptq_path))
    assert result["map50_int8"] < unplanted - 0.02  # (the plant costs: 0.114 against 0.154, measured)
    assert result["map50_float"] - row["drop_all_but"] >= unplanted - 0.01, (row, unplanted)  # ~1 detection
    assert all(r["float_weight"] == FP32_WEIGHT for r in result["layers"])
    assert result["map50_fp32_onnx"] == pytest.approx(result["map50_float"], abs=0.01)
    assert (out / CHART_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / MARKDOWN_FILE).read_text()
    assert f"| 1 | {row['name']} | `{planted}` | Conv |" in table
    assert planted in capsys.readouterr().out.splitlines()[2]


def test_max_layers_scores_the_noisiest(ptq_models):
    """With more layers than max_layers, the quantizers' noise on one batch of val images picks those scored:
    the planted layer's among them; each scored layer costs two variants, beside the float and INT8 models."""
    from qatpipe.data.pipeline import eval_dataset
    from qatpipe.data.splits import sample_split

    spec, _, _, planted_path, planted = ptq_models
    scored = []
    batch = next(iter(eval_dataset(sample_split(spec, "val", 8, 0), spec))).numpy()
    result = measure(planted_path, lambda path: scored.append(path.name) or 0.5, max_layers=2,
                     screening_batch=batch)
    assert [row.node for row in result.layers].count(planted) == 1 and len(result.layers) == 2
    assert len(result.skipped) == 13 and planted not in result.skipped
    assert max(result.skipped.values()) <= min(row.noise for row in result.layers)
    assert scored == ["float.onnx", "int8.onnx", *["only.onnx", "all_but.onnx"] * 2]


def qat_form_graph(rng, names=("conv1", "conv2")):
    """A two-conv Q/DQ graph in a QAT export's forms: the input's Transpose between its Q and DQ, conv1's weight
    int8, conv2's quantized from a float initializer by a QuantizeLinear node. Returns (model, w1, w2)."""
    w1 = rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)
    w1_scale = np.full(4, 0.01, np.float32)
    w2 = rng.normal(0, 0.1, (2, 4, 1, 1)).astype(np.float32)
    zero = np.zeros((), np.int8)
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (w1, "w1"), (w1_scale, "w1_scale"), (np.zeros(4, np.int8), "w1_zero"), (w2, "w2"),
        (np.full(2, 0.002, np.float32), "w2_scale"), (np.zeros(2, np.int8), "w2_zero"),
        (np.array(0.02, np.float32), "x_scale"), (zero, "x_zero"), (np.array(0.05, np.float32), "h_scale")]]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"], name="x_q"),
        helper.make_node("Transpose", ["x_q"], ["x_qt"], name="x_t", perm=[0, 3, 1, 2]),
        helper.make_node("DequantizeLinear", ["x_qt", "x_scale", "x_zero"], ["x_dq"], name="x_dq"),
        helper.make_node("DequantizeLinear", ["w1", "w1_scale", "w1_zero"], ["w1_dq"], name="w1_dq", axis=0),
        helper.make_node("Conv", ["x_dq", "w1_dq"], ["c1"], name=names[0], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("QuantizeLinear", ["r1", "h_scale", "x_zero"], ["r1_q"], name="r1_q"),
        helper.make_node("DequantizeLinear", ["r1_q", "h_scale", "x_zero"], ["r1_dq"], name="r1_dq"),
        helper.make_node("QuantizeLinear", ["w2", "w2_scale", "w2_zero"], ["w2_q"], name="w2_q", axis=0),
        helper.make_node("DequantizeLinear", ["w2_q", "w2_scale", "w2_zero"], ["w2_dq"], name="w2_dq", axis=0),
        helper.make_node("Conv", ["r1_dq", "w2_dq"], ["y"], name=names[1]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 6, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model, w1, w2


def test_a_float_layers_output_quantizer_stays_where_the_next_int8_layer_reads_it():
    """conv1 -> Q/DQ -> conv2 with no activation between (MobileNetV2's project -> expand): that pair is conv1's
    output requantization and conv2's input quantizer. Keeping conv1 float drops it only for its other readers
    (an Add here); conv2 stays INT8, reading both its input and its weight quantized as TensorRT's rule asks."""
    from qatpipe.export.qdq import check_explicit_quantization
    from qatpipe.quantization.qdq_graph import float_layers, output_requantization

    model, _, _ = qat_form_graph(np.random.default_rng(0))
    graph = model.graph
    graph.node.remove(next(n for n in graph.node if n.name == "relu1"))
    next(n for n in graph.node if n.name == "r1_q").input[0] = "c1"
    graph.node.append(helper.make_node("Add", ["r1_dq", "r1_dq"], ["side"], name="side_add"))
    graph.output.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, [1, 4, 6, 6]))
    onnx.checker.check_model(model)
    conv1 = next(n for n in graph.node if n.name == "conv1")
    assert [(node.name, index) for node, index in output_requantization(model, [conv1])] == [("side_add", 0),
                                                                                             ("side_add", 1)]
    partial, _ = float_layers(model, ["conv1"])
    assert [layer.node for layer in quantizable_layers(partial)] == ["conv2"]
    assert {"r1_q", "r1_dq"} <= qdq_node_names(partial)
    check = check_explicit_quantization(partial)  # (its one problem: this graph's QAT-form weight, not int8)
    assert check.quantized == ["conv2"] and check.float_ == ["conv1"]
    assert not [problem for problem in check.problems if "not quantized" in problem]
    add = next(n for n in partial.graph.node if n.name == "side_add")
    assert list(add.input) == ["c1", "c1"]  # the Add reads conv1's float output
    assert not quantizable_layers(float_layers(model, ["conv1", "conv2"])[0])


def test_float_tensors_behind_layout_ops_and_quantized_float_weights():
    """A QAT export's forms: the input's Transpose between its Q and DQ (copied onto the float tensor), and a
    weight quantized from a float initializer (read as it is); the float variant computes the float graph."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    model, w1, w2 = qat_form_graph(rng)
    graph = model.graph
    assert [layer.node for layer in quantizable_layers(model)] == ["conv1", "conv2"]
    assert layer_qdq(model, "conv1") == {"x_q", "x_dq", "w1_dq"}  # through the Transpose
    float_graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2]),
         helper.make_node("Conv", ["xt", "w1f"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
         helper.make_node("Conv", ["r1", "w2"], ["y"])], "f", graph.input, graph.output,
        [numpy_helper.from_array(w1.astype(np.float32) * 0.01, "w1f"), numpy_helper.from_array(w2, "w2")])
    float_model = helper.make_model(float_graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = rng.uniform(-1, 1, (1, 6, 6, 3)).astype(np.float32)

    def run(proto):
        return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]

    np.testing.assert_allclose(run(variant(model, "float")[0]), run(float_model), rtol=1e-5, atol=1e-6)
    only, _ = variant(model, ONLY, "conv2")
    assert qdq_node_names(only) == {"r1_q", "r1_dq", "w2_q", "w2_dq"}
    assert not any(n.op_type == "Transpose" and n.name == "x_t" for n in only.graph.node)  # x_q's chain went too
    all_but, sources = variant(model, ALL_BUT, "conv2")
    assert qdq_node_names(all_but) == {"x_q", "x_dq", "w1_dq"} and sources == {}  # w2: the model's own float
    conv2 = next(n for n in all_but.graph.node if n.name == "conv2")
    assert list(conv2.input) == ["r1", "w2"]
    run(only), run(all_but)  # both are valid graphs


def test_a_layer_name_of_two_nodes_is_refused_naming_both():
    model, _, _ = qat_form_graph(np.random.default_rng(0), names=("m/conv/Conv2D", "m/conv/QDQConv2D"))
    assert [layer.name for layer in quantizable_layers(model)] == ["conv", "conv"]
    with pytest.raises(QatpipeError, match="'conv' names 2 nodes: m/conv/Conv2D, m/conv/QDQConv2D"):
        resolve_layers(model, ["conv"])
    assert [layer.node for layer in resolve_layers(model, ["m/conv/QDQConv2D"])] == ["m/conv/QDQConv2D"]


# ------------------------------------------------------------------------------ partial quantization (ptq-partial)


def test_ranking_orders_by_recovery_then_drop():
    from qatpipe.quantization.partial import ranking

    rows = [{"node": "a", "recovery": 0.01, "drop_only_int8": 0.09}, {"node": "b", "recovery": 0.05,
            "drop_only_int8": 0.0}, {"node": "c", "recovery": 0.01, "drop_only_int8": 0.10}]
    assert ranking({"layers": rows}) == ["b", "c", "a"]
    # the layers sensitivity.max_layers left unscored follow, the noisiest first
    assert ranking({"layers": rows, "skipped": {"d": 0.001, "e": 0.003}}) == ["b", "c", "a", "e", "d"]
    with pytest.raises(QatpipeError, match="no `layers` list"):
        ranking({})


def test_a_missing_or_damaged_sensitivity_report_is_named(tmp_path):
    from qatpipe.stages.ptq_partial import _ranking

    path = tmp_path / "sensitivity.json"
    with pytest.raises(QatpipeError, match=f"{path}: no sensitivity report"):
        _ranking(tmp_path)
    for text, kind in (("{not json", "JSONDecodeError"), ('{"layers": [], "skipped": ["conv1"]}', "TypeError")):
        path.write_text(text)
        with pytest.raises(QatpipeError, match=f"{path}: not a sensitivity report: {kind}"):
            _ranking(tmp_path)


def _subset_scorer(spec, folder):
    """score(onnx.ModelProto) on 32 val images in the exact CPU form, as the ptq-partial stage scores."""
    from qatpipe.data.splits import sample_split
    from qatpipe.models import get_architecture
    from qatpipe.quantization.sensitivity import exact_scorer
    from qatpipe.stages.sensitivity import scorer

    score_path, _, _ = scorer(spec, sample_split(spec, "val", 32, 0), get_architecture(spec))
    return score_path, exact_scorer(score_path, folder)


def test_auto_keeps_layers_float_fewest_first_and_stops_at_the_budget(ptq_models, tmp_path, caplog):
    """On the planted model: a benign layer first, then the planted one, then a third: the search scores the
    all-INT8 model, one float layer, two, and stops there, the budget met (the third never scored); a budget
    no subset meets keeps the best model and warns naming the budget and the best figure."""
    import logging

    from qatpipe.quantization.partial import KEEP_FLOAT_KEY, search

    spec, fp32_path, _, planted_path, planted = ptq_models
    model, reference = onnx.load(planted_path), fp32_weights(onnx.load(fp32_path))
    benign = next(layer.node for layer in quantizable_layers(model) if layer.node != planted)
    third = quantizable_layers(model)[-1].node
    score_path, score = _subset_scorer(spec, tmp_path)
    map50_fp32 = score_path(fp32_path)
    scored = []
    partial, result = search(model, [benign, planted, third], lambda m: scored.append(m) or score(m), map50_fp32,
                             PLANTED_BUDGET, reference)
    assert [step.float_layers for step in result.steps] == [[], [benign], [benign, planted]], result.steps
    assert result.budget_met and result.float_layers == [benign, planted] and len(scored) == 3
    assert result.steps[0].map50 < map50_fp32 - PLANTED_BUDGET <= result.map50  # the plant costs more than it
    assert result.layers_total == 15 and result.map50_int8 == result.steps[0].map50
    recorded = dict((p.key, p.value) for p in partial.metadata_props)[KEEP_FLOAT_KEY]
    assert set(recorded.split(",")) == {benign, planted}  # in graph order
    assert len(quantizable_layers(partial)) == 13
    with caplog.at_level(logging.WARNING, logger="qatpipe.quantization.partial"):
        _, missed = search(model, [planted, third], score, map50_fp32, -1.0, reference)
    assert not missed.budget_met and len(missed.steps) == 3
    best = max(missed.steps, key=lambda step: step.map50)
    assert missed.float_layers == best.float_layers and missed.map50 == best.map50
    assert f"{map50_fp32 + 1.0:.4f}" in caplog.text and f"the best, {best.map50:.4f}" in caplog.text


def test_a_model_the_sample_passes_and_all_val_images_do_not_is_not_kept(ptq_models, caplog):
    """The search with a confirmation on every val image (scores made up, the models real): the sample puts the
    all-INT8 model within the budget and all val images do not, so the search goes on; a model the sample fails
    is not scored on all images; the first model within the budget on both is kept. Where all val images never
    agree, no model meets the budget and the warning names both targets."""
    import logging

    from qatpipe.quantization.partial import KEEP_FLOAT_KEY, Confirm, search

    _, fp32_path, _, planted_path, _ = ptq_models
    model, reference = onnx.load(planted_path), fp32_weights(onnx.load(fp32_path))
    layers = [layer.node for layer in quantizable_layers(model)][:3]

    def scorer(figures: list[float], seen: list[str]):
        def score(candidate) -> float:
            kept = dict((p.key, p.value) for p in candidate.metadata_props)[KEEP_FLOAT_KEY]
            seen.append(set(filter(None, kept.split(","))))
            return figures[len(seen) - 1]
        return score

    on_sample, on_all = [], []
    sample = scorer([0.795, 0.785, 0.800], on_sample)  # FP32 0.80, budget 0.01: target 0.79
    every = Confirm(scorer([0.795, 0.805], on_all), 0.81, 2000)  # target there 0.80
    with caplog.at_level(logging.WARNING, logger="qatpipe.quantization.partial"):
        _, result = search(model, layers, sample, 0.80, 0.01, reference, every)
    assert on_sample == [set(), {layers[0]}, set(layers[:2])]
    assert on_all == [on_sample[0], on_sample[2]]  # the same models, only where the sample passed them
    assert [step.map50_all for step in result.steps] == [0.795, None, 0.805]
    assert result.budget_met and result.float_layers == layers[:2] and result.map50 == 0.800
    assert (result.map50_all, result.map50_fp32_all, result.val_images_all) == (0.805, 0.81, 2000)
    assert "0 layer(s) float: mAP@0.5 0.7950 on all 2000 val images (target 0.8000)" in caplog.text
    assert "not within the budget there, going on" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qatpipe.quantization.partial"):
        _, missed = search(model, layers[:1], scorer([0.795, 0.799], []), 0.80, 0.01, reference,
                           Confirm(scorer([0.70, 0.71], []), 0.81, 2000))
    assert not missed.budget_met and [step.map50_all for step in missed.steps] == [0.70, 0.71]
    assert missed.float_layers == layers[:1] and missed.map50 == 0.799  # the best on the sample
    assert "no model met the budget (mAP@0.5 >= FP32 0.8000 - 0.0100 = 0.7900, and on all 2000 val images >= " \
           "0.8000)" in caplog.text


def test_fp16_form_of_a_partial_model_keeps_exactly_the_named_layers_float(ptq_models):
    """The FP16 form (export/fp16.py) of the PTQ model with two layers kept float: those two layers compute in
    FP16, every other weighted layer stays in the INT8 region, and the form passes TensorRT's Q/DQ rules."""
    from qatpipe.export import fp16
    from qatpipe.export.qdq import check_explicit_quantization
    from qatpipe.quantization.partial import keep_float

    _, fp32_path, ptq_path, _, _ = ptq_models
    model = onnx.load(ptq_path)
    layers = quantizable_layers(model)
    kept = [layers[3].node, layers[-1].node]  # a backbone convolution and a head
    partial = keep_float(model, kept, fp32_weights(onnx.load(fp32_path)))
    assert not check_explicit_quantization(partial).problems
    converted, plan = fp16.convert(partial, {})
    weighted = {node.name for node in partial.graph.node if node.op_type == "Conv"}
    assert weighted & set(plan.fp16) == set(kept)
    assert all(plan.fp32[name].startswith("int8") for name in weighted - set(kept))
    assert not check_explicit_quantization(converted).problems
    _, plan_int8 = fp16.convert(model, {})  # the all-INT8 model: no weighted layer in FP16
    assert not weighted & set(plan_int8.fp16)


def test_ptq_partial_stage_writes_the_variant_and_refuses_an_unknown_layer(ptq_models, tmp_path):
    """The stage with a list of names writes the model (those layers float), its FP16 form, ptq_partial.json and
    the tracking record; with auto it reads the sensitivity ranking; a name that is no layer fails naming it
    before anything is written, and an output already there stays."""
    from qatpipe.stages.ptq_partial import REPORT_FILE, ptq_partial
    from qatpipe.stages.sensitivity import JSON_FILE

    spec, fp32_path, ptq_path, planted_path, planted = ptq_models
    spec = spec.model_copy(deep=True)
    spec.sensitivity.val_images = 32
    layer = quantizable_layers(onnx.load(ptq_path))[2]
    from qatpipe.cli import main

    data = ["--set", f"dataset.train={spec.dataset.train}", "--set", f"dataset.val={spec.dataset.val}"]
    assert main(["ptq-partial", "-e", "tiny", *data, "--set", "sensitivity.val_images=32", "-m", str(ptq_path),
                 "--fp32", str(fp32_path), "--keep-float", layer.name, "-o", str(tmp_path / "named" / "model.onnx")]) == 0
    written = json.loads((tmp_path / "named" / REPORT_FILE).read_text())
    assert written["float_layers"] == [layer.node] and written["mode"] == "list"
    assert written["qdq_check"]["problems"] == []
    assert len(quantizable_layers(onnx.load(tmp_path / "named" / "model.onnx"))) == 14
    assert (tmp_path / "named" / "model_fp16.onnx").is_file()
    record = json.loads((tmp_path / "named" / "tracking.json").read_text())
    assert record["stage"] == "ptq_partial" and record["metrics"]["float_layers"] == 1

    spec.ptq.keep_float = [layer.node, "conv_nope"]
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "model.onnx").write_bytes(b"earlier")
    with pytest.raises(QatpipeError, match="'conv_nope' is no node"):
        ptq_partial(spec, fp32_path, ptq_path, tmp_path / "kept" / "model.onnx")
    assert (tmp_path / "kept" / "model.onnx").read_bytes() == b"earlier"

    spec.ptq.keep_float = []  # no layer float: PTQ's file byte for byte, no FP16 form (PTQ has none)
    none = ptq_partial(spec, fp32_path, ptq_path, tmp_path / "none" / "model.onnx")
    assert none["float_layers"] == [] and "fp16" not in none
    assert (tmp_path / "none" / "model.onnx").read_bytes() == ptq_path.read_bytes()
    assert not (tmp_path / "none" / "model_fp16.onnx").exists()

    spec.ptq.keep_float, spec.validate_.max_map_drop = "auto", PLANTED_BUDGET
    with pytest.raises(QatpipeError, match="sensitivity"):
        ptq_partial(spec, fp32_path, planted_path, tmp_path / "auto" / "model.onnx")
    ranking_dir = tmp_path / "sens"
    ranking_dir.mkdir()
    rows = [{"node": planted, "recovery": 0.1, "drop_only_int8": 0.1},
            {"node": layer.node, "recovery": 0.0, "drop_only_int8": 0.0}]
    (ranking_dir / JSON_FILE).write_text(json.dumps({"layers": rows}))
    report = ptq_partial(spec, fp32_path, planted_path, tmp_path / "auto" / "model.onnx", ranking_dir)
    assert report["mode"] == "auto" and report["float_layers"] == [planted] and report["budget_met"]
    # within the budget on the 32-image sample, then on all 48 val images too
    assert report["val_images"] == 32 and report["val_images_all"] == 48
    assert report["map50_all"] >= report["map50_fp32_all"] - PLANTED_BUDGET
    assert report["steps"][-1]["map50_all"] == report["map50_all"]


def test_qat_excluded_layers_auto_keeps_float_what_partial_ptq_keeps_float(trained_tiny, tmp_path, monkeypatch):
    """qat.excluded_layers auto on the tiny detector, its PTQ given the planted range (as ptq_models plants it,
    after the real ptq stage): the search of the FP32 start keeps that layer float, the QAT retrain keeps the same
    Keras layer float and every other weighted layer quantized, its record says so, and a resumed retrain reads
    the names back without searching again."""
    import qatpipe.stages.ptq as ptq_stage
    from qatpipe.errors import SpecError
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model
    from qatpipe.quantization.layers import quantized_layers
    from qatpipe.quantization.qdq_graph import layer_name
    from qatpipe.quantization.transform import quantize_model
    from qatpipe.spec import stage_view
    from qatpipe.stages.retrain import AUTO_FILE, AUTO_FOLDER, auto_excluded_layers, retrain
    from qatpipe.stages.sensitivity import JSON_FILE
    from qatpipe.tracking.records import StageRecord

    spec, model = trained_tiny
    spec = spec.model_copy(deep=True)
    spec.qat.enabled, spec.retrain.epochs, spec.qat.calibration_batches = True, 1, 2
    spec.qat.excluded_layers = "auto"
    spec.validate_.max_map_drop = PLANTED_BUDGET
    spec.sensitivity.val_images, spec.sensitivity.max_layers = 32, 3
    assert "sensitivity:" in stage_view(spec, "retrain_qat")  # the view carries what the search reads ...
    real, planted = ptq_stage.ptq, []

    def ptq_planted(spec, fp32_onnx, output):
        report = real(spec, fp32_onnx, output)
        quantized = onnx.load(output)
        planted.append(plant_bad_range(quantized))
        onnx.save(quantized, output)
        return report

    monkeypatch.setattr(ptq_stage, "ptq", ptq_planted)
    summary = retrain(spec, model, tmp_path / "qat")
    found = summary["qat"]["excluded_layers_auto"]
    [node] = planted
    assert found["float_nodes"] == [node] and found["budget_met"], found
    name = layer_name(node)
    assert found["excluded_layers"] == [name] and found["map50_subset_int8"] < found["map50_subset"]
    qat_model = load_keras_model(summary["model"], get_architecture(spec))
    quantized = {layer.name for layer in quantized_layers(qat_model)}
    assert name not in quantized and len(quantized) >= 10  # only it kept float
    record = StageRecord.read(tmp_path / "qat")
    assert record.tags["qat.excluded_layers"] == f"auto: {name}" and record.metrics["qat_auto.float_layers"] == 1
    assert (tmp_path / "qat" / AUTO_FOLDER / "sensitivity" / JSON_FILE).is_file()
    assert not [path.name for path in (tmp_path / "qat" / AUTO_FOLDER).rglob("*") if path.suffix == ".onnx"
                or path.name == "tracking.json"]  # the search's models and stage records do not travel on
    assert record.params["validate.max_map_drop"] == PLANTED_BUDGET and record.params["sensitivity.max_layers"] == 3

    monkeypatch.setattr(ptq_stage, "ptq", lambda *args: pytest.fail("searched again"))
    assert auto_excluded_layers(spec, model, tmp_path / "qat") == found  # as a resumed retrain finds them
    assert json.loads((tmp_path / "qat" / AUTO_FOLDER / AUTO_FILE).read_text())["excluded_layers"] == [name]
    for bad in ("{not json", '{"excluded_layers": "conv1"}'):  # a damaged finding fails naming the file
        (tmp_path / "bad" / AUTO_FOLDER).mkdir(parents=True, exist_ok=True)
        (tmp_path / "bad" / AUTO_FOLDER / AUTO_FILE).write_text(bad)
        with pytest.raises(QatpipeError, match=rf"{AUTO_FILE}: cannot read the layers qat.excluded_layers auto "
                                               r"found \(delete the file to search again\)"):
            auto_excluded_layers(spec, model, tmp_path / "bad")
    spec.qat.excluded_layers = []
    assert "sensitivity:" not in stage_view(spec, "retrain_qat")  # ... only under auto
    spec.qat.excluded_layers = "auto"
    with pytest.raises(SpecError, match="auto is resolved by the QAT retrain"):
        quantize_model(load_keras_model(model, get_architecture(spec)), spec.qat)
