"""Q/DQ graph surgery on a TensorRT-style Q/DQ ONNX (a PTQ model or a QAT export): which layers are quantizable,
and copies of the model with chosen quantizers bypassed (what sensitivity.py scores, partial.py keeps float and
ptq.py un-quantizes).

A quantizable layer is a weighted node (kinds.WEIGHTED_ONNX_OPS: Conv, MatMul, Gemm) that reads its input and
its weight through DequantizeLinear, as TensorRT runs it in int8 (export/qdq.py's check calls these nodes
`quantized`). Its quantizers are the Q/DQ on those two inputs: the layer's input quantizer and weight quantizer,
as NVIDIA's QAT toolkit's per-layer sensitivity analysis toggles them. The variants of a layer L (`variant`):

- only L in INT8 (ONLY): every other Q/DQ bypassed (the other layers, the residual Adds, any requantization of a
  layer's output read float), L's input and weight quantized as in the model;
- every layer but L in INT8 (ALL_BUT, `float_layers` for a set of layers): L's input and weight read float, and
  so does every reader of L's output requantization (a Q/DQ on L's output: a residual Add's quantizer, or, in a
  model quantized with ONNX Runtime's default placement, the Q/DQ it writes after every convolution; a float
  layer's output stays float up to the next INT8 layer's input quantizer); every other Q/DQ as in the model;
- no Q/DQ at all ("float").

Bypassing a quantizer rewires the node that reads the DequantizeLinear to the float tensor the QuantizeLinear
quantized (through copies of any layout ops between the two: tf2onnx puts the model input's Transpose between
its Q and DQ); the Q/DQ nodes left without readers are removed. A weight stored as int8 (the export folds its
quantizer; ORT's PTQ writes int8 directly) has no float tensor left in the model: it reads the FP32 ONNX's
weight when one is given and it is that weight's source (same shape, and every value within half a
quantization step of the int8 one: a PTQ model of that FP32 ONNX), else its dequantized int8 values, the float
nearest to it that the model holds. A QAT model's weights are those dequantized values exactly (QAT trained
them fake-quantized); a PTQ model whose quantizer folded BatchNormalization into its convolutions before
quantizing (ORT's pre-processing does) has weights no FP32 tensor matches, and reads its dequantized ones, half
a step at most from its float values. Each variant says which every bypassed weight read (FP32_WEIGHT,
DEQUANTIZED_WEIGHT; OWN_WEIGHT where the model keeps a float weight behind a QuantizeLinear).

A model output that carries Q/DQ itself (qat.quantize_outputs) keeps it in every variant but the float one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.graph.onnx_graph import RANGE_KEEPING_OPS, attribute, drop_unused_initializers, sort_topologically
from qatpipe.quantization.kinds import WEIGHTED_ONNX_OPS

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
FLOAT_SUFFIX = "_float"  # the float tensors and initializers a variant adds: `<name>_float`
ORT_QUANTIZED_SUFFIX = "_quantized"  # ONNX Runtime's PTQ names a weight W's int8 initializer W_quantized
# the variants of one layer, as sensitivity.json names them
ONLY = "only_int8"
ALL_BUT = "all_but"
# a weight's float values: the FP32 ONNX's, or the dequantized int8 ones
# (OWN_WEIGHT: the model's own float initializer, where its weight quantizer is a QuantizeLinear node)
FP32_WEIGHT, DEQUANTIZED_WEIGHT, OWN_WEIGHT = "fp32", "dequantized", "model"


@dataclass(frozen=True)
class QuantizedLayer:
    """A weighted node with int8 input and weight."""

    node: str  # the ONNX node's name (its first output where it has none)
    op: str
    name: str  # the layer it comes from, as the exporter named it (tf2onnx: `model/<layer>/Conv2D` -> <layer>)
    index: int  # its position in the graph


def layer_name(node_name: str) -> str:
    """The layer an ONNX node comes from: tf2onnx names a Keras layer's nodes `<model>/<layer>/<op>...`, ORT's
    PTQ keeps those names (and appends `_quant` where it renames); anything else is its own name."""
    parts = [part for part in node_name.split("/") if part]
    name = parts[1] if len(parts) >= 3 else node_name
    return name.removesuffix("_quant")


def _label(node) -> str:
    return node.name or node.output[0]


def producers_of(graph) -> dict:
    """Tensor name -> the node that writes it."""
    return {out: node for node in graph.node for out in node.output}


def quantizable_layers(model) -> list[QuantizedLayer]:
    """The weighted nodes of `model` that read their input (0) and weight (1) through DequantizeLinear, in graph
    order: the layers TensorRT runs in int8."""
    producers = producers_of(model.graph)

    def dequantized(name):
        return name in producers and producers[name].op_type == "DequantizeLinear"

    return [QuantizedLayer(_label(node), node.op_type, layer_name(_label(node)), index)
            for index, node in enumerate(model.graph.node)
            if node.op_type in WEIGHTED_ONNX_OPS and len(node.input) > 1
            and dequantized(node.input[0]) and dequantized(node.input[1])]


def resolve_layers(model, names: Iterable[str]) -> list[QuantizedLayer]:
    """The quantizable layers called `names` (their ONNX node names, or the layer names quantizable_layers gives
    when that names one node), in graph order; a name that is no quantizable layer of `model` fails naming it."""
    layers = quantizable_layers(model)
    by_node = {layer.node: layer for layer in layers}
    by_name: dict[str, list[QuantizedLayer]] = {}
    for layer in layers:
        by_name.setdefault(layer.name, []).append(layer)
    picked, unknown = {}, []
    for name in names:
        layer = by_node.get(name) or (by_name[name][0] if len(by_name.get(name, ())) == 1 else None)
        if layer is None:
            unknown.append(name)
        else:
            picked[layer.node] = layer
    if unknown:
        nodes = {node.name for node in model.graph.node}

        def why(name):
            if len(by_name.get(name, ())) > 1:
                return f"{name!r} names {len(by_name[name])} nodes: {', '.join(l.node for l in by_name[name])}"
            return f"{name!r} is {'a node, but not one with int8 input and weight' if name in nodes else 'no node'}"

        reasons = "; ".join(why(name) for name in unknown)
        shown = ", ".join(layer.node for layer in layers[:8]) + (", ..." if len(layers) > 8 else "")
        raise QatpipeError(f"not a quantizable layer of the model: {reasons} (its {len(layers)} quantizable layers: "
                           f"{shown or 'none'})")
    return sorted(picked.values(), key=lambda layer: layer.index)


def fp32_weights(fp32_model) -> dict:
    """The FP32 model's float initializers by name, and each weighted node's weight by node name (`@<node>`):
    where FloatSources.fp32_match looks for a weight's float values."""
    from onnx import numpy_helper

    arrays = {init.name: numpy_helper.to_array(init) for init in fp32_model.graph.initializer
              if init.data_type == 1}  # FLOAT
    weights = dict(arrays)
    for node in fp32_model.graph.node:
        if node.op_type in WEIGHTED_ONNX_OPS and len(node.input) > 1 and node.input[1] in arrays:
            weights[f"@{_label(node)}"] = arrays[node.input[1]]
    return weights


