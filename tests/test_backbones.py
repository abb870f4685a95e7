"""Backbones beyond ResNet (issue "Backbones where PTQ breaks"): each builds at the spec's input size with the
right grid, prunes with TAO's channel rules (hand-built depthwise and squeeze-excitation graphs, and the full
backbones), gets Q/DQ where TensorRT runs it in int8, and exports an ONNX that passes the TensorRT rule check
and computes what TensorFlow computes."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
import tf_keras as keras

from conftest import masked_copy, read_add_past_its_qdq
from qatpipe.errors import SpecError
from qatpipe.models import get_architecture
from qatpipe.models.backbones import BACKBONES
from qatpipe.pruning import prune_model
from qatpipe.pruning.cost import conv_flops
from qatpipe.pruning.graph import analyse
from qatpipe.quantization.layers import (QDQConv2D, QDQDepthwiseConv2D, QDQGlobalAveragePooling2D, QDQMultiply,
                                         quantized_layers)
from qatpipe.quantization.rules import (GlobalPoolingInput, Placement, PointwiseActivationsStayFloat,
                                        SqueezeExcitationScale, default_rules, plan)
from qatpipe.quantization.transform import activation_ranges, calibrate, quantize_model
from qatpipe.spec import BackboneSpec, PruneSpec, QatSpec, bundled_spec_path, field_default, load_spec

L = keras.layers
# every backbone of the registry but the default (ResNet, which the other test files cover): a backbone added to
# models/backbones.py joins these tests
NEW_BACKBONES = tuple(name for name in BACKBONES if name != field_default(BackboneSpec, "name"))


def small_spec(backbone: str, width: float = 0.25):
    """The tiny spec at a 64x96 input (a 4x6 grid), with `backbone`."""
    return load_spec(bundled_spec_path("tiny"), [f"model.backbone.name={backbone}", f"model.backbone.width={width}",
                                                 "dataset.image_size.height=64", "dataset.image_size.width=96"])


def _weaken_odd_filters(model, factor=0.01):
    """Every producer conv's even filters get norm 1 and its odd ones `factor` (as strong L1 training would leave
    them), so a threshold of 0.5 keeps exactly the even channels."""
    for layer in model.layers:
        if type(layer) is L.Conv2D and layer.name not in ("conv_cov", "conv_bbox"):
            weights = layer.get_weights()
            kernel = np.where(weights[0] >= 0, 1.0, -1.0) / np.sqrt(np.prod(weights[0].shape[:-1]))
            kernel[..., 1::2] *= factor
            layer.set_weights([kernel.astype(np.float32), *weights[1:]])


def _bn_stats(model, seed=0):
    rng = np.random.default_rng(seed)
    for layer in model.layers:  # non-trivial BN so the copied per-channel weights matter
        if isinstance(layer, L.BatchNormalization):
            n = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, n), rng.normal(0, 0.3, n), rng.normal(0, 0.2, n),
                               rng.uniform(0.5, 2.0, n)])


def inverted_residual():
    """MobileNetV2's block: expand 1x1 -> depthwise 3x3 -> project 1x1, added to a projected shortcut."""
    inp = keras.Input((8, 8, 3), name="in")
    y = L.Conv2D(8, 1, use_bias=False, name="expand")(inp)
    y = L.ReLU(6.0, name="expand_relu")(L.BatchNormalization(name="expand_bn")(y))
    y = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(y)
    y = L.ReLU(6.0, name="dw_relu")(L.BatchNormalization(name="dw_bn")(y))
    y = L.BatchNormalization(name="project_bn")(L.Conv2D(8, 1, use_bias=False, name="project")(y))
    s = L.BatchNormalization(name="short_bn")(L.Conv2D(8, 1, use_bias=False, name="short")(inp))
    out = L.Conv2D(2, 1, name="head")(L.Add(name="add")([y, s]))
    model = keras.Model(inp, out, name="inverted_residual")
    _bn_stats(model)
    return model


