"""ONNX Runtime CPU forms of a TensorRT Q/DQ model (`engine.cpu_form`): TensorRT's int8 numbers emulated where
ONNX Runtime runs (engines/onnxruntime_backend.py builds them; quantization/sensitivity.py scores in the exact one).

TensorRT wants symmetric int8 activations (zero point 0) and folds BatchNormalization into the convolution
when it builds the engine. ONNX Runtime's CPU provider turns DQ -> Conv -> Q into an integer QLinearConv only
when the activations are uint8, all Conv inputs come through DequantizeLinear (an int32 bias included) and
nothing sits between Conv and Q except a ReLU whose Q has the lowest value as zero point.

- `exact`: every activation Q/DQ pair moves from int8 to uint8 with zero point 128 over the same scale
  (q_u8 = q_i8 + 128; saturation at [-128, 127] becomes [0, 255]): the graph computes exactly the same
  numbers, and ORT fuses what that allows (few convolutions of a model whose Q/DQ sit after ReLU, as TensorRT
  wants them and qatpipe's QAT and PTQ place them; all of a model quantized with ONNX Runtime's default
  placement, which requantizes every convolution's output).
- `fast`: BatchNormalization folded into the Q/DQ convolution before it, as TensorRT does (per channel: the
  weight scale times |gamma / sqrt(var + eps)|, int8 weights negated where that factor is negative, the new
  bias quantized to int32 at input scale x weight scale); zero point 0 for activations that follow a
  ReLU, so ORT absorbs the ReLU, with 127/255 of the scale so that uint8's 255 steps end where TensorRT's
  int8 saturates (127 steps: a QAT model never saw activations above its ranges); the output of a
  convolution that feeds a residual Add quantized with the scale of the Add's other (quantized) input
  (TensorRT keeps it float: it fuses Conv+Add; ORT cannot, and runs conv and Add as integer kernels this
  way); and float biases of Q/DQ convolutions quantized to int32 (ORT's integer convolution needs them so;
  TensorRT's parser wants them float, so the exported models keep them float).
  Not exact: float rounding of the folded scales, the bias step, and steps half as coarse after a ReLU,
  and a residual conv output clipped to its Add's other input's range. Also merges requantization chains
  Q(s1) -> DQ -> [ReLU] -> Q(s2), which ONNX Runtime's default PTQ placement writes after every convolution,
  into one Q(s2): one rounding instead of two.
"""

from __future__ import annotations

import numpy as np

from qatpipe.graph.onnx_graph import (RANGE_KEEPING_OPS, absorb_batch_norm, batch_norm_factor,
                                      drop_unused_initializers, graph_maps, sort_topologically)


def _is_qdq_conv(conv, producers, inits) -> bool:
    """A Conv whose input and weights come through DequantizeLinear, with constant per-channel weight
    scales and a constant per-tensor input scale (what the rewrites below rely on)."""
    x_dq, w_dq = producers.get(conv.input[0]), producers.get(conv.input[1])
    if x_dq is None or w_dq is None or x_dq.op_type != "DequantizeLinear" or w_dq.op_type != "DequantizeLinear":
        return False
    if w_dq.input[0] not in inits or w_dq.input[1] not in inits or x_dq.input[1] not in inits:
        return False
    out_channels = inits[w_dq.input[0]].dims[0]
    return list(inits[w_dq.input[1]].dims) == [out_channels] and len(inits[x_dq.input[1]].dims) == 0


