"""The layer-local agreement check of a QAT export: every Keras layer against its ONNX nodes, fed the same input.

End to end, an exact conversion of a quantized network still differs from TensorFlow: values within an ulp of
an int8 rounding boundary land one step apart (TF computes x * (127/amax), ONNX x / (amax/127), and the two sum
convolutions in other orders), and every later quantized layer carries such a flip further. How far depends on
the depth, not on the conversion: on EfficientNet-B0 (124 Q/DQ pairs) the outputs drift to a 90th percentile of 4
int8 steps while no layer is wrong (bench/README.md). Here each layer starts afresh from TensorFlow's own values:
its ONNX nodes (named `<model>/<layer>/...` by tf2onnx) are cut out of the exported graph, fed TensorFlow's
outputs of the layers it reads (a quantized input on TensorFlow's int8 grid, so both sides take the same codes),
and their result compared with TensorFlow's output of that layer. A wrong scale, axis or weight shows at the
layer that has it, whatever its depth; a layer whose quantized input has no QuantizeLinear in ONNX fails too.

Mapping: a layer's ONNX output is the tensor its nodes produce that the nodes of the layers reading it consume
(or a graph output); its inputs are the outputs of the layers it reads (the graph input for the input layer).
Layers without nodes of their own (the input, identities) pass their input on. Layouts: ONNX keeps 4-D tensors
NCHW inside where tf2onnx moved the transposes; a value is transposed where the shapes say so.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from qatpipe.graph.onnx_graph import graph_maps

log = logging.getLogger(__name__)

# Limits of one layer fed the same input, in int8 steps of its output's range (max |TF output| / 127). A quantized
# input is fed on TensorFlow's own int8 grid (its fake-quantized value, k * amax/127 with |k| <= 127), so both
# sides take the same codes: no value sits on a rounding boundary (TF computes x * (127/amax), ONNX
# x / (amax/127)), and none lies below -amax, which TF's narrow range clamps to -127 and ONNX's QuantizeLinear (as
# TensorRT) to -128. What is left is float arithmetic in another order: measured at most 0.005 steps over every
# layer of the trained ResNet-10, MobileNetV2 and EfficientNet-B0 exports. A wrong scale, axis or weight moves a
# whole channel or more by many steps (a 1.1x scale on one channel: 12.7); a missing input quantizer is counted.
LIMITS = {"p99_steps": 0.01, "max_steps": 0.1}
# A layer whose output is quantized (a model output in qat.quantize_outputs) cannot be fed around its rounding: an
# output value within an ulp of a boundary may land one of its int8 steps apart, rarely (a few in a million).
OUTPUT_QUANTIZED_LIMITS = {"p99_steps": 0.01, "max_steps": 1.5}
NO_NODES = "no ONNX nodes of its own"  # the input layer, identities: nothing of theirs to check


@dataclass
class LayerMapping:
    layer: str
    kind: str  # the Keras class name
    quantized: bool
    output: str  # the ONNX tensor of the layer's output
    inputs: dict[str, str] = field(default_factory=dict)  # ONNX tensor -> the layer whose output it holds
    quantized_inputs: dict[str, float] = field(default_factory=dict)  # of those, the quantized ones -> amax
    output_quantized: bool = False
    value: str = ""  # the layer whose TensorFlow output `output` holds: the layer, or the BN folded into it

    def __post_init__(self):
        self.value = self.value or self.layer


def _input_ranges(layer) -> dict[int, float]:
    """{input index: amax} of the inputs a quantized layer fake-quantizes (quantization/layers.py)."""
    if hasattr(layer, "quantized_inputs"):  # Add, Multiply: the inputs at those indices
        return {index: float(r.amax.numpy()) for index, r in zip(layer.quantized_inputs, layer.activation_ranges())}
    if hasattr(layer, "input_range"):  # weighted layers, pooling: the one input
        return {0: float(layer.input_range.amax.numpy())}
    return {}


def _inbound(layer) -> list:
    """The layers whose outputs `layer` reads (none for the input layer)."""
    layers = []
    for node in layer.inbound_nodes:
        inbound = node.inbound_layers
        layers += list(inbound) if isinstance(inbound, (list, tuple)) else [inbound]
    return layers


def _outbound(layer) -> list:
    return [node.outbound_layer for node in layer.outbound_nodes]


def map_layers(model, proto) -> tuple[list[LayerMapping], dict[str, str]]:
    """(the mapped layers in model order, {layer: why it has no mapping}) of the Keras `model` and its tf2onnx
    export `proto` (module docstring)."""
    from qatpipe.quantization.layers import QUANTIZED_LAYERS

    graph = proto.graph
    prefix = f"{model.name}/"
    nodes_of: dict[str, list] = defaultdict(list)
    for node in graph.node:
        if node.name.startswith(prefix):
            nodes_of[node.name[len(prefix):].split("/")[0]].append(node)
    _, consumers = graph_maps(graph)
    graph_outputs = {output.name for output in graph.output}
    graph_input = graph.input[0].name
    owned = {id(node) for nodes in nodes_of.values() for node in nodes}

    def read_by(tensor: str, readers: set) -> bool:
        """Whether nodes in `readers` read `tensor`, directly or through nodes of no layer (tf2onnx names the
        activation QuantizeLinear nodes QuantLinearNode__N, outside every layer)."""
        pending, seen = [tensor], set()
        while pending:
            for consumer in consumers[pending.pop()]:
                if id(consumer) in readers:
                    return True
                if id(consumer) not in owned and id(consumer) not in seen:
                    seen.add(id(consumer))
                    pending.extend(consumer.output)
        return False

    exit_of: dict[str, str] = {}  # layer -> the ONNX tensor holding its output
    # layer -> the layer whose TensorFlow output that tensor holds: itself, or for a layer without nodes of its
    # own, its input's. Such a layer is an identity, or one whose nodes tf2onnx renamed (an UpSampling2D's Resize
    # becomes Resize__N): the layer reading it then takes its nodes along, fed the value before them.
    value_of: dict[str, str] = {}
    skipped: dict[str, str] = {}
    # a float convolution's BatchNormalization (a layer qat.excluded_layers keeps float) has no nodes: tf2onnx
    # folds it into the convolution, whose output tensor then holds the BN's output (layer -> its folded BN)
    folded: dict[str, str] = {}
    for layer in model.layers:
        own = nodes_of.get(layer.name, [])
        value_of[layer.name] = layer.name
        if not own:  # the input layer, identities: their output is their input's tensor
            inbound = _inbound(layer)
            if not inbound:
                exit_of[layer.name] = graph_input
            elif len(inbound) == 1 and inbound[0].name in exit_of:
                exit_of[layer.name] = exit_of[inbound[0].name]
                if (type(layer).__name__ == "BatchNormalization" and inbound[0].name not in skipped
                        and len(_outbound(inbound[0])) == 1):
                    folded[inbound[0].name] = layer.name
                else:
                    value_of[layer.name] = value_of[inbound[0].name]
            skipped[layer.name] = NO_NODES
            continue
        readers = set()
        pending = list(_outbound(layer))
        while pending:  # through the layers without nodes of their own (an identity output) to those with
            reader = pending.pop()
            if nodes_of.get(reader.name):
                readers.add(reader.name)
            else:
                pending += _outbound(reader)
        reader_nodes = {id(node) for name in readers for node in nodes_of[name]}
        produced = [out for node in own for out in node.output]
        candidates = [out for out in produced if read_by(out, reader_nodes)]
        if not candidates and not readers:  # a model output: the graph output of its name (after any output Q/DQ),
            mine = {id(node) for node in own}  # else the one its nodes write, else their tensor read elsewhere
            candidates = ([layer.name] if layer.name in graph_outputs else
                          [out for out in produced if out in graph_outputs]
                          or [out for out in produced if any(id(c) not in mine for c in consumers[out])])
        if len(candidates) != 1:
            skipped[layer.name] = f"{len(candidates)} candidate output tensors"
            continue
        exit_of[layer.name] = candidates[0]

    quantized_types = tuple(QUANTIZED_LAYERS)
    mappings = []
    for layer in model.layers:
        if layer.name in skipped:
            continue
        inputs, quantized_inputs, ranges = {}, {}, _input_ranges(layer)
        for index, inbound in enumerate(_inbound(layer)):
            if inbound.name not in exit_of:
                skipped[layer.name] = f"its input {inbound.name} has no mapping"
                break
            inputs[exit_of[inbound.name]] = value_of[inbound.name]
            if index in ranges:
                quantized_inputs[exit_of[inbound.name]] = ranges[index]
        else:
            mappings.append(LayerMapping(layer.name, type(layer).__name__, isinstance(layer, quantized_types),
                                         exit_of[layer.name], inputs, quantized_inputs,
                                         output_quantized=hasattr(layer, "output_range"),
                                         value=folded.get(layer.name, layer.name)))
    return mappings, skipped


class _NotCut(Exception):
    pass


def _cut(proto, producer: dict, constants: set, inputs: list[str], output: str):
    """The ONNX model of the nodes between `inputs` and `output` (with the initializers they read); _NotCut
    where `output` also depends on another tensor that is neither an initializer nor one of `inputs`.
    `producer` (tensor -> node) and `constants` (initializer names) are the whole graph's."""
    from onnx import TensorProto, helper

    graph = proto.graph
    seen, pending = set(), [output]
    while pending:
        tensor = pending.pop()
        if not tensor or tensor in inputs or tensor in constants:
            continue
        node = producer.get(tensor)
        if node is None:
            raise _NotCut(tensor)
        if id(node) not in seen:
            seen.add(id(node))
            pending.extend(node.input)
    nodes = [node for node in graph.node if id(node) in seen]  # the graph's own (topological) order
    read = {name for node in nodes for name in node.input}
    part = helper.make_graph(
        nodes, "layer", [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in inputs],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        [init for init in graph.initializer if init.name in read])
    return helper.make_model(part, opset_imports=proto.opset_import, ir_version=proto.ir_version)


