"""QAT for TensorRT: the placement rules on small hand-built graphs, the wrappers, calibration and range
tracking, and the quantized twin of the detector."""

from __future__ import annotations

import numpy as np
import pytest
import tf_keras as keras

from qatpipe.errors import SpecError
from qatpipe.graph.keras_graph import LayerGraph
from qatpipe.quantization.layers import (QDQActivation, QDQAdd, QDQConv2D, QDQDense, QDQDepthwiseConv2D,
                                         quantized_layers)
from qatpipe.quantization.quantizers import QMAX, fake_quant_per_channel, fake_quant_per_tensor
from qatpipe.quantization.rules import (Exclusions, QuantizedOutputs, ResidualAddInput, WeightedInputsAndWeights,
                                        default_rules, plan)
from qatpipe.quantization.transform import activation_ranges, calibrate, quantize_model
from qatpipe.spec import QatSpec

L = keras.layers


def _conv(filters, name, **kw):
    return L.Conv2D(filters, 3, padding="same", name=name, **kw)


def identity_block():
    """conv -> bn -> add(., input) -> relu: the identity shortcut of a ResNet block."""
    x = keras.Input((8, 8, 4), name="input_1")
    y = L.BatchNormalization(name="bn")(_conv(4, "conv")(x))
    y = L.Add(name="add")([y, x])
    return keras.Model(x, L.Activation("relu", name="out")(y))


def projection_block(swap=False):
    """two conv+bn branches into one add; `swap` puts the shortcut first."""
    x = keras.Input((8, 8, 4), name="input_1")
    main = L.BatchNormalization(name="bn_main")(_conv(8, "conv_main")(x))
    short = L.BatchNormalization(name="bn_short")(L.Conv2D(8, 1, name="conv_short")(x))
    y = L.Add(name="add")([short, main] if swap else [main, short])
    return keras.Model(x, y)


def test_fake_quant_is_symmetric_int8_narrow_range():
    x = np.linspace(-3, 3, 101).astype(np.float32)
    q = fake_quant_per_tensor(x, 2.0).numpy()
    step = 2.0 / QMAX
    np.testing.assert_allclose(q, np.clip(np.round(x / step), -127, 127) * step, atol=1e-6)
    assert q.min() == pytest.approx(-2.0) and q.max() == pytest.approx(2.0)  # clipped at +-amax, 0 exact
    assert fake_quant_per_tensor(np.zeros(3, np.float32), 0.0).numpy().tolist() == [0, 0, 0]
    kernel = np.random.default_rng(0).normal(size=(3, 3, 2, 4)).astype(np.float32)
    kernel[..., 1] *= 10  # per-channel: a large channel does not coarsen the others
    wq = fake_quant_per_channel(kernel, axis=3).numpy()
    for c in range(4):
        step = np.abs(kernel[..., c]).max() / QMAX
        assert np.abs(wq[..., c] - kernel[..., c]).max() <= step / 2 + 1e-6


def test_weighted_kinds_get_input_and_weight_quantizers_from_the_table():
    x = keras.Input((8, 8, 4), name="input_1")
    y = _conv(4, "conv")(x)
    y = L.DepthwiseConv2D(3, padding="same", name="depthwise")(y)
    y = L.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="depthwise_x2")(y)
    y = L.Conv2DTranspose(4, 3, name="transposed")(y)  # no table row: stays float
    y = L.Dense(5, name="dense")(L.GlobalAveragePooling2D(name="gap")(y))
    model = keras.Model(x, y)
    placements = plan(model, [WeightedInputsAndWeights()])
    assert {name: p.wrapper for name, p in placements.items()} == {
        "conv": QDQConv2D, "depthwise": QDQDepthwiseConv2D, "dense": QDQDense}
    assert {p.rule for p in placements.values()} == {"weighted_inputs_and_weights"}