def squeeze_excitation():
    """EfficientNet's SE: features scaled by sigmoid(expand(swish(reduce(mean of the features))))."""
    inp = keras.Input((8, 8, 3), name="in")
    a = L.Activation("swish", name="a_act")(L.BatchNormalization(name="a_bn")(L.Conv2D(8, 3, padding="same",
                                                                                         name="a")(inp)))
    se = L.GlobalAveragePooling2D(keepdims=True, name="squeeze")(a)
    se = L.Activation("swish", name="reduce_act")(L.Conv2D(4, 1, name="reduce")(se))
    se = L.Activation("sigmoid", name="expand_act")(L.Conv2D(8, 1, name="expand")(se))
    y = L.Multiply(name="excite")([a, se])
    out = L.Conv2D(2, 1, name="head")(y)
    model = keras.Model(inp, out, name="squeeze_excitation")
    _bn_stats(model)
    return model


# ------------------------------------------------------------------------------------------------- build


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_each_backbone_builds_a_stride_16_detector_that_reloads_plainly(backbone, tmp_path):
    from qatpipe.models.io import load_keras_model

    spec = small_spec(backbone)
    arch = get_architecture(spec)
    model = arch.build_model()
    cov, bbox = model(np.zeros((1, 64, 96, 3), np.float32))
    assert cov.shape == (1, 4, 6, 3) and bbox.shape == (1, 4, 6, 12)  # 64x96 / 16, three classes
    assert model.name.startswith(f"detectnet_v2_{backbone.split('_')[0]}")
    kinds = {type(layer) for layer in model.layers}
    if backbone != "resnet":
        assert L.DepthwiseConv2D in kinds
    if backbone == "efficientnet_b0":
        assert {L.Multiply, L.GlobalAveragePooling2D} <= kinds
    model.save(tmp_path / "m.keras")
    reloaded = load_keras_model(tmp_path / "m.keras", arch)  # standard layers: no custom objects
    x = np.random.default_rng(0).random((1, 64, 96, 3), np.float32)
    np.testing.assert_allclose(reloaded(x)[1], model(x)[1], atol=1e-5)


def test_unknown_backbone_is_a_spec_error():
    with pytest.raises(SpecError, match=re.escape(f"'vgg' is not a backbone: one of {', '.join(BACKBONES)}")):
        small_spec("vgg")


def test_width_scales_the_new_backbones():
    narrow, wide = (get_architecture(small_spec("mobilenet_v2", w)).build_model() for w in (0.5, 1.0))
    assert narrow.get_layer("block_16_project").filters == 160 and wide.get_layer("block_16_project").filters == 320
    assert narrow.get_layer("Conv1").filters == 16  # 32 x 0.5
    assert conv_flops(narrow) < 0.5 * conv_flops(wide)


# ----------------------------------------------------------------------------------------------- pruning


def test_depthwise_follows_its_input_and_the_pruned_block_equals_the_masked_one():
    model = inverted_residual()
    _weaken_odd_filters(model)
    pruned, report = prune_model(model, PruneSpec(threshold=0.5, granularity=1, min_filters=1))
    assert pruned.get_layer("expand").filters == 4 and pruned.get_layer("dw").depthwise_kernel.shape[2] == 4
    assert pruned.get_layer("dw_bn").gamma.shape[0] == 4 and pruned.get_layer("project").kernel.shape[2] == 4
    assert pruned.get_layer("project").filters == pruned.get_layer("short").filters == 4  # tied by the add
    assert report.flops_after < report.flops_before and conv_flops(pruned) == report.flops_after
    odd = list(range(1, 8, 2))
    masked = masked_copy(model, lambda layer: odd if layer.name in ("project", "head") else [])
    x = np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype(np.float32)
    np.testing.assert_allclose(pruned(x).numpy(), masked(x).numpy(), rtol=1e-5, atol=1e-5)


def test_squeeze_excitation_ties_its_expand_to_the_features_it_scales():
    model = squeeze_excitation()
    graph = analyse(model, set())
    tied = [g for g in graph.groups if set(g.producers) == {"a", "expand"}]
    assert len(tied) == 1 and tied[0].prunable
    _weaken_odd_filters(model)
    pruned, _ = prune_model(model, PruneSpec(threshold=0.5, granularity=1, min_filters=1))
    assert pruned.get_layer("a").filters == pruned.get_layer("expand").filters == 4
    assert pruned.get_layer("reduce").filters == 2 and pruned.get_layer("reduce").kernel.shape[2] == 4
    odd4, odd8 = [1, 3], list(range(1, 8, 2))
    masked = masked_copy(model, lambda layer: {"reduce": odd8, "expand": odd4, "head": odd8}.get(layer.name, []))
    x = np.random.default_rng(2).normal(size=(2, 8, 8, 3)).astype(np.float32)
    np.testing.assert_allclose(pruned(x).numpy(), masked(x).numpy(), rtol=1e-5, atol=1e-5)