def fold_batch_norms(model) -> int:
    """Fold BatchNormalization into the Q/DQ convolution before it (float bias); returns how many."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {init.name: init for init in graph.initializer}

    def value(name):
        return numpy_helper.to_array(inits[name])

    producers, consumers = graph_maps(graph)
    folded = 0
    for conv in [node for node in graph.node if node.op_type == "Conv"]:
        users = consumers[conv.output[0]]
        if len(users) != 1 or users[0].op_type != "BatchNormalization" or not _is_qdq_conv(conv, producers, inits):
            continue
        w_dq = producers[conv.input[1]]
        if len(consumers[w_dq.output[0]]) != 1 or (len(conv.input) > 2 and conv.input[2] not in inits):
            continue  # a shared weight, or a bias computed at run time: leave it
        bn = users[0]
        factor, mean, beta = batch_norm_factor(bn, value)
        weights, scale = value(w_dq.input[0]), value(w_dq.input[1]).astype(np.float64)
        if not np.all(factor != 0) or not np.all(scale > 0):
            continue  # a dead channel would give a zero scale
        sign = np.where(factor < 0, -1, 1).reshape(-1, *([1] * (weights.ndim - 1)))
        bias = value(conv.input[2]).astype(np.float64) if len(conv.input) > 2 and conv.input[2] else 0.0
        prefix = f"{conv.name or conv.output[0]}_bnfold"
        graph.initializer.extend([
            numpy_helper.from_array(np.clip(weights.astype(np.int16) * sign, -127, 127).astype(np.int8),
                                    f"{prefix}_w"),
            numpy_helper.from_array((scale * np.abs(factor)).astype(np.float32), f"{prefix}_w_scale"),
            numpy_helper.from_array(((bias - mean) * factor + beta).astype(np.float32), f"{prefix}_bias"),
        ])
        w_dq.input[0], w_dq.input[1] = f"{prefix}_w", f"{prefix}_w_scale"
        absorb_batch_norm(graph, conv, bn, f"{prefix}_bias")
        folded += 1
    drop_unused_initializers(graph)
    return folded


def quantize_conv_biases(model) -> int:
    """A Q/DQ convolution's float bias becomes int32 behind DequantizeLinear (scale: input scale x weight
    scale per channel), which ONNX Runtime needs to run the convolution as QLinearConv; returns how many.
    The bias then moves by at most half that step, a fraction of the input's own quantization step."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    producers, _ = graph_maps(graph)
    quantized = 0
    for conv in [node for node in graph.node if node.op_type == "Conv"]:
        if len(conv.input) < 3 or conv.input[2] not in inits or not _is_qdq_conv(conv, producers, inits):
            continue
        x_scale = float(numpy_helper.to_array(inits[producers[conv.input[0]].input[1]]))
        w_scale = numpy_helper.to_array(inits[producers[conv.input[1]].input[1]]).astype(np.float64)
        bias_scale = (x_scale * w_scale).astype(np.float32)
        if not np.all(bias_scale > 0):
            continue
        bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64)
        limit = np.iinfo(np.int32)
        prefix = f"{conv.name or conv.output[0]}_bias_q"
        graph.initializer.extend([
            numpy_helper.from_array(np.clip(np.round(bias / bias_scale), limit.min, limit.max).astype(np.int32),
                                    f"{prefix}_int32"),
            numpy_helper.from_array(bias_scale, f"{prefix}_scale"),
            numpy_helper.from_array(np.zeros(bias_scale.shape, np.int32), f"{prefix}_zero_point"),
        ])
        graph.node.append(helper.make_node("DequantizeLinear", [f"{prefix}_int32", f"{prefix}_scale",
                                                                f"{prefix}_zero_point"], [prefix], name=prefix,
                                           axis=0))
        conv.input[2] = prefix
        quantized += 1
    sort_topologically(graph)
    drop_unused_initializers(graph)
    return quantized


