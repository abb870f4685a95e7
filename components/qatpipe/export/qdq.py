"""Explicit-quantization ONNX for TensorRT, after tf2onnx: store weights as int8, check the graph against
TensorRT's rules, and derive the implicit-INT8 pair (an FP32 ONNX + TAO-format calibration cache) for
TensorRT <= 10 and DeepStream users.

tf2onnx writes each quantized kernel as a float initializer behind QuantizeLinear → DequantizeLinear; the
deployment artifact stores the int8 values instead (4x smaller, and what TensorRT's weight DQ expects).
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qatpipe.graph.onnx_graph import RANGE_KEEPING_OPS, attribute, drop_unused_initializers, graph_maps
from qatpipe.quantization.kinds import RESIDUAL_ADD_ONNX_OP, WEIGHTED_ONNX_OPS, onnx_weight_axis

QUANTIZED_OPS = WEIGHTED_ONNX_OPS  # the ops TensorRT runs in int8 given both inputs through DequantizeLinear


def _initializers(graph) -> dict:
    from onnx import numpy_helper

    return {init.name: numpy_helper.to_array(init) for init in graph.initializer}




def _along(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast along `axis` of an `ndim`-array (a single value: everywhere)."""
    values = np.asarray(values)
    return values.reshape([-1 if i == axis and values.size > 1 else 1 for i in range(ndim)])


def _channel_index(shape: tuple, axis: int) -> np.ndarray:
    """Each element's index along `axis`, for an array of `shape`."""
    return np.broadcast_to(_along(np.arange(shape[axis]), axis, len(shape)), shape)


def _quantize(values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int) -> np.ndarray:
    """ONNX QuantizeLinear for int8: round half to even, saturate. Where the scale is the weights' own max |w|
    / 127 per channel (QAT's weight quantizer, quantization/quantizers.py), the codes are TensorFlow's: it
    rounds w * (127 / max |w|), and w / scale lands a weight on a tie at x.5 an ulp off it, one code apart."""
    values = values.astype(np.float32)
    scale, zero_point = _along(scale, axis, values.ndim), _along(zero_point, axis, values.ndim)
    divided = values / scale.astype(np.float32)
    if values.ndim > 1 and scale.size > 1:
        reduce = tuple(i for i in range(values.ndim) if i != axis)
        amax = np.abs(values).max(axis=reduce, keepdims=True)
        if np.allclose(amax / np.float32(127), scale, rtol=1e-6, atol=0) and np.all(amax > 0):
            divided = values * (np.float32(127) / amax)  # float32 throughout, as TensorFlow computes it
    q = np.rint(divided)  # np.rint: half to even, as TensorFlow's QuantizeAndDequantize rounds
    return np.clip(q + zero_point.astype(np.float32), -128, 127).astype(np.int8)