def test_every_onnx_op_list_is_the_weighted_kind_tables():
    """The Keras weights and axes are the rows' own, and the ONNX-side lists (the Q/DQ check, the layer count,
    ORT's PTQ op types, the DLA rules for weighted layers) are the ops the rows name: one table, no copies."""
    from qatpipe.export.dla import DLA_RULES
    from qatpipe.export.precision import COMPUTE_OPS
    from qatpipe.export.qdq import QUANTIZED_OPS
    from qatpipe.quantization import kinds
    from qatpipe.quantization.layers import WEIGHTED_KINDS
    from qatpipe.quantization.ptq import OP_TYPES

    # each kind built on 4 input channels: its weight's output channels along the row's axis
    built = {"Conv2D": (L.Conv2D(5, 3), (None, 8, 8, 4), 5),
             "DepthwiseConv2D": (L.DepthwiseConv2D(3), (None, 8, 8, 4), 4), "Dense": (L.Dense(5), (None, 4), 5)}
    assert set(built) == set(kinds.WEIGHTED_KINDS)
    for name, (layer, shape, channels) in built.items():
        layer.build(shape)
        row = kinds.WEIGHTED_KINDS[name]
        assert getattr(layer, row.weight).shape[row.axis] == channels and WEIGHTED_KINDS[type(layer)] is row
    ops = {op for row in kinds.WEIGHTED_KINDS.values() for op in row.onnx_ops}
    assert set(QUANTIZED_OPS) == set(COMPUTE_OPS) == set(kinds.WEIGHTED_ONNX_OPS) == ops == {"Conv", "MatMul", "Gemm"}
    assert OP_TYPES == [*kinds.WEIGHTED_ONNX_OPS, *kinds.INPUT_QUANTIZED_ONNX_OPS]
    weighted_rules = {rule.name: set(rule.ops) for rule in DLA_RULES if set(rule.ops) & ops}
    assert weighted_rules == {"convolution": {"Conv"}, "fully-connected": {"MatMul", "Gemm"}}
    assert kinds.onnx_weight_axis("Conv") == 0 and kinds.onnx_weight_axis("MatMul") == 1
    assert kinds.onnx_weight_axis("Gemm") == 1 and kinds.onnx_weight_axis("Gemm", trans_b=1) == 0


def test_the_unweighted_kinds_the_rules_quantize_are_the_input_quantized_table():
    """kinds.INPUT_QUANTIZED_KINDS (which PTQ's op types come from) names exactly the unweighted layer kinds the
    default rules quantize, among the kinds a backbone or head uses."""
    from qatpipe.quantization import kinds

    x = keras.Input((8, 8, 4), name="input_1")
    y = L.ReLU(name="relu")(_conv(4, "conv")(x))
    y = L.Add(name="add")([y, x])
    y = L.Multiply(name="multiply")([y, L.Activation("sigmoid", name="gate")(y)])
    y = L.MaxPooling2D(name="max_pool")(L.AveragePooling2D(1, name="average_pool")(y))
    y = L.Concatenate(name="concat")([L.UpSampling2D(name="upsample")(y), x])
    model = keras.Model(x, L.GlobalAveragePooling2D(name="gap")(L.Activation("swish", name="swish")(y)))
    unweighted = {type(model.get_layer(name)).__name__ for name in plan(model, default_rules(QatSpec()))} - {"Conv2D"}
    assert unweighted == set(kinds.INPUT_QUANTIZED_KINDS)


def test_residual_rule_quantizes_the_identity_shortcut():
    placements = plan(identity_block(), [ResidualAddInput()])
    assert placements["add"].wrapper is QDQAdd
    assert placements["add"].options == {"quantized_inputs": [1]}  # the conv branch (0) fuses with the add


@pytest.mark.parametrize("swap", [False, True])
def test_residual_rule_with_two_conv_branches_quantizes_the_one_not_fused(swap):
    placements = plan(projection_block(swap), [ResidualAddInput()])
    # both branches could fuse: the first input is fused, the second quantized, whichever conv it comes from
    assert placements["add"].options == {"quantized_inputs": [1]}


