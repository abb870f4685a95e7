"""Layer sensitivity of a Q/DQ ONNX (a PTQ model or a QAT export): how much mAP@0.5 each quantizable layer costs.

A quantizable layer is a weighted node (kinds.WEIGHTED_ONNX_OPS: Conv, MatMul, Gemm) that reads its input and
its weight through DequantizeLinear, as TensorRT runs it in int8 (export/qdq.py's check calls these nodes
`quantized`). Its quantizers are the Q/DQ on those two inputs: the layer's input quantizer and weight quantizer,
as NVIDIA's QAT toolkit's per-layer sensitivity analysis toggles them. For each layer L the model is scored
(on a val subset, in ONNX Runtime's exact CPU form of TensorRT's int8: graph/cpu_qdq.py) twice:

- only L in INT8: every other Q/DQ bypassed (the other layers, the residual Adds, any requantization of a
  layer's output read float), L's input and weight quantized as in the model;
- every layer but L in INT8: L's input and weight read float, and so does every reader of L's output
  requantization (a Q/DQ on L's output: a residual Add's quantizer, or, in a model quantized with ONNX Runtime's
  default placement, the Q/DQ it writes after every convolution; a float layer's output stays float up to the
  next INT8 layer's input quantizer); every other Q/DQ as in the model.

Both drops are measured from the model with no Q/DQ at all (`map50_float`): the first is what L's int8 costs on
its own, the second what the whole INT8 model costs while L stays float (compared with the full INT8 model's
drop, what keeping L float would win back: `recovery`).

Bypassing a quantizer rewires the node that reads the DequantizeLinear to the float tensor the QuantizeLinear
quantized (through copies of any layout ops between the two: tf2onnx puts the model input's Transpose between
its Q and DQ); the Q/DQ nodes left without readers are removed. A weight stored as int8 (the export folds its
quantizer; ORT's PTQ writes int8 directly) has no float tensor left in the model: it reads the FP32 ONNX's
weight when one is given and it is that weight's source (same shape, and every value within half a
quantization step of the int8 one: a PTQ model of that FP32 ONNX), else its dequantized int8 values, the float
nearest to it that the model holds. A QAT model's weights are those dequantized values exactly (QAT trained
them fake-quantized); a PTQ model whose quantizer folded BatchNormalization into its convolutions before
quantizing (ORT's pre-processing does) has weights no FP32 tensor matches, and reads its dequantized ones, half
a step at most from its float values. Every layer records which it read (`float_weight`).

A model output that carries Q/DQ itself (qat.quantize_outputs) keeps it in every variant but the float one.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.graph.onnx_graph import RANGE_KEEPING_OPS, attribute, drop_unused_initializers, sort_topologically
from qatpipe.quantization.kinds import WEIGHTED_ONNX_OPS

log = logging.getLogger(__name__)

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


def _producers(graph) -> dict:
    return {out: node for node in graph.node for out in node.output}


def quantizable_layers(model) -> list[QuantizedLayer]:
    """The weighted nodes of `model` that read their input (0) and weight (1) through DequantizeLinear, in graph
    order: the layers TensorRT runs in int8."""
    producers = _producers(model.graph)

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
        self.producers = _producers(self.graph)
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
    producers = _producers(model.graph)
    return [(node, index) for node in model.graph.node if node.op_type not in QDQ_OPS
            for index, name in enumerate(node.input)
            if name in producers and producers[name].op_type == "DequantizeLinear"]


def _dequantized_outputs(model) -> list[str]:
    producers = _producers(model.graph)
    return [o.name for o in model.graph.output
            if o.name in producers and producers[o.name].op_type == "DequantizeLinear"]


def _node(model, layer: str):
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
        node = _node(copy, layer)
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
    nodes = [_node(copy, layer) for layer in layers]
    reads = [(node, index) for node in nodes for index in (0, 1)] + output_requantization(copy, nodes)
    bypass(copy, list({(id(node), index): (node, index) for node, index in reads}.values()), sources)
    return copy, sources.weight_source


def output_requantization(model, nodes: Sequence) -> list[tuple]:
    """Every (node, input index) that reads a DequantizeLinear whose QuantizeLinear quantizes an output of one of
    `nodes`: a residual Add's quantizer on a layer's output, or a requantization after a layer (ONNX Runtime's
    default placement quantizes each convolution's output again; qatpipe's PTQ does not, quantization/ptq.py);
    except the reads of a quantizable layer not in `nodes`, whose input quantizer that pair also is. A layer kept
    float keeps its output float up to the next INT8 layer's input quantizer (docs/quantization.md)."""
    producers = _producers(model.graph)
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
    producers = _producers(model.graph)
    node = _node(model, layer)
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


