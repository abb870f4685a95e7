"""FP16 float regions: an ONNX whose float parts compute in FP16 through explicit casts, for TensorRT's strongly
typed builds (TensorRT 11 has no FP16 builder flag: a layer runs FP16 only where the ONNX's types say so).

What stays FP32 (`fp32_nodes`, each with its reason):
- the INT8 region of a Q/DQ model: QuantizeLinear / DequantizeLinear themselves, every node that reads a
  DequantizeLinear (TensorRT runs it in INT8), and every node from which a QuantizeLinear is reached (the
  BatchNorm / ReLU / Add epilogues TensorRT fuses into the INT8 layer before them). What is left of the float
  region after the last quantized layer, and all of an FP32 model, is FP16, except
- the output tail: the float path from the last compute layer (or Q/DQ) to a graph output (sigmoid, softmax, the
  heads' transposes, reshapes and concatenations). FP16 would round scores near 1 to 1 and tie the near-certain
  detections;
- every node that writes or reads a tensor the FP16 guard flags (precision.fp16_flags: it overflows FP16 or
  FP16 would flush it), so no flagged value is ever held in FP16;
- a Shape or Size of a tensor that is float32 already: converted, it would round that tensor through FP16 for
  itself, and the FP32 nodes beside it would read the rounded value.

The conversion itself is onnxconverter-common's (`float16.convert_float_to_float16`, with these nodes on its
block list and the graph's inputs and outputs kept float32); `convert` then checks, node by node, that exactly
the nodes allowed compute in FP16, and that no float32 value goes through FP16 and back.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict, deque
from dataclasses import dataclass, field

from qatpipe.errors import QatpipeError
from qatpipe.graph.onnx_graph import tensor_types
from qatpipe.quantization.kinds import WEIGHTED_ONNX_OPS

log = logging.getLogger(__name__)

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
SHAPE_OPS = ("Shape", "Size")  # read a tensor's shape only, never its values


@dataclass
class Fp16Plan:
    """Which nodes compute in FP16 and which stay FP32 (node name -> why)."""

    fp16: list[str] = field(default_factory=list)
    fp32: dict[str, str] = field(default_factory=dict)
    casts: int = 0  # Cast nodes the conversion inserted
    round_trips_removed: int = 0  # float32 -> float16 -> float32 Cast pairs of the converter's, removed

    def to_dict(self) -> dict:
        reasons: dict[str, int] = defaultdict(int)
        for why in self.fp32.values():
            reasons[why.split(":")[0]] += 1
        return {"fp16_nodes": len(self.fp16), "fp32_nodes": len(self.fp32), "casts": self.casts,
                "round_trips_removed": self.round_trips_removed,
                "fp32_reasons": dict(reasons), "fp32": self.fp32}


def _named(model) -> None:
    """Give every node a unique name (the converter's block list goes by name)."""
    seen: set[str] = set()
    for index, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{index}"
        seen.add(node.name)


def fp32_nodes(model, flags: dict[str, str]) -> dict[str, str]:
    """{node name: why} for the nodes of `model` that must compute in FP32; `flags` is {tensor: why} from the
    FP16 guard. Nodes must be named (`_named`)."""
    from onnx import TensorProto

    nodes = list(model.graph.node)
    producer = {out: node for node in nodes for out in node.output if out}
    consumers: dict[str, list] = defaultdict(list)
    for node in nodes:
        for name in node.input:
            consumers[name].append(node)
    keep: dict[str, str] = {}

    # the INT8 region: everything upstream of a QuantizeLinear (up to the Q/DQ before it) is fused into, or is,
    # an INT8 layer; so is every reader of a DequantizeLinear. A weighted layer that reads no DequantizeLinear (one
    # kept float: ptq.keep_float, qat.excluded_layers) is a float layer, not an epilogue: the walk stops there,
    # and what it alone feeds on the way to the QuantizeLinear (its BatchNorm / ReLU) is its epilogue, float too
    def reads_dq(node) -> bool:
        return any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear" for i in node.input)

    float_layers = {node.name for node in nodes if node.op_type in WEIGHTED_ONNX_OPS and not reads_dq(node)}
    feeds_q: set[str] = set()
    queue = deque(node for node in nodes if node.op_type == "QuantizeLinear")
    while queue:
        for name in queue.popleft().input:
            source = producer.get(name)
            if (source is not None and source.op_type not in QDQ_OPS and source.name not in feeds_q
                    and source.name not in float_layers):
                feeds_q.add(source.name)
                queue.append(source)
    after_float = set(float_layers)
    for node in nodes:  # graph order is topological: a float layer's epilogue leaves the INT8 region
        sources = [producer[i] for i in node.input if i in producer]
        if node.name in feeds_q and sources and all(source.name in after_float for source in sources):
            feeds_q.discard(node.name)
            after_float.add(node.name)
    for node in nodes:
        if node.op_type in QDQ_OPS:
            keep[node.name] = "quantization: Q/DQ and their scales stay float32"
        elif reads_dq(node):
            keep[node.name] = "int8: reads a DequantizeLinear, TensorRT runs it in INT8"
        elif node.name in feeds_q:
            keep[node.name] = "int8 epilogue: feeds a QuantizeLinear, fused into the INT8 layer before it"

    # the output tail: the float path from the last compute layer to a graph output (sigmoid, softmax, the heads'
    # transposes, reshapes and concatenations) stays FP32. In FP16 a score near 1 rounds to 1 (its spacing there is
    # 2^-11), so near-certain detections tie and lose their order, which costs mAP at the stricter IoU thresholds.
    # Only float tensors are followed: a Reshape's shape input (Shape -> Slice -> Concat) is no part of it
    floats = {name for name, kind in tensor_types(model, initializers=True).items() if kind == TensorProto.FLOAT}
    queue = deque(producer[o.name] for o in model.graph.output if o.name in producer)
    while queue:
        node = queue.popleft()
        if (node.op_type in WEIGHTED_ONNX_OPS or node.op_type in QDQ_OPS or node.name in keep
                or not any(out in floats for out in node.output)):
            continue
        keep[node.name] = "output: on the float path from the last compute layer to a graph output"
        queue.extend(producer[i] for i in node.input if i in producer and i in floats)

    # the guard: a flagged value is never held in FP16, neither where it is written nor where it is read
    for tensor, why in flags.items():
        if tensor in producer:
            keep[producer[tensor].name] = f"guard: writes {tensor} ({why})"
        for node in consumers.get(tensor, ()):
            keep.setdefault(node.name, f"guard: reads {tensor} ({why})")

    # a Shape or Size of a float32 tensor reads it as it is: converted, it would make the converter cast that tensor
    # to FP16 for it alone, and the FP32 readers beside it would read the value back through that rounding (SSD's
    # head reshapes take their shape from the head conv's output)
    inputs = {i.name for i in model.graph.input}
    for node in nodes:
        if node.op_type in SHAPE_OPS and node.name not in keep and (
                node.input[0] in inputs or (node.input[0] in producer and producer[node.input[0]].name in keep)):
            keep[node.name] = "shape: reads only the shape of a float32 tensor"
    return keep


def _unshare_initializers(model, keep: dict[str, str]) -> int:
    """Give the FP32 readers of a float initializer that FP16 nodes also read their own copy (the converter
    converts a shared initializer for both, or for neither). Returns the copies made."""
    import onnx

    floats = {i.name: i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    readers: dict[str, list] = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            if name in floats:
                readers[name].append(node)
    copies = 0
    for name, nodes in readers.items():
        fp32 = [node for node in nodes if node.name in keep]
        if not fp32 or len(fp32) == len(nodes):
            continue
        copy = onnx.TensorProto()
        copy.CopyFrom(floats[name])
        copy.name = f"{name}__fp32"
        model.graph.initializer.append(copy)
        for node in fp32:
            for i, input_name in enumerate(node.input):
                if input_name == name:
                    node.input[i] = copy.name
        copies += 1
    return copies


def _cast_to(node) -> int | None:
    return next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None


def _round_trips(model) -> list:
    """The float16 -> float32 Casts that read a float32 -> float16 Cast of a float32 tensor: a value rounded for
    nothing, which a node kept FP32 then reads."""
    import onnx

    types = tensor_types(model, initializers=True)
    writer = {out: node for node in model.graph.node for out in node.output}
    return [node for node in model.graph.node if _cast_to(node) == onnx.TensorProto.FLOAT
            and node.input[0] in writer and _cast_to(writer[node.input[0]]) == onnx.TensorProto.FLOAT16
            and types.get(writer[node.input[0]].input[0]) == onnx.TensorProto.FLOAT]


def _drop_round_trips(model) -> int:
    """Remove the float32 -> float16 -> float32 Cast round trips (`_round_trips`; the converter writes one where a
    float32 tensor feeds a node it must leave in float32: a lossy no-op that would also part a DequantizeLinear
    from its INT8 layer): their readers read the float32 tensor again (a graph output through an Identity), and a
    float16 Cast no node reads any more goes too. Returns the round trips removed."""
    import onnx

    back = _round_trips(model)
    if not back:
        return 0
    writer = {out: node for node in model.graph.node for out in node.output}
    outputs = {o.name for o in model.graph.output}
    rename = {}
    for cast in back:
        source = writer[cast.input[0]].input[0]
        if cast.output[0] in outputs:
            cast.op_type, cast.input[0] = "Identity", source
            del cast.attribute[:]
        else:
            rename[cast.output[0]] = source
    kept = [node for node in model.graph.node if node.output[0] not in rename]
    for node in kept:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    read = {name for node in kept for name in node.input} | outputs
    kept = [node for node in kept
            if _cast_to(node) != onnx.TensorProto.FLOAT16 or any(out in read for out in node.output)]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return len(back)


def _restore_names(original, converted) -> None:
    """Give the nodes' outputs their original names where the converter renamed them (it renames what a node
    it leaves in float32 writes): the layer-by-layer comparison with the float32 model goes by name."""
    before = {node.name: list(node.output) for node in original.graph.node}
    written = {out for node in converted.graph.node for out in node.output}
    rename = {}
    for node in converted.graph.node:
        for i, (now, was) in enumerate(zip(node.output, before.get(node.name, ()))):
            if now != was and was not in written:
                rename[now] = was
                node.output[i] = was
    if not rename:
        return
    for node in converted.graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    stale = set(rename.values()) | set(rename)
    kept = [v for v in converted.graph.value_info if v.name not in stale]
    del converted.graph.value_info[:]
    converted.graph.value_info.extend(kept)


def _float32_outputs(original, converted) -> int:
    """Give back float32 to every graph output that was float32 and came out float16 (the converter casts an
    output to FP16 when a node it must leave in float32 writes it, keep_io_types notwithstanding): that node
    writes the output itself again, or the Cast casts to float32. Returns the outputs fixed."""
    import onnx

    was_float = {o.name for o in original.graph.output if o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    writer = {out: node for node in converted.graph.node for out in node.output}
    types = tensor_types(converted)
    fixed = 0
    for output in converted.graph.output:
        if output.name not in was_float or output.type.tensor_type.elem_type != onnx.TensorProto.FLOAT16:
            continue
        cast = writer.get(output.name)
        if cast is None or cast.op_type != "Cast":
            raise QatpipeError(f"FP16 conversion: graph output {output.name} came out float16 and no Cast writes it")
        readers = [node for node in converted.graph.node if cast.input[0] in node.input]
        source = writer.get(cast.input[0])
        if types.get(cast.input[0]) == onnx.TensorProto.FLOAT and source is not None and readers == [cast]:
            # the node before writes the output itself
            source.output[list(source.output).index(cast.input[0])] = output.name
            converted.graph.node.remove(cast)
        elif types.get(cast.input[0]) == onnx.TensorProto.FLOAT:
            cast.op_type = "Identity"
            del cast.attribute[:]
        else:
            for attribute in cast.attribute:
                if attribute.name == "to":
                    attribute.i = onnx.TensorProto.FLOAT
        output.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        fixed += 1
    return fixed


def _float16_outputs(model) -> dict[str, bool | None]:
    """{node name: True if it writes float16, False if float32, None if it writes no float}."""
    import onnx

    types = tensor_types(model)
    result = {}
    for node in model.graph.node:
        kinds = {types.get(out) for out in node.output if out}
        if onnx.TensorProto.FLOAT16 in kinds:
            result[node.name] = True
        elif onnx.TensorProto.FLOAT in kinds:
            result[node.name] = False
        else:
            result[node.name] = None
    return result


def convert(model, flags: dict[str, str]):
    """(the FP16 model, its Fp16Plan): `model` (an onnx.ModelProto, left unchanged) with every node but
    `fp32_nodes(model, flags)` computing in FP16, inputs and outputs float32. Raises QatpipeError when the
    converter's result is not that plan."""
    import onnx
    from onnxconverter_common import float16

    from qatpipe.export.precision import FP16_MAX, FP16_TINIEST

    model = onnx.ModelProto.FromString(model.SerializeToString())
    _named(model)
    keep = fp32_nodes(model, flags)
    for node in model.graph.node:
        if node.op_type in float16.DEFAULT_OP_BLOCK_LIST:
            keep.setdefault(node.name, f"converter: onnxconverter-common has no FP16 form of {node.op_type}")
    _unshare_initializers(model, keep)
    original = {node.name for node in model.graph.node}
    with warnings.catch_warnings():
        # one warning per weight it clamps into FP16's range (below 2^-24: to 2^-24; a weight beyond FP16_MAX would
        # be clamped too, but the guard keeps FP32 every node whose output comes near that)
        warnings.filterwarnings("ignore", category=UserWarning, module="onnxconverter_common")
        converted = float16.convert_float_to_float16(
            model, keep_io_types=True, min_positive_val=FP16_TINIEST, max_finite_val=FP16_MAX,
            check_fp16_ready=False, op_block_list=[*float16.DEFAULT_OP_BLOCK_LIST, *QDQ_OPS],
            node_block_list=sorted(keep))
    round_trips = _drop_round_trips(converted)
    _float32_outputs(model, converted)
    _restore_names(model, converted)
    writes16 = _float16_outputs(converted)
    plan = Fp16Plan(fp32=keep, round_trips_removed=round_trips)
    wrong = []
    for node in converted.graph.node:
        if node.name not in original:
            if node.op_type == "Cast":
                plan.casts += 1
            continue
        if writes16[node.name] is None:
            continue
        if node.name in keep and writes16[node.name]:
            wrong.append(f"{node.name} ({node.op_type}) computes in FP16 but must stay FP32: {keep[node.name]}")
        elif node.name not in keep:
            if writes16[node.name]:
                plan.fp16.append(node.name)
            else:
                wrong.append(f"{node.name} ({node.op_type}) was left in FP32 though nothing keeps it there")
    wrong += [f"{cast.output[0]} is a float32 value rounded through FP16 and back" for cast in _round_trips(converted)]
    if wrong:
        raise QatpipeError("the FP16 conversion did not follow its plan: " + "; ".join(wrong[:5]))
    log.info("FP16 graph: %d nodes in FP16, %d kept FP32 (%s), %d casts", len(plan.fp16), len(plan.fp32),
             ", ".join(f"{k} {v}" for k, v in plan.to_dict()["fp32_reasons"].items()) or "none", plan.casts)
    return converted, plan


def rounded_form(float32_model, fp16_model):
    """The FP16 form as ONNX Runtime's CPU build can score it faithfully: the float32 model with every value an
    FP16 node of `fp16_model` reads or writes rounded to FP16 (an explicit float32 -> float16 -> float32 Cast pair,
    which ONNX Runtime keeps) and its weights replaced by the FP16 form's; the arithmetic inside each node stays
    float32, as TensorRT's FP16 kernels accumulate. Running the FP16 form itself would not do: ORT's x86 build
    has no FP16 kernels for most ops and computes each run of such nodes in float32 with casts only at its ends,
    so the values between them are never rounded."""
    import onnx
    from onnx import numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(float32_model)
    _named(model)
    writes16 = _float16_outputs(fp16_model)
    fp16 = {node.name for node in fp16_model.graph.node if writes16.get(node.name) and node.op_type != "Cast"}
    missing = fp16 - {node.name for node in model.graph.node}
    if missing:
        raise QatpipeError(f"rounded FP16 form: the FP16 model's nodes {sorted(missing)[:3]} are not in the float32 "
                           "model it should come from")
    weights16 = {i.name.removesuffix("__fp32"): i for i in fp16_model.graph.initializer
                 if i.data_type == onnx.TensorProto.FLOAT16}
    floats = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    types = tensor_types(model)
    added_weights: dict[str, str] = {}
    rounded: dict[str, str] = {}  # float32 tensor -> its FP16-rounded twin
    nodes = []

    def rounding(name: str) -> str:
        if name not in rounded:
            rounded[name] = f"{name}__fp16"
            nodes.append(onnx.helper.make_node("Cast", [name], [f"{name}__half"], to=onnx.TensorProto.FLOAT16,
                                               name=f"{name}__to_fp16"))
            nodes.append(onnx.helper.make_node("Cast", [f"{name}__half"], [rounded[name]], to=onnx.TensorProto.FLOAT,
                                               name=f"{name}__to_fp32"))
        return rounded[name]

    for node in model.graph.node:
        if node.name in fp16:
            for i, name in enumerate(node.input):
                if name in floats and name in weights16:  # its weight as the FP16 form holds it
                    if name not in added_weights:
                        value = numpy_helper.to_array(weights16[name]).astype("float32")
                        added_weights[name] = f"{name}__fp16w"
                        model.graph.initializer.append(numpy_helper.from_array(value, added_weights[name]))
                    node.input[i] = added_weights[name]
                elif name and name not in floats and types.get(name) == onnx.TensorProto.FLOAT:
                    node.input[i] = rounding(name)
        nodes.append(node)
        if node.name in fp16:
            for name in node.output:
                if types.get(name) == onnx.TensorProto.FLOAT:
                    rounding(name)
    # readers of an FP16 node's output read it rounded, as the FP16 form holds it
    outputs16 = {name for node in model.graph.node if node.name in fp16 for name in node.output}
    for node in nodes:
        if node.op_type == "Cast" and node.name.endswith(("__to_fp16", "__to_fp32")):
            continue
        for i, name in enumerate(node.input):
            if name in outputs16 and name in rounded:
                node.input[i] = rounded[name]
    # a graph output an FP16 node writes: the rounded value goes out under the output's name
    for name in [o.name for o in model.graph.output if o.name in rounded]:
        renames = {name: f"{name}__exact", rounded[name]: name}
        for node in nodes:
            node.input[:] = [renames.get(n, n) for n in node.input]
            node.output[:] = [renames.get(n, n) for n in node.output]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    read = {name for node in nodes for name in node.input}
    kept = [i for i in model.graph.initializer if i.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model


__all__ = ["Fp16Plan", "convert", "fp32_nodes", "rounded_form"]