def no_fusable_block():
    x = keras.Input((8, 8, 4), name="input_1")
    conv = _conv(4, "conv")(x)
    y = L.Add(name="add")([conv, x])
    return keras.Model(x, [y, L.Activation("relu", name="other_use")(conv)])  # conv output used twice


def test_residual_rule_quantizes_every_input_when_no_conv_can_fuse():
    assert plan(no_fusable_block(), [ResidualAddInput()])["add"].options == {"quantized_inputs": [0, 1]}


@pytest.mark.parametrize("block", [identity_block, projection_block, lambda: projection_block(True),
                                   no_fusable_block], ids=["identity", "projection", "swapped", "no_fusable"])
def test_ptq_quantizes_the_residual_inputs_the_qat_rule_does(block, tmp_path):
    """ONNX Runtime's PTQ quantizes every Add input; quantize_ptq then leaves the one the rule fuses float."""
    import onnx

    from qatpipe.export.onnx_export import export_onnx
    from qatpipe.quantization.ptq import quantize_ptq

    model = block()
    export_onnx(model, tmp_path / "fp32.onnx", 17)
    images = np.random.default_rng(0).random((8, 8, 8, 4), dtype=np.float32)
    quantize_ptq(tmp_path / "fp32.onnx", tmp_path / "ptq.onnx", [images], "minmax")
    graph = onnx.load(tmp_path / "ptq.onnx").graph
    producers = {out: node for node in graph.node for out in node.output}
    (add,) = [node for node in graph.node if node.op_type == "Add"]
    dequantized = [i for i, name in enumerate(add.input)
                   if name in producers and producers[name].op_type == "DequantizeLinear"]
    assert dequantized == plan(model, [ResidualAddInput()])["add"].options["quantized_inputs"]


def squeeze_excitation_block():
    """EfficientNet's MBConv (expand, depthwise, squeeze-excitation, project, residual Add), its SiLU products,
    and a product with a constant after it (`x * 0.5` written in the model: a Mul no rule quantizes)."""
    from qatpipe.models.efficientnet import _mbconv

    x = keras.Input((8, 8, 4), name="input_1")
    y = _mbconv(L.Conv2D(8, 1, name="stem")(x), 3, 6, 8, 1, "block2a_", None)
    return keras.Model(x, L.Activation("sigmoid", name="sigmoid")(L.Conv2D(4, 1, name="head")(y)) * 0.5)


def pooling_and_gate_block():
    """Average pooling, and a Multiply layer of a tensor and the sigmoid of the same tensor (SiLU's shape in
    ONNX, but two layers: the rules quantize the Multiply)."""
    x = keras.Input((8, 8, 4), name="input_1")
    y = L.AveragePooling2D(2, name="average_pool")(L.Conv2D(8, 1, name="stem")(x))
    y = L.Multiply(name="multiply")([y, L.Activation("sigmoid", name="gate")(y)])
    return keras.Model(x, L.Conv2D(4, 1, name="head")(y))


def _dequantized_reads(path) -> dict:
    """(Keras layer, op) -> the input indices read through DequantizeLinear, for each op of `path` that reads
    an activation through one (a weighted op's input 0 only: its weight is input 1)."""
    import onnx

    from qatpipe.quantization.kinds import WEIGHTED_ONNX_OPS

    graph = onnx.load(str(path)).graph
    producers = {out: node for node in graph.node for out in node.output}
    constants = {init.name for init in graph.initializer}

    def activation_dq(name):  # a weight's DequantizeLinear reads an initializer, or the Q of one
        dq = producers.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] in constants:
            return False
        q = producers.get(dq.input[0])
        return q is not None and q.input[0] not in constants

    reads = {}
    for node in graph.node:
        indices = [i for i, name in enumerate(node.input[:1] if node.op_type in WEIGHTED_ONNX_OPS else node.input)
                   if activation_dq(name)]
        if indices:
            reads[(node.name.split("/")[1], node.op_type)] = indices
    return reads


@pytest.mark.parametrize("block", [identity_block, squeeze_excitation_block, pooling_and_gate_block],
                         ids=["residual", "squeeze_excitation", "pooling_and_gate"])