def _along(values: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    values = np.asarray(values)
    return values.reshape([-1 if i == axis and values.size > 1 else 1 for i in range(ndim)])


class FloatSources:
    """Finds (and adds to `model`) the float tensor behind each DequantizeLinear output: the tensor its
    QuantizeLinear read, carried through copies of the layout ops between them, or a weight's float values
    (an FP32 weight matched in `reference`, fp32_weights' dict, else the dequantized int8 values)."""

    def __init__(self, model, reference: dict | None = None):
        from onnx import numpy_helper

        self.model, self.graph = model, model.graph
        self.reference = reference or {}
        self.inits = {init.name: init for init in self.graph.initializer}
        self.producers = producers_of(self.graph)
        self.weight_source: dict[str, str] = {}  # DequantizeLinear output -> FP32_WEIGHT / DEQUANTIZED_WEIGHT
        self._cache: dict[str, str] = {}
        self.array = lambda name: numpy_helper.to_array(self.inits[name])

    def of(self, dq_output: str, reader: str | None = None) -> str:
        """The float tensor for `dq_output` (a DequantizeLinear's output), read by the node `reader`."""
        if dq_output not in self._cache:
            dq = self.producers[dq_output]
            self._cache[dq_output] = (self._weight(dq, reader) if dq.input[0] in self.inits
                                      else self._activation(dq))
        return self._cache[dq_output]

    def dequantized(self, dq) -> np.ndarray:
        """A constant DequantizeLinear's float output."""
        values = self.array(dq.input[0])
        axis = attribute(dq, "axis", 1)
        zero = (self.array(dq.input[2]).astype(np.float64) if len(dq.input) > 2 and dq.input[2] else 0.0)
        scale = self.array(dq.input[1]).astype(np.float64)
        out = (values.astype(np.float64) - _along(zero, axis, values.ndim)) * _along(scale, axis, values.ndim)
        return out.astype(np.float32)

    def fp32_match(self, dq, reader: str | None) -> np.ndarray | None:
        """The FP32 weight that `dq`'s int8 values quantize: looked for by the int8 initializer's name (ORT's
        `_quantized` suffix dropped) and by the reading node's name, accepted when its shape is the same and every
        value lies within half a quantization step (and float rounding) of the dequantized one."""
        name = dq.input[0]
        candidates = [self.reference.get(key) for key in (name, name.removesuffix(ORT_QUANTIZED_SUFFIX),
                                                         f"@{reader}" if reader else None) if key]
        values = self.dequantized(dq)
        if self.array(dq.input[0]).dtype != np.int8:
            return None  # an int32 bias and the like: its dequantized values are what the model computes with
        step = _along(self.array(dq.input[1]).astype(np.float64), attribute(dq, "axis", 1), values.ndim)
        for candidate in candidates:
            if candidate is not None and candidate.shape == values.shape and np.all(
                    np.abs(candidate.astype(np.float64) - values) <= 0.5 * step * (1 + 1e-4) + 1e-7):
                return candidate.astype(np.float32)
        return None

    def _weight(self, dq, reader: str | None) -> str:
        from onnx import numpy_helper

        match = self.fp32_match(dq, reader)
        self.weight_source[dq.output[0]] = DEQUANTIZED_WEIGHT if match is None else FP32_WEIGHT
        name = f"{dq.output[0]}{FLOAT_SUFFIX}"
        self.graph.initializer.append(numpy_helper.from_array(self.dequantized(dq) if match is None else match, name))
        return name

    def _activation(self, dq) -> str:
        from onnx import helper

        chain, tensor = [], dq.input[0]
        while tensor in self.producers and self.producers[tensor].op_type in RANGE_KEEPING_OPS:
            chain.append(self.producers[tensor])
            tensor = self.producers[tensor].input[0]
        quantizer = self.producers.get(tensor)
        if quantizer is None or quantizer.op_type != "QuantizeLinear":
            raise QatpipeError(f"{_label(dq)}: its input {dq.input[0]} comes from no QuantizeLinear (through layout "
                               "ops), so the float tensor it stands for is unknown")
        source = quantizer.input[0]
        for op in reversed(chain):  # the layout ops again, on the float tensor
            copy = helper.make_node(op.op_type, [source, *op.input[1:]], [f"{op.output[0]}{FLOAT_SUFFIX}"],
                                    name=f"{_label(op)}{FLOAT_SUFFIX}")
            copy.attribute.extend(op.attribute)
            self.graph.node.append(copy)
            source = copy.output[0]
        return source


def _drop_unread_qdq(graph) -> None:
    """Remove the Q/DQ nodes (and the layout ops between them) that nothing reads any more."""
    keep_ops = (*QDQ_OPS, *RANGE_KEEPING_OPS)
    while True:
        read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
        unread = [node for node in graph.node if node.op_type in keep_ops and not read.intersection(node.output)]
        if not unread:
            break
        for node in unread:
            graph.node.remove(node)
    known = {name for node in graph.node for name in node.output}
    for info in [info for info in graph.value_info if info.name not in known]:
        graph.value_info.remove(info)
    drop_unused_initializers(graph)


def bypass(model, reads: Sequence[tuple], sources: FloatSources, outputs: Sequence[str] = ()) -> None:
    """Rewire each (node, input index) in `reads`, which reads a DequantizeLinear output, to its float tensor;
    each graph output in `outputs` produced by a DequantizeLinear becomes an Identity of its float tensor."""
    from onnx import helper

    for node, index in reads:
        node.input[index] = sources.of(node.input[index], _label(node))
    for name in outputs:
        dq = sources.producers[name]
        float_name = sources.of(name)
        dq.output[0] = f"{name}_bypassed"  # unread now: removed below
        model.graph.node.append(helper.make_node("Identity", [float_name], [name], name=f"{name}_identity"))
    sort_topologically(model.graph)
    _drop_unread_qdq(model.graph)


def dequantized_reads(model) -> list[tuple]:
    """Every (node, input index) where a node other than a Q/DQ reads a DequantizeLinear output."""
    producers = producers_of(model.graph)
    return [(node, index) for node in model.graph.node if node.op_type not in QDQ_OPS
            for index, name in enumerate(node.input)
            if name in producers and producers[name].op_type == "DequantizeLinear"]


def _dequantized_outputs(model) -> list[str]:
    producers = producers_of(model.graph)
    return [o.name for o in model.graph.output
            if o.name in producers and producers[o.name].op_type == "DequantizeLinear"]


def node_named(model, layer: str):
    """The node of `model` called `layer` (its name, or its first output where it has none)."""
    node = next((n for n in model.graph.node if _label(n) == layer), None)
    if node is None:
        raise QatpipeError(f"{layer}: no such node in the model")
    return node


def variant(model, mode: str, layer: str | None = None, reference: dict | None = None):
    """A copy of the Q/DQ `model` where
    - mode "float": no Q/DQ at all (every layer, Add and output reads float);
    - mode ONLY ("only_int8"): only `layer` (an ONNX node name) reads its input and weight through its Q/DQ,
      everything else float;
    - mode ALL_BUT ("all_but"): `layer`'s input and weight read float, its output requantization too
      (float_layers), every other Q/DQ as it is.
    Float weights: `reference` (fp32_weights of the FP32 ONNX) where one matches, else dequantized (module
    docstring). Returns (model, {DequantizeLinear output: where its float weight came from})."""
    import onnx

    if mode == ALL_BUT:
        return float_layers(model, [layer], reference)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    sources = FloatSources(copy, reference)
    if mode == "float":
        bypass(copy, dequantized_reads(copy), sources, _dequantized_outputs(copy))
    elif mode == ONLY:
        node = node_named(copy, layer)
        bypass(copy, [(n, i) for n, i in dequantized_reads(copy) if not (n is node and i in (0, 1))], sources)
    else:
        raise ValueError(f"unknown variant mode {mode!r}: float, {ONLY} or {ALL_BUT}")
    return copy, sources.weight_source


def float_layers(model, layers: Sequence[str], reference: dict | None = None):
    """A copy of the Q/DQ `model` where each of `layers` (ONNX node names) reads its input and weight float, its
    output's requantization (output_requantization) is read float too, and every other Q/DQ stays: the all-but
    variant of a set of layers, and a partially quantized model (quantization/partial.py). Float weights as in
    `variant`. Returns (model, {DequantizeLinear output: where its float weight came from})."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    sources = FloatSources(copy, reference)
    nodes = [node_named(copy, layer) for layer in layers]
    reads = [(node, index) for node in nodes for index in (0, 1)] + output_requantization(copy, nodes)
    bypass(copy, list({(id(node), index): (node, index) for node, index in reads}.values()), sources)
    return copy, sources.weight_source


def output_requantization(model, nodes: Sequence) -> list[tuple]:
    """Every (node, input index) that reads a DequantizeLinear whose QuantizeLinear quantizes an output of one of
    `nodes`: a residual Add's quantizer on a layer's output, or a requantization after a layer (ONNX Runtime's
    default placement quantizes each convolution's output again; qatpipe's PTQ does not, quantization/ptq.py);
    except the reads of a quantizable layer not in `nodes`, whose input quantizer that pair also is. A layer kept
    float keeps its output float up to the next INT8 layer's input quantizer (docs/quantization.md)."""
    producers = producers_of(model.graph)
    outputs = {name for node in nodes for name in node.output}
    floats = {_label(node) for node in nodes}
    int8_layers = {layer.node for layer in quantizable_layers(model)} - floats

    def requantizes(name: str) -> bool:
        quantizer = producers.get(producers[name].input[0])
        return quantizer is not None and quantizer.op_type == "QuantizeLinear" and quantizer.input[0] in outputs

    return [(node, index) for node, index in dequantized_reads(model) if requantizes(node.input[index])
            and not (index in (0, 1) and _label(node) in int8_layers)]


def layer_qdq(model, layer: str) -> set[str]:
    """The Q/DQ nodes `layer` reads through: the DequantizeLinear of its input and weight, and the QuantizeLinear
    behind each (through layout ops), by name."""
    producers = producers_of(model.graph)
    node = node_named(model, layer)
    found = set()
    for name in node.input[:2]:
        stack = [name]
        while stack:
            producer = producers.get(stack.pop())
            if producer is None:
                continue
            if producer.op_type in QDQ_OPS:
                found.add(_label(producer))
                if producer.op_type == "DequantizeLinear":
                    stack.append(producer.input[0])
            elif producer.op_type in RANGE_KEEPING_OPS:
                stack.append(producer.input[0])
    return found


def qdq_node_names(model) -> set[str]:
    return {_label(node) for node in model.graph.node if node.op_type in QDQ_OPS}


def weights_of_all_but(model, weight_sources: dict[str, str], layer: str) -> str:
    """Where `layer`'s float weight came from in its ALL_BUT variant (`weight_sources`: what variant returned):
    FP32_WEIGHT, DEQUANTIZED_WEIGHT, or OWN_WEIGHT (a float initializer behind a QuantizeLinear in the model)."""
    return weight_sources.get(node_named(model, layer).input[1], OWN_WEIGHT)


__all__ = ["ALL_BUT", "DEQUANTIZED_WEIGHT", "FP32_WEIGHT", "ONLY", "OWN_WEIGHT", "FloatSources", "QuantizedLayer",
           "bypass", "dequantized_reads", "float_layers", "fp32_weights", "layer_name", "layer_qdq", "node_named",
           "output_requantization", "producers_of", "qdq_node_names", "quantizable_layers", "resolve_layers", "variant",
           "weights_of_all_but"]