# ----------------------------------------------------------------------------------------------- screening


def quantization_noise(model, layers: Sequence[QuantizedLayer], batch: np.ndarray,
                       reference: dict | None = None) -> dict[str, float]:
    """A cheap pre-screen, for choosing which layers to score when there are more than can be: per layer, the
    noise-to-signal power ratio that its input quantizer adds to its float input (the model with no Q/DQ run on
    `batch`), plus its weight's (float weight against the int8 one; 0 where only the dequantized weight is
    known), plus that of each requantization of its output (output_requantization: what keeping it float also
    drops)."""
    import onnxruntime as ort
    from onnx import helper

    float_model, _ = variant(model, "float", reference=reference)
    sources = FloatSources(model, reference)  # names only: the tensors `variant` made have the same names
    producers = sources.producers
    quantizers: dict[str, list[tuple]] = {}  # layer -> [(float tensor, QuantizeLinear, DequantizeLinear)]
    for layer in layers:
        node = _node(model, layer.node)
        dq = producers[node.input[0]]
        tensor = dq.input[0]
        while producers[tensor].op_type in RANGE_KEEPING_OPS:
            tensor = producers[tensor].input[0]
        quantizer = producers[tensor]
        found = [(quantizer.input[0], quantizer, dq)]  # the same values as the float input, before any layout op
        # ... and each Q/DQ pair on its output that keeping it float drops, once
        requantized = {reader.input[index]: producers[reader.input[index]]
                       for reader, index in output_requantization(model, [node])}
        found += [(producers[r.input[0]].input[0], producers[r.input[0]], r) for r in requantized.values()]
        quantizers[layer.node] = found
    wanted = sorted({tensor for found in quantizers.values() for tensor, _, _ in found})
    known = {o.name for o in float_model.graph.output}
    for name in sorted(set(wanted) - known):
        float_model.graph.output.append(helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(float_model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = dict(zip(wanted, session.run(wanted, {session.get_inputs()[0].name: np.asarray(batch, np.float32)})))
    noise = {}
    for layer in layers:
        ratio = sum(_noise_ratio(values[tensor].astype(np.float64), quantizer, dq, sources)
                    for tensor, quantizer, dq in quantizers[layer.node])
        w_dq = producers[_node(model, layer.node).input[1]]
        if w_dq.input[0] in sources.inits:
            match = sources.fp32_match(w_dq, layer.node)
            if match is not None:
                w = match.astype(np.float64)
                ratio += float(np.sum((w - sources.dequantized(w_dq)) ** 2) / max(np.sum(w ** 2), 1e-30))
        noise[layer.node] = ratio
    return noise


def _noise_ratio(x: np.ndarray, quantizer, dq, sources: FloatSources) -> float:
    """The noise-to-signal power ratio a per-tensor Q/DQ pair adds to the float tensor `x`."""
    q_scale = float(sources.array(quantizer.input[1]).reshape(-1)[0])
    dq_scale = float(sources.array(dq.input[1]).reshape(-1)[0])
    has_zero = len(quantizer.input) > 2 and quantizer.input[2]
    zero = sources.array(quantizer.input[2]).reshape(-1) if has_zero else np.zeros(1, np.uint8)
    low, high = np.iinfo(zero.dtype).min, np.iinfo(zero.dtype).max
    q_zero = float(zero[0])
    x_hat = (np.clip(np.rint(x / q_scale) + q_zero, low, high) - q_zero) * dq_scale
    return float(np.sum((x - x_hat) ** 2) / max(np.sum(x ** 2), 1e-30))


# ------------------------------------------------------------------------------------------------- scoring


@dataclass
class LayerSensitivity:
    name: str
    node: str
    op: str
    map50_only_int8: float
    drop_only_int8: float  # map50_float - map50_only_int8
    map50_all_but: float
    drop_all_but: float  # map50_float - map50_all_but
    recovery: float  # map50_all_but - map50_int8: what keeping this layer float wins back
    float_weight: str  # FP32_WEIGHT, DEQUANTIZED_WEIGHT or OWN_WEIGHT
    noise: float | None = None  # quantization_noise, where the layers were screened


@dataclass
class SensitivityResult:
    model: str
    val_images: int
    map50_float: float  # no Q/DQ at all
    map50_int8: float  # the model as it is
    layers_total: int
    layers: list[LayerSensitivity] = field(default_factory=list)  # most sensitive first
    skipped: dict[str, float] = field(default_factory=dict)  # screened out: node -> quantization_noise
    map50_fp32_onnx: float | None = None
    fp32_onnx: str | None = None
    scored_by: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def sort_layers(layers: list[LayerSensitivity]) -> list[LayerSensitivity]:
    """Most sensitive first: the largest drop with only it INT8, then the most recovered keeping it float."""
    return sorted(layers, key=lambda r: (-r.drop_only_int8, -r.recovery, r.node))


def exact_scorer(score_path: Callable[[Path], float], folder: str | Path) -> Callable:
    """score(onnx.ModelProto, name) over `score_path(onnx path)`: a copy of the model in the exact CPU form of its
    Q/DQ (graph/cpu_qdq.py: TensorRT's int8 numbers), written to `folder`/<name>.onnx and scored: how every
    variant here, and every partially quantized model (quantization/partial.py), is scored."""
    import onnx

    from qatpipe.graph.cpu_qdq import to_cpu_form

    def score(model, name: str = "model") -> float:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        to_cpu_form(copy, "exact")
        path = Path(folder) / f"{name}.onnx"
        onnx.save(copy, str(path))
        return score_path(path)

    return score


def measure(model_path: str | Path, score: Callable[[Path], float], layers: Sequence[str] = (),
            max_layers: int | None = None, fp32_onnx: str | Path | None = None,
            screening_batch: np.ndarray | None = None, work: str | Path | None = None) -> SensitivityResult:
    """Score the float form, the model itself and each layer's two variants of the Q/DQ ONNX `model_path` with
    `score(onnx path) -> mAP@0.5` (sensitivity_scorer's): `layers` (node or layer names; empty: every
    quantizable layer), at most `max_layers` of them (the noisiest by quantization_noise on
    `screening_batch`). Each variant is written in the exact CPU form (graph/cpu_qdq.py) under `work`."""
    from qatpipe.onnx_model import load_onnx_proto

    started = time.perf_counter()
    model_path = Path(model_path)
    model = load_onnx_proto(model_path)
    every = quantizable_layers(model)
    if not every:
        raise QatpipeError(f"{model_path}: no layer reads int8 input and weights (DequantizeLinear): not a Q/DQ "
                           "model, so there is no layer sensitivity to measure")
    chosen = resolve_layers(model, layers) if layers else every
    reference = fp32_weights(load_onnx_proto(fp32_onnx)) if fp32_onnx else None
    noise: dict[str, float] = {}
    skipped: dict[str, float] = {}
    if max_layers is not None and len(chosen) > max_layers:
        if screening_batch is None:
            raise ValueError("more layers than max_layers: a screening batch is needed to choose")
        noise = quantization_noise(model, chosen, screening_batch, reference)
        kept = set(sorted(noise, key=lambda node: -noise[node])[:max_layers])
        skipped = {layer.node: noise[layer.node] for layer in chosen if layer.node not in kept}
        chosen = [layer for layer in chosen if layer.node in kept]
        log.info("sensitivity: %d of %d layers, the noisiest by their quantizers' noise on one batch (max_layers)",
                 len(chosen), len(every))

    with tempfile.TemporaryDirectory(prefix="qatpipe-sensitivity-", dir=work) as folder:
        scored = exact_scorer(score, folder)
        float_model, _ = variant(model, "float", reference=reference)
        map50_float = scored(float_model, "float")
        map50_int8 = scored(model, "int8")
        map50_fp32 = score(Path(fp32_onnx)) if fp32_onnx else None
        log.info("sensitivity: mAP@0.5 %.4f without Q/DQ, %.4f INT8%s; %d layers, 2 variants each", map50_float,
                 map50_int8, f", {map50_fp32:.4f} the FP32 ONNX" if map50_fp32 is not None else "", len(chosen))
        results = []
        for k, layer in enumerate(chosen, 1):
            only, _ = variant(model, ONLY, layer.node, reference)
            map50_only = scored(only, "only")
            all_but, all_but_sources = variant(model, ALL_BUT, layer.node, reference)
            map50_all_but = scored(all_but, "all_but")
            float_weight = weights_of_all_but(model, all_but_sources, layer.node)
            results.append(LayerSensitivity(
                layer.name, layer.node, layer.op, map50_only, round(map50_float - map50_only, 6), map50_all_but,
                round(map50_float - map50_all_but, 6), round(map50_all_but - map50_int8, 6), float_weight,
                noise.get(layer.node)))
            log.info("sensitivity %d/%d %s (%s): only INT8 %.4f (drop %+.4f), all but %.4f (drop %+.4f)", k,
                     len(chosen), layer.node, layer.op, map50_only, map50_float - map50_only, map50_all_but,
                     map50_float - map50_all_but)
    return SensitivityResult(str(model_path), 0, map50_float, map50_int8, len(every), sort_layers(results),
                             skipped, map50_fp32, str(fp32_onnx) if fp32_onnx else None,
                             seconds=round(time.perf_counter() - started, 2))


def weights_of_all_but(model, weight_sources: dict[str, str], layer: str) -> str:
    """Where `layer`'s float weight came from in its ALL_BUT variant (`weight_sources`: what variant returned):
    FP32_WEIGHT, DEQUANTIZED_WEIGHT, or OWN_WEIGHT (a float initializer behind a QuantizeLinear in the model)."""
    return weight_sources.get(_node(model, layer).input[1], OWN_WEIGHT)


# ------------------------------------------------------------------------------------------------- reports


def plot_sensitivity(result: SensitivityResult, path: str | Path, title: str = "") -> Path:
    """A horizontal bar chart, most sensitive layer on top: per layer the mAP@0.5 drop with only it INT8, and
    with every layer but it INT8 (the full INT8 model's drop as a dashed line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.layers
    fig, ax = plt.subplots(figsize=(8, 1.95 + 0.32 * max(len(rows), 1)), dpi=110)
    y = np.arange(len(rows))[::-1]  # the first (most sensitive) at the top
    height = 0.4
    ax.barh(y + height / 2, [100 * r.drop_only_int8 for r in rows], height, label="only this layer INT8",
            color="tab:red")
    ax.barh(y - height / 2, [100 * r.drop_all_but for r in rows], height, label="every layer but this one INT8",
            color="tab:blue")
    ax.axvline(100 * (result.map50_float - result.map50_int8), color="tab:blue", linestyle="--", linewidth=1,
               label="every layer INT8")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(y, [f"{r.name} ({r.op})" if r.name != r.node else r.node for r in rows], fontsize=8)
    ax.set(xlabel=f"mAP@0.5 drop from the float model ({result.map50_float:.3f}), points",
           title=title or f"Layer sensitivity, {result.val_images} val images")
    ax.grid(axis="x", alpha=0.3)
    # under the figure: inside the axes it covered the bars of the least sensitive layers
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def sensitivity_markdown(result: SensitivityResult, title: str = "Layer sensitivity") -> str:
    """The result as a Markdown table, most sensitive first."""
    drop = result.map50_float - result.map50_int8
    lines = [f"# {title}", "",
             f"`{Path(result.model).name}` on {result.val_images} val images ({result.scored_by}): mAP@0.5 "
             f"{result.map50_float:.4f} with no layer INT8, {result.map50_int8:.4f} with every layer INT8 "
             f"(drop {100 * drop:+.2f} points)"
             + (f"; the FP32 ONNX scores {result.map50_fp32_onnx:.4f}" if result.map50_fp32_onnx is not None else "")
             + ".", "",
             "Drops are in mAP@0.5 points from the model with no layer INT8. *Only INT8*: this layer alone "
             "quantized. *All but*: every layer but this one quantized. *Recovery*: what keeping this layer "
             "float wins back from the full INT8 model.", "",
             "| # | layer | ONNX node | op | only INT8 | drop | all but | drop | recovery | float weight |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rank, r in enumerate(result.layers, 1):
        lines.append(f"| {rank} | {r.name} | `{r.node}` | {r.op} | {r.map50_only_int8:.4f} | "
                     f"{100 * r.drop_only_int8:+.2f} | {r.map50_all_but:.4f} | {100 * r.drop_all_but:+.2f} | "
                     f"{100 * r.recovery:+.2f} | {r.float_weight} |")
    if result.skipped:
        lines += ["", f"{len(result.skipped)} of the {result.layers_total} layers were not scored "
                      "(sensitivity.max_layers): their quantizers add the least noise on one batch."]
    return "\n".join(lines) + "\n"


__all__ = ["ALL_BUT", "ONLY", "FloatSources", "LayerSensitivity", "QuantizedLayer", "SensitivityResult", "bypass",
           "dequantized_reads", "exact_scorer", "float_layers", "fp32_weights", "layer_qdq", "measure", "output_requantization",
           "plot_sensitivity", "quantizable_layers", "quantization_noise", "qdq_node_names", "resolve_layers",
           "sensitivity_markdown", "sort_layers", "variant"]