def test_depthwise_with_a_multiplier_is_refused_by_name():
    from qatpipe.errors import ModelFileError

    inp = keras.Input((8, 8, 3))
    out = L.DepthwiseConv2D(3, depth_multiplier=2, name="dw2")(L.Conv2D(4, 1, name="c")(inp))
    with pytest.raises(ModelFileError, match="dw2: a depthwise convolution with depth_multiplier 2"):
        prune_model(keras.Model(inp, out), PruneSpec())


@pytest.mark.parametrize("backbone", NEW_BACKBONES)
def test_full_backbones_prune_to_consistent_channels(backbone):
    arch = get_architecture(small_spec(backbone, 0.5))
    model = arch.build_model()
    _weaken_odd_filters(model)
    pruned, report = prune_model(model, PruneSpec(threshold=0.3, granularity=8, min_filters=8))
    assert report.params_after < 0.5 * report.params_before and report.flops_after < 0.5 * report.flops_before
    for layer in pruned.layers:
        if type(layer) is L.DepthwiseConv2D:  # its channels are its input's
            assert layer.depthwise_kernel.shape[2] == layer.input.shape[-1], layer.name
        if type(layer) is L.Multiply:  # SE: the expand conv's filters are the scaled features'
            assert layer.input[0].shape[-1] == layer.input[1].shape[-1], layer.name
    arch.check_model(pruned, "pruned")
    assert [o.shape for o in pruned(np.zeros((1, 64, 96, 3), np.float32))] == [(1, 4, 6, 3), (1, 4, 6, 12)]


# ------------------------------------------------------------------------------------------ QAT placement


def test_se_block_placement_quantizes_the_scale_and_the_squeeze_not_the_activations():
    model = squeeze_excitation()
    placements = plan(model, default_rules(QatSpec()))
    assert placements["excite"].wrapper is QDQMultiply and placements["excite"].options == {"quantized_inputs": [0, 1]}
    assert placements["excite"].rule == "squeeze_excitation_scale"
    assert placements["squeeze"].wrapper is QDQGlobalAveragePooling2D
    assert all(placements[name].wrapper is QDQConv2D for name in ("a", "reduce", "expand", "head"))
    assert not {"a_act", "reduce_act", "expand_act", "a_bn"} & set(placements)


def test_each_new_rule_decides_only_its_own_kind():
    from qatpipe.graph.keras_graph import LayerGraph

    model = inverted_residual()
    graph = LayerGraph(model)
    rules = (SqueezeExcitationScale(), GlobalPoolingInput(), PointwiseActivationsStayFloat())
    decisions = {layer.name: [rule.place(layer, graph) for rule in rules] for layer in model.layers}
    # ReLU6 fuses into the conv before it
    assert decisions["expand_relu"] == [None, None, Placement.stays_float("pointwise_activations_stay_float")]
    assert decisions["dw"] == [None, None, None] and decisions["add"] == [None, None, None]
    se = squeeze_excitation()
    graph = LayerGraph(se)
    stays_float = Placement.stays_float("pointwise_activations_stay_float")
    assert PointwiseActivationsStayFloat().place(se.get_layer("a_act"), graph) == stays_float  # swish
    assert PointwiseActivationsStayFloat().place(se.get_layer("expand_act"), graph) == stays_float  # sigmoid
    assert GlobalPoolingInput().place(se.get_layer("squeeze"), graph).rule == "global_pooling_input"
    assert SqueezeExcitationScale().place(se.get_layer("squeeze"), graph) is None