def fold_weight_quantizers(model) -> int:
    """QuantizeLinear(float initializer) → DequantizeLinear becomes int8 initializer → DequantizeLinear.
    Returns the number of weights folded (changes `model` in place)."""
    from onnx import numpy_helper

    graph = model.graph
    inits = _initializers(graph)
    _, consumers = graph_maps(graph)
    folded, removed = 0, []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in inits:
            continue
        weight, scale = inits[node.input[0]], inits[node.input[1]]
        zero_point = inits[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros((), np.int8)
        if zero_point.dtype != np.int8:
            continue
        q_name = f"{node.input[0].split(':')[0]}_int8_{folded}"  # unique even if two Q nodes read one weight
        graph.initializer.append(numpy_helper.from_array(_quantize(weight, scale, zero_point,
                                                                   attribute(node, "axis", 1)), q_name))
        for consumer in consumers[node.output[0]]:
            for i, name in enumerate(consumer.input):
                if name == node.output[0]:
                    consumer.input[i] = q_name
        removed.append(node)
        folded += 1
    for node in removed:
        graph.node.remove(node)
    _fold_weight_layout(graph)
    drop_unused_initializers(graph)
    return folded


def _fold_weight_layout(graph) -> int:
    """int8 initializer → DequantizeLinear → Reshape/Transpose → Conv becomes int8 initializer (reshaped and
    transposed) → DequantizeLinear → Conv, the scale axis moved along with its channels.

    tf2onnx writes a depthwise kernel (HWC1, scales on axis 2) this way: it reshapes and transposes the
    dequantized weight into a grouped Conv's OIHW. TensorRT needs the weight's DequantizeLinear to feed the
    Conv directly. Returns the number of weights re-laid."""
    from onnx import helper, numpy_helper

    inits = _initializers(graph)
    _, consumers = graph_maps(graph)
    count = 0
    for node in list(graph.node):
        if node.op_type != "DequantizeLinear" or inits.get(node.input[0], np.zeros(0)).dtype != np.int8:
            continue
        chain, tensor = [], node.output[0]
        while len(consumers[tensor]) == 1 and consumers[tensor][0].op_type in ("Reshape", "Transpose"):
            op = consumers[tensor][0]
            if op.op_type == "Reshape" and op.input[1] not in inits:
                break
            chain.append(op)
            tensor = op.output[0]
        if not chain:
            continue
        weight, scale = inits[node.input[0]], inits[node.input[1]]
        axis = attribute(node, "axis", 1)
        # the channel index of every element, carried through the same ops, shows where the channel axis lands
        channel = _channel_index(weight.shape, axis)
        for op in chain:
            if op.op_type == "Reshape":
                shape = [d if d != 0 else weight.shape[i] for i, d in enumerate(inits[op.input[1]].tolist())]
                weight, channel = weight.reshape(shape), channel.reshape(shape)
            else:
                perm = attribute(op, "perm", list(reversed(range(weight.ndim))))
                weight, channel = weight.transpose(perm), channel.transpose(perm)
        new_axis = None
        if scale.size > 1:
            new_axis = next((b for b in range(weight.ndim) if weight.shape[b] == scale.size
                             and np.array_equal(channel, _channel_index(weight.shape, b))), None)
            if new_axis is None:
                continue  # the channels are spread over several axes: left as it is, the check names it
        name = f"{node.input[0]}_relaid"
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight), name))
        node.input[0] = name
        if new_axis is not None:
            for attr in [a for a in node.attribute if a.name == "axis"]:
                node.attribute.remove(attr)
            node.attribute.append(helper.make_attribute("axis", new_axis))
        node.output[0] = chain[-1].output[0]
        for op in chain:
            graph.node.remove(op)
        count += 1
    return count




@dataclass
class QdqCheck:
    """What a walk over the graph found, against TensorRT's explicit-quantization rules."""

    quantized: list[str] = field(default_factory=list)  # Conv/Gemm/MatMul nodes with int8 input and weights
    float_: list[str] = field(default_factory=list)  # Conv/Gemm/MatMul left in float (excluded layers)
    residual_adds: list[str] = field(default_factory=list)  # Add nodes with a quantized input
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["float"] = data.pop("float_")
        return data


def check_explicit_quantization(model) -> QdqCheck:
    """Walk the graph: every quantized Conv/Gemm/MatMul must read its input and its weights through
    DequantizeLinear, the weights int8 initializers with per-output-channel scales (axis 0 of OIHW), every
    zero point int8 and 0; activations per tensor. A Conv with only one of the two quantized is a problem
    (TensorRT would run it in float around a stray Q/DQ)."""
    graph = model.graph
    inits = _initializers(graph)
    producer = {out: node for node in graph.node for out in node.output}
    result = QdqCheck()

    def dq_of(name):
        node = producer.get(name)
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    for node in graph.node:
        if node.op_type == "DequantizeLinear":
            zero_point = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if zero_point is None or zero_point.dtype != np.int8 or np.any(zero_point != 0):
                result.problems.append(f"{node.name or node.output[0]}: zero point must be int8 0")
        if node.op_type == RESIDUAL_ADD_ONNX_OP and any(dq_of(name) for name in node.input):
            result.residual_adds.append(node.name or node.output[0])
        if node.op_type not in QUANTIZED_OPS:
            continue
        label = node.name or node.output[0]
        input_dq, weight_dq = dq_of(node.input[0]), dq_of(node.input[1])
        if input_dq is None and weight_dq is None:
            result.float_.append(label)
            continue
        if input_dq is None or weight_dq is None:
            result.problems.append(f"{label}: {'input' if input_dq is None else 'weights'} not quantized "
                                   "(TensorRT needs both)")
            continue
        weights = inits.get(weight_dq.input[0])
        scale = inits.get(weight_dq.input[1])
        if weights is None or weights.dtype != np.int8:
            result.problems.append(f"{label}: weights are not an int8 initializer")
        else:
            axis = onnx_weight_axis(node.op_type, attribute(node, "transB", 0))
            if scale is None or scale.shape != (weights.shape[axis],) or attribute(weight_dq, "axis", 1) != axis:
                result.problems.append(f"{label}: weight scales are not per output channel (axis {axis})")
        activation_scale = inits.get(input_dq.input[1])
        if activation_scale is None or activation_scale.size != 1:
            result.problems.append(f"{label}: input scale is not a per-tensor constant")
        result.quantized.append(label)
    return result