def _to_layout(value: np.ndarray, shape: list) -> np.ndarray:
    """`value` (TensorFlow's NHWC) as an ONNX tensor of `shape` (dims, None where unknown) holds it."""
    if value.ndim != 4 or len(shape) != 4 or _fits(value.shape, shape):
        return value
    moved = value.transpose(0, 3, 1, 2)
    return moved if _fits(moved.shape, shape) else value


def _fits(actual: tuple, shape: list) -> bool:
    return all(d is None or d == a for a, d in zip(actual[1:], shape[1:]))


def _shapes(proto) -> dict[str, list]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto)
    shapes = {}
    for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        dims = info.type.tensor_type.shape.dim
        shapes[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return shapes


def layer_differences(model, proto, inputs: np.ndarray) -> dict:
    """Each mapped layer of `model` against its nodes in `proto` on `inputs`, fed TensorFlow's values:
    {"layers": {layer: {kind, quantized, p50/p90/p99/max_steps, max_abs, limits, within} or, for a quantized
    input without a QuantizeLinear, {kind, quantized, within: False, problem}}, "skipped": {layer: why},
    "worst": the measured layer furthest beyond (or nearest to) its limits, "failed": [layer]}."""
    import onnxruntime as ort
    import tf_keras as keras

    from qatpipe.export.onnx_export import step_differences
    from qatpipe.quantization.quantizers import fake_quant_per_tensor

    mappings, skipped = map_layers(model, proto)
    named = {layer.name: layer for layer in model.layers}
    wanted = sorted({m.value for m in mappings} | {name for m in mappings for name in m.inputs.values()})
    probe = keras.Model(model.inputs, [named[name].output for name in wanted])
    values = dict(zip(wanted, (v.numpy() if hasattr(v, "numpy") else v
                               for v in probe(inputs, training=False))))
    shapes = _shapes(proto)
    producer, _ = graph_maps(proto.graph)
    graph_constants = {init.name for init in proto.graph.initializer}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    results = {}
    for mapping in mappings:
        try:
            part = _cut(proto, producer, graph_constants, list(mapping.inputs), mapping.output)
        except _NotCut as exc:
            skipped[mapping.layer] = f"its nodes also read {exc}, not a layer's output"
            continue
        constants = {init.name for init in part.graph.initializer}
        quantizers = sum(node.op_type == "QuantizeLinear" and node.input[0] not in constants
                         for node in part.graph.node)
        if quantizers < len(mapping.quantized_inputs):
            results[mapping.layer] = {"kind": mapping.kind, "quantized": True, "within": False,
                                      "problem": f"{len(mapping.quantized_inputs)} quantized input(s) in TensorFlow, "
                                                 f"{quantizers} QuantizeLinear in ONNX"}
            continue
        session = ort.InferenceSession(part.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feeds = {}
        for tensor, layer in mapping.inputs.items():
            value = values[layer]
            if tensor in mapping.quantized_inputs:  # on TF's own int8 grid: both sides take the same codes
                value = fake_quant_per_tensor(value, mapping.quantized_inputs[tensor]).numpy()
            feeds[tensor] = _to_layout(value, shapes.get(tensor, []))
        [onnx_out] = session.run([mapping.output], feeds)
        expected = values[mapping.value]
        if onnx_out.shape != expected.shape and onnx_out.ndim == 4:
            onnx_out = onnx_out.transpose(0, 2, 3, 1)
        if onnx_out.shape != expected.shape:
            skipped[mapping.layer] = f"output shapes differ: ONNX {onnx_out.shape}, TensorFlow {expected.shape}"
            continue
        figures = step_differences({"x": expected}, {"x": onnx_out})["x"]
        limits = OUTPUT_QUANTIZED_LIMITS if mapping.output_quantized else LIMITS
        results[mapping.layer] = {"kind": mapping.kind, "quantized": mapping.quantized, **figures,
                                  "limits": limits,
                                  "within": all(figures[key] <= limit for key, limit in limits.items())}
    measured = [name for name, figures in results.items() if "limits" in figures]  # not the missing quantizers
    worst = max(measured, key=lambda name: max(results[name][key] / limit
                                               for key, limit in results[name]["limits"].items()), default=None)
    return {"layers": results, "skipped": skipped, "worst": worst,
            "failed": [name for name, figures in results.items() if not figures["within"]]}


__all__ = ["layer_differences", "map_layers", "LIMITS", "OUTPUT_QUANTIZED_LIMITS", "NO_NODES"]