def activations_to_uint8(model, zero_point_0_after_relu: bool = False) -> int:
    """Every activation Q/DQ chain to uint8 (zero point 128, or 0 after a ReLU when asked); returns how many."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers, consumers = graph_maps(graph)
    non_negative = set()
    for node in graph.node:  # sorted: producers first
        if node.op_type == "Relu" or (node.op_type in RANGE_KEEPING_OPS and node.input[0] in non_negative):
            non_negative.update(node.output)
    shifted, changed = 0, set()
    for node in list(graph.node):
        if node.op_type != "QuantizeLinear" or node.input[0] in inits:
            continue  # weights (initializers) stay int8
        if len(node.input) < 3 or node.input[2] not in inits:
            continue  # no zero point (uint8 by default) or a computed one: not a TensorRT int8 Q
        zero_point = numpy_helper.to_array(inits[node.input[2]])
        if zero_point.dtype != np.int8 or zero_point.any():
            continue
        offset = 0 if zero_point_0_after_relu and node.input[0] in non_negative else 128
        name = f"{node.output[0]}_zero_point_u8"
        graph.initializer.append(numpy_helper.from_array(np.full(zero_point.shape, offset, np.uint8), name))
        node.input[2] = name
        scale = node.input[1]
        if offset == 0:  # [0, 255] steps of 127/255 the scale: TensorRT's saturation point, 127 steps above 0
            scale = f"{node.output[0]}_scale_u8"
            value = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64) * 127 / 255
            graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), scale))
            node.input[1] = scale
        frontier = [node.output[0]]
        while frontier:  # the quantized tensor, through layout ops, to every DequantizeLinear reading it
            tensor = frontier.pop()
            changed.add(tensor)
            for consumer in consumers[tensor]:
                if consumer.op_type == "DequantizeLinear":
                    consumer.input[1], consumer.input[2] = scale, name
                elif consumer.op_type in RANGE_KEEPING_OPS:
                    frontier.extend(consumer.output)
                else:
                    raise ValueError(f"{consumer.name}: reads the int8 tensor {tensor} directly; cannot shift it")
        shifted += 1
    for info in list(graph.value_info):  # stale int8 type annotations; ORT infers them again
        if info.name in changed:
            graph.value_info.remove(info)
    return shifted


def merge_requantization(model) -> int:
    """Q(s1) -> DQ -> [Relu] -> Q(s2) on activations becomes Q(s2) (the ReLU only where Q(s2)'s zero point
    is its lowest value, so the clip at 0 stays); returns how many chains were merged. Not exact."""
    merged = 0
    while _merge_one_requantization(model.graph):  # one at a time: each merge changes the chains around it
        merged += 1
    return merged


def _is_lowest(zero_point: np.ndarray) -> bool:
    """A uint8 zero point of 0: the quantized range starts at 0, so it clips like a ReLU."""
    return zero_point.dtype == np.uint8 and not zero_point.any()


def _merge_one_requantization(graph) -> bool:
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    _, consumers = graph_maps(graph)
    for q1 in graph.node:
        if q1.op_type != "QuantizeLinear" or q1.input[0] in inits:
            continue
        chain = consumers[q1.output[0]]
        if len(chain) != 1 or chain[0].op_type != "DequantizeLinear":
            continue
        dq, relu = chain[0], None
        following = consumers[dq.output[0]]
        if len(following) == 1 and following[0].op_type == "Relu":
            relu = following[0]
            following = consumers[relu.output[0]]
        if len(following) != 1 or following[0].op_type != "QuantizeLinear" or len(following[0].input) < 3:
            continue
        q2 = following[0]
        if q2.input[2] not in inits or q2.output[0] in {output.name for output in graph.output}:
            continue
        zero_point = numpy_helper.to_array(inits[q2.input[2]])
        clips_at_0 = relu is not None or (q1.input[2] in inits
                                          and _is_lowest(numpy_helper.to_array(inits[q1.input[2]])))
        if clips_at_0 and not _is_lowest(zero_point):
            continue  # a clip at 0 (a ReLU, or one merged before) must survive in the zero point
        q1.input[1], q1.input[2] = q2.input[1], q2.input[2]
        for consumer in consumers[q2.output[0]]:
            for i, name in enumerate(consumer.input):
                if name == q2.output[0]:
                    consumer.input[i] = q1.output[0]
        for node in (dq, relu, q2):
            if node is not None:
                graph.node.remove(node)
        return True
    return False


def quantize_residual_conv_outputs(model) -> int:
    """Fast form only: a convolution feeding a residual Add whose other input is quantized gets its output
    quantized with that input's scale and zero point, so ORT runs the conv as QLinearConv and the Add as
    QLinearAdd. Not exact: TensorRT keeps this output in float (it fuses Conv+Add)."""
    from onnx import helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    count = 0
    for add in [n for n in graph.node if n.op_type == "Add" and len(n.input) == 2]:
        sources = [producers.get(name) for name in add.input]
        dq_side = [i for i, p in enumerate(sources) if p is not None and p.op_type == "DequantizeLinear"
                   and p.input[1] in inits and len(p.input) > 2 and p.input[2] in inits]
        conv_side = [i for i, p in enumerate(sources) if p is not None and p.op_type == "Conv"]
        if len(dq_side) != 1 or len(conv_side) != 1:
            continue
        dq, conv_out = sources[dq_side[0]], add.input[conv_side[0]]
        q_name, dq_name = f"{conv_out}_q_for_add", f"{conv_out}_dq_for_add"
        graph.node.extend([helper.make_node("QuantizeLinear", [conv_out, dq.input[1], dq.input[2]], [q_name],
                                            name=q_name),
                           helper.make_node("DequantizeLinear", [q_name, dq.input[1], dq.input[2]], [dq_name],
                                            name=dq_name)])
        add.input[conv_side[0]] = dq_name
        count += 1
    sort_topologically(graph)
    return count


def to_cpu_form(model, form: str, without: frozenset[str] = frozenset()) -> dict[str, int]:
    """Rewrite a Q/DQ model in place into the CPU form `form` ("exact" or "fast", see the module docstring);
    returns how many of each rewrite it made. `without`: fast-form speed rewrites to leave out (OPTIONAL_REWRITES;
    bench/engines.py --without times what each one buys)."""
    if unknown := set(without) - set(OPTIONAL_REWRITES):
        raise ValueError(f"not optional CPU form rewrites: {sorted(unknown)} (optional: {OPTIONAL_REWRITES})")
    fast = form == "fast"
    counts = dict.fromkeys(CPU_FORM_REWRITES, 0)
    if fast:  # the order matters: BN must be folded before conv outputs and biases are quantized
        counts["batch_norms_folded"] = fold_batch_norms(model)
        if "residual_conv_outputs_quantized" not in without:
            counts["residual_conv_outputs_quantized"] = quantize_residual_conv_outputs(model)
    counts["activation_qdq_shifted_to_uint8"] = activations_to_uint8(model, zero_point_0_after_relu=fast)
    if fast:
        if "requantizations_merged" not in without:
            counts["requantizations_merged"] = merge_requantization(model)
        counts["biases_quantized"] = quantize_conv_biases(model)
    drop_unused_initializers(model.graph)  # the int8 zero points the uint8 ones replaced
    return counts


# the rewrites `to_cpu_form` reports, in engine.json's `extra`
CPU_FORM_REWRITES = ("batch_norms_folded", "activation_qdq_shifted_to_uint8", "requantizations_merged",
                     "biases_quantized", "residual_conv_outputs_quantized")
# the fast form's rewrites that only buy speed: the form is valid without each
OPTIONAL_REWRITES = ("requantizations_merged", "residual_conv_outputs_quantized")