def strip_qdq(model) -> dict[str, float]:
    """Remove every Q/DQ: activations pass through, int8 weights become their dequantized float values (the
    QAT weights exactly). Returns tensor name -> activation scale for every quantized tensor of the result,
    carried through range-keeping ops (a transpose of the input, max pooling): the FP32 graph plus these
    scales is what TensorRT's implicit INT8 mode takes. Changes `model` in place."""
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = _initializers(graph)
    scales: dict[str, float] = {}
    rename: dict[str, str] = {}
    removed = []
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:  # a weight
            weight, scale = inits[node.input[0]].astype(np.float32), inits[node.input[1]].astype(np.float32)
            dequantized = weight * _along(scale, attribute(node, "axis", 1), weight.ndim)
            graph.initializer.append(numpy_helper.from_array(dequantized, node.output[0]))
            removed.append(node)
        elif node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            rename[node.output[0]] = node.input[0]
            removed.append(node)
            if node.op_type == "QuantizeLinear":
                scale = float(inits[node.input[1]].reshape(-1)[0])
                scales[node.input[0]] = max(scale, scales.get(node.input[0], 0.0))
    for node in removed:
        graph.node.remove(node)

    def resolve(name):
        while name in rename:
            name = rename[name]
        return name

    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = resolve(name)
    for output in graph.output:  # a quantized model output (qat.quantize_outputs) keeps its name
        if output.name in rename:
            graph.node.append(helper.make_node("Identity", [resolve(output.name)], [output.name],
                                               name=f"{output.name}_identity"))
    for node in graph.node:  # graph.node is topologically sorted: one pass carries scales forward
        if node.op_type in RANGE_KEEPING_OPS and node.input and node.input[0] in scales:
            for out in node.output:
                scales.setdefault(out, scales[node.input[0]])
    drop_unused_initializers(graph)
    return scales


def calibration_cache_text(scales: dict[str, float], trt_version: int) -> str:
    """TAO / TensorRT calibration cache: a header line naming `trt_version` as NV_TENSORRT_VERSION writes it
    (export.calibration_cache_trt_version), then `tensor: hex of the float32 scale (big endian)`."""
    lines = [f"TRT-{trt_version}-EntropyCalibration2"]
    lines += [f"{name}: {struct.pack('>f', scale).hex()}" for name, scale in sorted(scales.items())]
    return "\n".join(lines) + "\n"


def read_calibration_cache(text: str) -> tuple[str, dict[str, float]]:
    """(header, tensor -> scale) of a TensorRT calibration cache (calibration_cache_text's format; tensor names
    may hold colons, the value follows the last)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("TRT-"):
        raise ValueError("not a TensorRT calibration cache: the first line must be TRT-<version>-<calibrator>")
    scales = {}
    for line in lines[1:]:
        name, _, value = line.rpartition(":")
        scales[name.strip()] = struct.unpack(">f", bytes.fromhex(value.strip()))[0]
    return lines[0], scales


def write_scales_json(path: str | Path, scales: dict[str, float]) -> None:
    Path(path).write_text(json.dumps({name: {"scale": scale, "amax": scale * 127.0}
                                      for name, scale in sorted(scales.items())}, indent=2) + "\n")