def test_ptq_dequantizes_the_reads_the_qat_export_does(block, tmp_path):
    """PTQ and the QAT export of one model quantize the same reads: the weighted layers' inputs, the residual Add
    input that no convolution fuses, the squeeze-excitation Multiply's two inputs and its pooling's input;
    SiLU's own products and the product with a constant stay float in both."""
    from qatpipe.export.onnx_export import export_onnx
    from qatpipe.quantization.ptq import quantize_ptq

    model = block()
    images = np.random.default_rng(0).random((8, 8, 8, 4), dtype=np.float32)
    export_onnx(model, tmp_path / "fp32.onnx", 17)
    quantize_ptq(tmp_path / "fp32.onnx", tmp_path / "ptq.onnx", [images], "minmax")
    qat = quantize_model(model, QatSpec())
    calibrate(qat, [images], max_batches=1)
    export_onnx(qat, tmp_path / "qat.onnx", 17)
    ptq_reads, qat_reads = _dequantized_reads(tmp_path / "ptq.onnx"), _dequantized_reads(tmp_path / "qat.onnx")
    assert ptq_reads == qat_reads
    if block is squeeze_excitation_block:
        assert {op for _, op in ptq_reads} == {"Conv", "Add", "Mul", "GlobalAveragePool"}
        assert ptq_reads[("block2a_se_excite", "Mul")] == [0, 1]
    if block is pooling_and_gate_block:
        assert ptq_reads[("average_pool", "AveragePool")] == [0] and ptq_reads[("multiply", "Mul")] == [0, 1]


def test_exclusions_by_name_and_type_win_over_later_rules():
    model = projection_block()
    rules = default_rules(QatSpec(excluded_layers=["conv_short"], excluded_layer_types=["Add"]))
    placements = plan(model, rules)
    assert set(placements) == {"conv_main"}
    assert isinstance(rules[0], Exclusions)


def test_outputs_stay_float_unless_named():
    x = keras.Input((8, 8, 4), name="input_1")
    y = _conv(4, "conv")(x)
    model = keras.Model(x, [L.Activation("sigmoid", name="output_cov")(y),
                            L.Activation("linear", name="output_bbox")(y)])
    assert "output_bbox" not in plan(model, default_rules(QatSpec()))
    assert "output_cov" not in plan(model, default_rules(QatSpec()))
    placements = plan(model, [QuantizedOutputs(["output_cov"])])
    assert set(placements) == {"output_cov"} and placements["output_cov"].wrapper is QDQActivation
    graph = LayerGraph(model)
    assert graph.outputs == {"output_cov", "output_bbox"}


def test_quantize_model_keeps_names_weights_and_float_behaviour_within_int8_error():
    model = identity_block()
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(4, 8, 8, 4)).astype(np.float32)
    qat = quantize_model(model, QatSpec())
    assert [layer.name for layer in qat.layers] == [layer.name for layer in model.layers]
    assert {type(layer) for layer in quantized_layers(qat)} == {QDQConv2D, QDQAdd}
    np.testing.assert_array_equal(qat.get_layer("conv").kernel.numpy(), model.get_layer("conv").kernel.numpy())
    images = calibrate(qat, [x[:2], x[2:]], max_batches=5)
    assert images == 4
    # calibration: the conv's input range is the largest |x| seen, the add's the largest |shortcut| = |x|
    ranges = activation_ranges(qat)
    assert ranges["conv/input_amax"] == pytest.approx(float(np.abs(x).max()))
    assert ranges["add/input1_amax"] == pytest.approx(float(np.abs(x).max()))
    float_out, qat_out = model(x).numpy(), qat(x).numpy()
    assert 0 < np.abs(float_out - qat_out).max() < 0.05 * np.abs(float_out).max()


def test_unknown_exclusion_or_output_is_a_spec_error():
    with pytest.raises(SpecError, match="qat.excluded_layers: no such layers .*: nope"):
        quantize_model(identity_block(), QatSpec(excluded_layers=["nope"]))
    with pytest.raises(SpecError, match="qat.quantize_outputs: not outputs .*: conv"):
        quantize_model(identity_block(), QatSpec(quantize_outputs=["conv"]))