def test_depthwise_and_se_twins_track_ranges_save_and_load(tmp_path):
    from qatpipe.models.io import load_keras_model

    keras.utils.set_random_seed(0)  # untrained weights: how far int8 moves the output depends on them, as below
    x = np.random.default_rng(3).uniform(size=(4, 8, 8, 3)).astype(np.float32)
    for model in (inverted_residual(), squeeze_excitation()):
        qat = quantize_model(model, QatSpec())
        calibrate(qat, [x], 1)
        kinds = {type(layer) for layer in quantized_layers(qat)}
        assert (QDQDepthwiseConv2D in kinds) == (model.name == "inverted_residual")
        assert (QDQMultiply in kinds) == (model.name == "squeeze_excitation")
        # the depthwise kernel is quantized per channel: each channel's error is within half its own step
        float_out, qat_out = model(x).numpy(), qat(x).numpy()
        assert 0 < np.abs(float_out - qat_out).max() < 0.05 * np.abs(float_out).max()
        qat.save(tmp_path / f"{model.name}.keras")
        loaded = load_keras_model(tmp_path / f"{model.name}.keras")
        assert activation_ranges(loaded) == activation_ranges(qat)
        np.testing.assert_array_equal(loaded(x).numpy(), qat(x).numpy())


# -------------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("backbone", NEW_BACKBONES)
def test_each_backbone_exports_a_qat_onnx_in_explicit_int8_form_that_agrees_with_tf(backbone, tmp_path):
    """The QAT export passes the explicit-quantization check (the Q/DQ placement TensorRT reads; no TensorRT build
    runs here) and agrees with TensorFlow on ONNX Runtime, and the layer check names planted errors."""
    from onnx import numpy_helper

    from qatpipe.export.layer_check import NO_NODES, layer_differences
    from qatpipe.export.onnx_export import export_onnx, output_differences, rounding_sensitivity, save_onnx
    from qatpipe.export.qdq import check_explicit_quantization, fold_weight_quantizers
    from qatpipe.stages.export import ROUNDING_PERTURBATION, qat_limits

    keras.utils.set_random_seed(0)  # the untrained weights decide how far a planted error shows: fix them
    model = get_architecture(small_spec(backbone)).build_model()
    _bn_stats(model)
    images = np.random.default_rng(4).uniform(size=(4, 64, 96, 3)).astype(np.float32)
    fp32 = export_onnx(model, tmp_path / "fp32.onnx", 17)
    for name, diff in output_differences(model, fp32, images).items():  # the float graph: same numbers
        assert diff["max_steps"] < 0.05, (name, diff)
    qat = quantize_model(model, QatSpec())
    calibrate(qat, [images], 1)
    path = export_onnx(qat, tmp_path / "qat.onnx", 17)
    proto = onnx.load(path)
    fold_weight_quantizers(proto)
    check = check_explicit_quantization(proto)
    save_onnx(proto, path)
    weighted = [layer for layer in model.layers if type(layer) in (L.Conv2D, L.DepthwiseConv2D)]
    assert check.problems == [] and check.float_ == [] and len(check.quantized) == len(weighted)
    graph = proto.graph
    producers = {out: node for node in graph.node for out in node.output}
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    depthwise = [n for n in graph.node if n.op_type == "Conv" and any(a.name == "group" and a.i > 1
                                                                      for a in n.attribute)]
    assert len(depthwise) == sum(type(layer) is L.DepthwiseConv2D for layer in model.layers)
    for conv in depthwise:  # the int8 kernel is the grouped Conv's OIHW with one scale per channel
        weight = producers[conv.input[1]]
        assert weight.op_type == "DequantizeLinear" and inits[weight.input[0]].shape[1] == 1
    assert len(check.residual_adds) == sum(type(layer) is L.Add for layer in model.layers)
    if backbone == "efficientnet_b0":  # each SE scale reads both operands through DequantizeLinear
        excites = [n for n in graph.node if n.op_type == "Mul" and all(
            i in producers and producers[i].op_type == "DequantizeLinear" for i in n.input)]
        assert len(excites) == sum(type(layer) is L.Multiply for layer in model.layers)
    # the export's own check: only values on an int8 rounding boundary differ (and what they feed), within what
    # the TF model moves by itself under a few-ulp perturbation of its input
    limits = qat_limits(rounding_sensitivity(qat, images, ROUNDING_PERTURBATION))
    for name, diff in output_differences(qat, path, images).items():
        assert all(diff[key] <= limit for key, limit in limits[name].items()), (name, diff, limits[name])
    # a wrong weight scale on one of the twelve bbox channels is caught: the channel with the largest outputs
    # (untrained, some channels are near zero and a 1.5x error on them moves nothing measurable)
    channel = int(np.argmax(np.abs(qat(images)[1].numpy()).max(axis=(0, 1, 2))))
    head = next(n for n in graph.node if n.op_type == "Conv" and "conv_bbox" in n.output[0])
    scale = next(i for i in graph.initializer if i.name == producers[head.input[1]].input[1])
    values = numpy_helper.to_array(scale).copy()
    values[channel] *= 1.5
    scale.CopyFrom(numpy_helper.from_array(values, scale.name))
    save_onnx(proto, tmp_path / "broken.onnx")
    diff = output_differences(qat, tmp_path / "broken.onnx", images)["output_bbox"]
    assert any(diff[key] > limit for key, limit in limits["output_bbox"].items()), (diff, limits["output_bbox"])
    # the layer-local check (the export's gate): the clean export agrees layer by layer, every layer with ONNX
    # nodes checked; the broken one fails at the head that has the error, and only there
    clean = layer_differences(qat, onnx.load(path), images)
    assert clean["failed"] == [] and set(clean["skipped"].values()) == {NO_NODES}, clean["skipped"]
    assert len(clean["layers"]) == len([layer for layer in qat.layers if layer.name not in clean["skipped"]])
    assert layer_differences(qat, proto, images)["failed"] == ["conv_bbox"]
    # a 1.1x scale on one channel of a convolution halfway down is named, whatever the end-to-end drift
    middle = [layer for layer in qat.layers if type(layer).__name__ == "QDQConv2D"][len(weighted) // 2]
    broken = onnx.load(path)
    _scale_channel(broken, qat, middle, images, 1.1)
    assert layer_differences(qat, broken, images)["failed"] == [middle.name]
    # a residual Add whose quantized input lost its Q/DQ in ONNX (read straight from its float tensor) is named too
    unquantized = onnx.load(path)
    add = read_add_past_its_qdq(unquantized)
    result = layer_differences(qat, unquantized, images)
    [failed] = result["failed"]
    assert f"/{failed}/" in add.name and "1 quantized input(s) in TensorFlow, 0 QuantizeLinear in ONNX" in \
        result["layers"][failed]["problem"]


def _scale_channel(proto, model, layer, images, factor):
    """Multiply the int8 weight scale of `layer`'s channel with the largest outputs by `factor` in `proto`."""
    from onnx import numpy_helper

    outputs = keras.Model(model.inputs, layer.output)(images).numpy()
    channel = int(np.argmax(np.abs(outputs).max(axis=(0, 1, 2))))
    producers = {out: node for node in proto.graph.node for out in node.output}
    conv = next(n for n in proto.graph.node if n.op_type == "Conv" and f"/{layer.name}/" in n.name)
    scale = next(i for i in proto.graph.initializer if i.name == producers[conv.input[1]].input[1])
    values = numpy_helper.to_array(scale).copy()
    values[channel] *= factor
    scale.CopyFrom(numpy_helper.from_array(values, scale.name))


def test_dense_layers_prune_like_convs():
    """conv -> global pooling -> dense -> dense (the output): the pooled channels and the hidden units shrink."""
    inp = keras.Input((8, 8, 3), name="in")
    y = L.GlobalAveragePooling2D(name="pool")(L.Conv2D(8, 3, padding="same", use_bias=False, name="a")(inp))
    y = L.Dense(2, name="out")(L.Dense(6, name="hidden")(y))
    model = keras.Model(inp, y)
    _weaken_odd_filters(model)
    hidden = model.get_layer("hidden").get_weights()
    hidden[0] = np.where(hidden[0] >= 0, 1.0, -1.0).astype(np.float32)
    hidden[0][:, 1::2] *= 0.01
    model.get_layer("hidden").set_weights(hidden)
    pruned, _ = prune_model(model, PruneSpec(threshold=0.5, granularity=1, min_filters=1))
    assert pruned.get_layer("a").filters == 4 and pruned.get_layer("hidden").kernel.shape == (4, 3)
    assert pruned.get_layer("out").kernel.shape == (3, 2)  # the output keeps its units
    masked = masked_copy(model, lambda layer: {"hidden": list(range(1, 8, 2)), "out": [1, 3, 5]}.get(layer.name, []))
    x = np.random.default_rng(5).normal(size=(2, 8, 8, 3)).astype(np.float32)
    np.testing.assert_allclose(pruned(x).numpy(), masked(x).numpy(), rtol=1e-5, atol=1e-5)