def test_ranges_track_a_moving_average_in_training_and_hold_in_inference():
    qat = quantize_model(identity_block(), QatSpec(ema_decay=0.5))
    x = np.full((1, 8, 8, 4), 1.0, np.float32)
    calibrate(qat, [x], 1)
    conv = qat.get_layer("conv")
    assert float(conv.input_range.amax.numpy()) == pytest.approx(1.0)
    qat(x * 3, training=False)
    assert float(conv.input_range.amax.numpy()) == pytest.approx(1.0)  # inference never moves a range
    qat(x * 3, training=True)
    assert float(conv.input_range.amax.numpy()) == pytest.approx(0.5 * 1.0 + 0.5 * 3.0)


def test_relu6_option_and_gradients_reach_every_weight():
    import tensorflow as tf

    qat = quantize_model(identity_block(), QatSpec(relu6=True))
    out = qat.get_layer("out")
    assert isinstance(out, L.ReLU) and out.max_value == 6.0
    x = np.random.default_rng(1).uniform(size=(2, 8, 8, 4)).astype(np.float32)
    calibrate(qat, [x], 1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(qat(x, training=True))
    grads = tape.gradient(loss, qat.trainable_variables)
    assert all(g is not None and np.any(g.numpy()) for g in grads)  # straight-through estimators


def test_qat_model_saves_and_loads_with_its_ranges(tmp_path):
    from qatpipe.models.io import load_keras_model

    qat = quantize_model(projection_block(), QatSpec())
    x = np.random.default_rng(2).uniform(size=(2, 8, 8, 4)).astype(np.float32)
    calibrate(qat, [x], 1)
    qat.save(tmp_path / "qat.keras")
    loaded = load_keras_model(tmp_path / "qat.keras")
    assert activation_ranges(loaded) == activation_ranges(qat)
    np.testing.assert_array_equal(loaded(x).numpy(), qat(x).numpy())


def test_a_qat_model_needs_its_layers_registered_and_says_so(tmp_path):
    """models/io.py sits below quantization/ and does not import it: in a Python where nothing imported
    quantization/layers.py, a QAT model fails to load naming its unregistered layers (not Keras' "'str' object is
    not callable"); once it is imported, it loads. A fresh interpreter each, so this process's imports do not count."""
    import subprocess
    import sys

    quantize_model(projection_block(), QatSpec()).save(tmp_path / "qat.keras")
    script = ("import sys\nfrom qatpipe.errors import ModelFileError\nfrom qatpipe.models.io import load_keras_model\n"
              "if sys.argv[2] == 'registered':\n    import qatpipe.quantization.layers\n"
              "try:\n    print('loaded', len(load_keras_model(sys.argv[1]).layers))\n"
              "except ModelFileError as exc:\n    print(exc)\n")
    said = {case: subprocess.run([sys.executable, "-c", script, str(tmp_path / "qat.keras"), case], capture_output=True,
                                 text=True, timeout=120).stdout.strip().splitlines()[-1]
            for case in ("alone", "registered")}
    assert said["alone"] == (f"{tmp_path / 'qat.keras'}: holds layers not registered with tf_keras in this process: "
                             "qatpipe>QDQAdd, qatpipe>QDQConv2D (qatpipe's QAT layers register when "
                             "qatpipe.quantization.layers is imported)")
    assert said["registered"] == f"loaded {len(projection_block().layers)}"


def test_detector_twin_quantizes_every_conv_and_residual():
    from qatpipe.models import get_architecture
    from qatpipe.spec import bundled_spec_path, load_spec

    spec = load_spec(bundled_spec_path("tiny"))
    model = get_architecture(spec).build_model()
    placements = plan(model, default_rules(spec.qat))
    convs = [layer.name for layer in model.layers if type(layer) is L.Conv2D]
    adds = [layer.name for layer in model.layers if type(layer) is L.Add]
    assert sorted(n for n, p in placements.items() if p.wrapper is QDQConv2D) == sorted(convs)
    assert all(placements[name].options == {"quantized_inputs": [1]} for name in adds)  # the shortcut
    assert "output_bbox" not in placements and "output_cov" not in placements


def test_ranges_move_inside_a_compiled_training_step_and_calibration_is_off():
    qat = quantize_model(identity_block(), QatSpec(ema_decay=0.5))
    x = np.random.default_rng(3).uniform(size=(4, 8, 8, 4)).astype(np.float32)
    calibrate(qat, [x], 1)
    conv = qat.get_layer("conv")
    assert not conv.input_range.calibrating
    before = float(conv.input_range.amax.numpy())
    qat.compile(optimizer="sgd", loss="mse")  # model.fit traces a tf.function: the Python flags are read then
    qat.fit(x * 4, np.zeros((4, 8, 8, 4), np.float32), epochs=1, batch_size=4, verbose=0)
    assert float(conv.input_range.amax.numpy()) == pytest.approx(0.5 * before + 0.5 * 4 * before, rel=1e-5)


def test_unknown_excluded_layer_type_is_a_spec_error():
    with pytest.raises(SpecError, match="qat.excluded_layer_types: no layers of these classes .*: dense"):
        quantize_model(identity_block(), QatSpec(excluded_layer_types=["dense"]))


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_qat_conv_model_loads_in_both_formats(tmp_path, suffix):
    from qatpipe.models.io import load_keras_model

    qat = quantize_model(identity_block(), QatSpec())
    x = np.random.default_rng(4).uniform(size=(2, 8, 8, 4)).astype(np.float32)
    calibrate(qat, [x], 1)
    qat.save(tmp_path / f"qat{suffix}")
    loaded = load_keras_model(tmp_path / f"qat{suffix}")
    assert activation_ranges(loaded) == activation_ranges(qat)
    np.testing.assert_array_equal(loaded(x).numpy(), qat(x).numpy())


class _Snapshots(keras.callbacks.Callback):
    """Per epoch, at its start and end: the BN's moving mean and scale, the conv's kernel and its input range;
    and at its end whether the BN, called in training mode, normalises with its moving statistics."""

    def __init__(self):
        super().__init__()
        self.seen = []
        self.bn_as_inference = []

    def _take(self):
        bn, conv = self.model.get_layer("bn"), self.model.get_layer("conv")
        return {"moving_mean": bn.moving_mean.numpy().copy(), "gamma": bn.gamma.numpy().copy(),
                "kernel": conv.kernel.numpy().copy(), "amax": float(conv.input_range.amax.numpy())}

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append([self._take()])

    def on_epoch_end(self, epoch, logs=None):
        self.seen[-1].append(self._take())
        bn = self.model.get_layer("bn")
        probe = np.random.default_rng(epoch).normal(5.0, 3.0, size=(2, 8, 8, 4)).astype(np.float32)
        self.bn_as_inference.append(np.allclose(bn(probe, training=True), bn(probe, training=False)))


@pytest.mark.parametrize("bn_epochs, range_epochs", [(1, 1), (None, None), (1, None), (None, 2)])
def test_late_qat_freezes_bn_statistics_and_ranges_from_the_epoch_named(bn_epochs, range_epochs):
    """qat.bn_update_epochs / range_update_epochs: from that epoch BatchNormalization uses and keeps its moving
    statistics and the ranges stay put, while the weights and BN's scale still train; not before, and never
    without the keys (the control, which shows they would have moved)."""
    import tensorflow as tf

    from qatpipe.quantization.freeze import freeze_late

    tf.keras.utils.set_random_seed(0)
    settings = QatSpec(ema_decay=0.5, bn_update_epochs=bn_epochs, range_update_epochs=range_epochs)
    qat = quantize_model(identity_block(), settings)
    rng = np.random.default_rng(4)
    x = rng.uniform(size=(8, 8, 8, 4)).astype(np.float32)
    calibrate(qat, [x], 1)
    qat.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    snapshots = _Snapshots()
    scales = rng.uniform(1.0, 3.0, size=(3, 8, 1, 1, 1)).astype(np.float32)  # each epoch's inputs move the ranges
    data = tf.data.Dataset.from_tensor_slices((x * scales[0], np.ones((8, 8, 8, 4), np.float32))).batch(4)
    for epoch in range(1, 3):  # an epoch: 2 steps, on inputs that grow epoch by epoch
        data = data.concatenate(tf.data.Dataset.from_tensor_slices(
            (x * scales[epoch], np.ones((8, 8, 8, 4), np.float32))).batch(4))
    qat.fit(data, epochs=3, steps_per_epoch=2, verbose=0, callbacks=[*freeze_late(settings), snapshots])

    def moved(epoch, key):
        start, end = snapshots.seen[epoch]
        return not np.array_equal(start[key], end[key])

    for epoch in range(3):
        assert moved(epoch, "kernel") and moved(epoch, "gamma"), epoch  # training goes on throughout
        assert moved(epoch, "moving_mean") == (bn_epochs is None or epoch < bn_epochs), epoch
        assert snapshots.bn_as_inference[epoch] == (bn_epochs is not None and epoch >= bn_epochs), epoch
        assert moved(epoch, "amax") == (range_epochs is None or epoch < range_epochs), epoch
    # after training the layers are as they came: BatchNormalization's own call, ranges that track again
    bn, conv = qat.get_layer("bn"), qat.get_layer("conv")
    assert "call" not in vars(bn) and not conv.input_range.frozen
    assert (qat.train_function is None) == (bn_epochs is not None or range_epochs is not None)  # retraced by a next fit
    before = bn.moving_mean.numpy().copy()
    qat(x * 5, training=True)
    assert not np.array_equal(bn.moving_mean.numpy(), before)


def test_late_qat_freezes_a_resumed_run_before_its_first_step():
    """A retrain resumed past the epoch named trains frozen from its first step."""
    from qatpipe.quantization.freeze import freeze_late

    settings = QatSpec(ema_decay=0.5, bn_update_epochs=1, range_update_epochs=1)
    qat = quantize_model(identity_block(), settings)
    x = np.random.default_rng(5).uniform(size=(8, 8, 8, 4)).astype(np.float32)
    calibrate(qat, [x], 1)
    qat.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    snapshots = _Snapshots()
    qat.fit(x * 3, np.ones_like(x), batch_size=4, epochs=3, initial_epoch=2, verbose=0,
            callbacks=[*freeze_late(settings), snapshots])
    [(start, end)] = snapshots.seen
    assert np.array_equal(start["moving_mean"], end["moving_mean"]) and start["amax"] == end["amax"]
    assert not np.array_equal(start["kernel"], end["kernel"]) and snapshots.bn_as_inference == [True]


def test_late_qat_warns_where_the_epoch_named_never_comes(caplog):
    import logging

    from qatpipe.quantization.freeze import freeze_late

    settings = QatSpec(bn_update_epochs=2, range_update_epochs=1)
    qat = quantize_model(identity_block(), settings)
    x = np.random.default_rng(6).uniform(size=(4, 8, 8, 4)).astype(np.float32)
    calibrate(qat, [x], 1)
    qat.compile(optimizer="sgd", loss="mse")
    with caplog.at_level(logging.WARNING, "qatpipe.qat"):
        qat.fit(x, x, batch_size=4, epochs=2, verbose=0, callbacks=freeze_late(settings))
    assert "qat.bn_update_epochs: 2, but the QAT retrain has 2 epochs: nothing is frozen" in caplog.text
    assert "range_update_epochs" not in caplog.text  # frozen from its second epoch, as asked


def test_late_qat_keys_refuse_a_negative_epoch_count():
    from pydantic import ValidationError

    for key in ("bn_update_epochs", "range_update_epochs"):
        with pytest.raises(ValidationError, match=key):
            QatSpec(**{key: -1})
