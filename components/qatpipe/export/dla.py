"""Jetson DLA export (`export.target: dla`): what TensorRT 10 needs to run the QAT model on Orin's DLA.

DLA does not fuse like the GPU, so an INT8 layer there needs a scale on every tensor it reads and writes, not
only on the Conv inputs that the QAT model's Q/DQ cover. TAO's answer is `force_ptq`: calibrate the QAT model
again at export. Here the QAT model's own scales are kept where it has them (its weights were trained under
them) and every other tensor of its implicit FP32 graph is calibrated on training images by ONNX Runtime's
calibrator (`export.dla_calibration_method`, the 99.99th percentile by default, as PTQ): a full-tensor
calibration cache in TAO's format, read by TensorRT 10's implicit INT8 mode and by nvinfer.

DLA has no dynamic shapes, so the DLA form is the implicit graph with a fixed batch (`export.dla_batch`), its
NHWC input transpose folded away (NCHW input: a transpose runs as a Shuffle, which would split the DLA graph)
and BatchNormalization folded into the convolutions, as TensorRT does. A convolution's output that only feeds
its activation is inside one fused DLA layer (convolution, bias and activation in one pass): it gets no scale,
as TensorRT never materialises it. `dla_placement` says, layer by layer, what runs on DLA and what TensorRT's
GPU fallback takes, and why; its rules are named objects in `DLA_RULES` (TensorRT's "DLA Supported Layers and
Restrictions" for Orin).

Engines: TensorRT 10.x (JetPack 6; 10.7 is the last 10.x with DLA) builds it with `DeviceType.DLA`, INT8
from the cache and GPU fallback (engines/tensorrt_backend.py). TensorRT 11.4.1+ runs DLA only strongly typed
(JetPack 7.2.2+): no INT8 flag or calibration cache; that form is not written here.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.graph.onnx_graph import attribute
from qatpipe.quantization.kinds import onnx_ops_of

log = logging.getLogger(__name__)

INT8_MAX = 127.0

# ------------------------------------------------------------------------------------------------ the DLA form


def dla_form(model, batch: int):
    """A copy of the implicit FP32 ONNX `model` for DLA: the batch fixed to `batch`, an input transpose
    NHWC -> NCHW folded into an NCHW input (nvinfer's network-input-order=0), and each BatchNormalization that
    follows a convolution folded into it."""
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    [graph_input] = graph.input
    dims = graph_input.type.tensor_type.shape.dim
    first = [node for node in graph.node if graph_input.name in node.input]
    if (len(first) == 1 and first[0].op_type == "Transpose" and list(attribute(first[0], "perm")) == [0, 3, 1, 2]
            and len(dims) == 4):
        transpose = first[0]
        height, width, channels = (dims[i].dim_value for i in (1, 2, 3))
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name == transpose.output[0]:
                    node.input[i] = graph_input.name
        graph.node.remove(transpose)
        for dim, value in zip(dims[1:], (channels, height, width)):
            dim.Clear()
            dim.dim_value = value
    dims[0].Clear()
    dims[0].dim_value = batch
    _fold_batch_norms(graph)
    for output in graph.output:
        output_dims = output.type.tensor_type.shape.dim
        if output_dims:
            output_dims[0].Clear()
            output_dims[0].dim_value = batch
    del graph.value_info[:]
    return onnx.shape_inference.infer_shapes(model)


def _fold_batch_norms(graph) -> int:
    """Fold each BatchNormalization that is a float Conv's only consumer into it (weights and bias); returns
    how many."""
    from onnx import numpy_helper

    from qatpipe.graph.onnx_graph import absorb_batch_norm, batch_norm_factor, drop_unused_initializers, graph_maps

    inits = {init.name: init for init in graph.initializer}
    _, consumers = graph_maps(graph)
    folded = 0
    for conv in [node for node in graph.node if node.op_type == "Conv"]:
        users = consumers[conv.output[0]]
        if (len(users) != 1 or users[0].op_type != "BatchNormalization" or conv.input[1] not in inits
                or (len(conv.input) > 2 and conv.input[2] and conv.input[2] not in inits)):
            continue
        bn = users[0]
        if any(name not in inits for name in bn.input[1:5]):
            continue
        factor, mean, beta = batch_norm_factor(bn, lambda name: numpy_helper.to_array(inits[name]))
        weights = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
        bias = (numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64)
                if len(conv.input) > 2 and conv.input[2] else 0.0)
        prefix = f"{conv.name or conv.output[0]}_bnfold"
        graph.initializer.extend([
            numpy_helper.from_array((weights * factor.reshape(-1, 1, 1, 1)).astype(np.float32), f"{prefix}_w"),
            numpy_helper.from_array(((bias - mean) * factor + beta).astype(np.float32), f"{prefix}_b")])
        conv.input[1] = f"{prefix}_w"
        absorb_batch_norm(graph, conv, bn, f"{prefix}_b")
        folded += 1
    drop_unused_initializers(graph)
    return folded


FUSED_ACTIVATIONS = ("Relu", "Clip", "LeakyRelu")


def fused_interiors(model) -> set[str]:
    """Convolution outputs whose only consumer is an activation: inside one fused DLA layer, never stored."""
    from qatpipe.graph.onnx_graph import graph_maps

    _, consumers = graph_maps(model.graph)
    outputs = {output.name for output in model.graph.output}
    return {node.output[0] for node in model.graph.node if node.op_type == "Conv"
            and node.output[0] not in outputs and len(consumers[node.output[0]]) == 1
            and consumers[node.output[0]][0].op_type in FUSED_ACTIVATIONS}


def input_layout(model) -> str:
    """NCHW or NHWC: the layout of the model's image input (3 channels)."""
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return "NCHW" if len(dims) == 4 and dims[1] == 3 else "NHWC"


# ------------------------------------------------------------------------------------------------ scales


def full_tensor_scales(qat_scales: dict[str, float], absmax: dict[str, float]) -> dict[str, float]:
    """A scale for every tensor of `absmax` (those of the DLA form, with their calibrated |range|): the QAT
    model's where it has one, else |range| / 127 (a tensor that was always zero: a tiny positive scale)."""
    return {name: qat_scales.get(name, max(value, 1e-12) / INT8_MAX) for name, value in absmax.items()}


# ------------------------------------------------------------------------------------------------ placement


@dataclass(frozen=True)
class DlaRule:
    """One DLA restriction of TensorRT 10 on Orin: `why(node, shapes)` says why the node's layer cannot run
    on DLA, or None when this rule lets it."""

    name: str
    ops: tuple[str, ...]
    why: Callable[[object, dict], str | None]


def _in_range(label: str, values, low: int, high: int) -> str | None:
    bad = [int(v) for v in values if not low <= int(v) <= high]
    return f"{label} {bad} outside DLA's [{low}, {high}]" if bad else None


def _convolution(node, shapes) -> str | None:
    weight = shapes.get(node.input[1], [0, 0, 1, 1])
    kernel = attribute(node, "kernel_shape") or weight[2:]
    return (_in_range("kernel", kernel, 1, 32) or _in_range("stride", attribute(node, "strides") or [1, 1], 1, 8)
            or _in_range("padding", attribute(node, "pads") or [0] * 4, 0, 31)
            or _in_range("dilation", attribute(node, "dilations") or [1, 1], 1, 32)
            or _in_range("groups", [attribute(node, "group", 1)], 1, 8192)
            or _in_range("output channels", weight[:1], 1, 8192))


def _activation(node, shapes) -> str | None:
    if node.op_type != "Clip":
        return None
    bounds = [shapes.get(f"value:{name}") for name in node.input[1:3]]
    low, high = (bound[0] if bound else None for bound in (bounds + [None, None])[:2])
    if low not in (0.0, None) or high is None or high > 127:
        return f"a clip to [{low}, {high}]: DLA clips only from 0 to at most 127 (a clipped ReLU)"
    return None


def _pooling(node, shapes) -> str | None:
    return (_in_range("window", attribute(node, "kernel_shape") or [], 1, 8)
            or _in_range("stride", attribute(node, "strides") or [1, 1], 1, 16)
            or _in_range("padding", attribute(node, "pads") or [0] * 4, 0, 7))


def _reduce_average(node, shapes) -> str | None:
    return (f"{node.op_type} becomes a Reduce (average) in TensorRT's ONNX parser, and DLA reduces with max only "
            f"(a global average pool over more than 8x8 is no DLA pooling either)")


def _elementwise(node, shapes) -> str | None:
    operands = [shapes[name] for name in node.input if name in shapes]
    if any(len(shape) != 4 for shape in operands):
        return "an element-wise layer on DLA takes 4-D tensors"
    if any(shape != operands[0] for shape in operands[1:]):
        return (f"a broadcast ({' against '.join(str(s) for s in operands)}): DLA documents element-wise layers "
                f"on equal shapes (TensorRT may still fold a constant per-channel operand into a Scale layer)")
    return None


def _transpose(node, shapes) -> str | None:
    return "a transpose (a Shuffle with a permutation): not among the shuffles DLA documents; runs on the GPU"


def _concat(node, shapes) -> str | None:
    rank = len(shapes.get(node.output[0], [0] * 4))
    return None if attribute(node, "axis") in (1, 1 - rank) else "DLA concatenates along the channel axis only"


def _unsupported(node, shapes) -> str | None:
    return f"{node.op_type} has no DLA layer"


# element-wise ops whose INT8 inputs DLA wants in one range (equal_ranges); Mul is element-wise without that need
EQUAL_RANGE_OPS = ("Add", "Sub", "Max", "Min")

# TensorRT 10.3 on Orin: the DLA layer restrictions page, and NvInfer.h's DLA notes where the page is silent. The
# weighted layers' ops come from the weighted-kind table (quantization/kinds.py)
DLA_RULES: tuple[DlaRule, ...] = (
    DlaRule("convolution", onnx_ops_of("Conv2D", "DepthwiseConv2D"), _convolution),
    DlaRule("fully-connected", onnx_ops_of("Dense"), lambda node, shapes: None),
    DlaRule("activation", ("Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu"), _activation),
    DlaRule("scale", ("BatchNormalization",), lambda node, shapes: None),
    DlaRule("pooling", ("MaxPool", "AveragePool"), _pooling),
    DlaRule("reduce-average", ("GlobalAveragePool", "ReduceMean"), _reduce_average),
    DlaRule("element-wise", (*EQUAL_RANGE_OPS, "Mul"), _elementwise),
    DlaRule("concatenation", ("Concat",), _concat),
    DlaRule("shuffle", ("Transpose",), _transpose),
    DlaRule("identity", ("Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"), lambda node, shapes: None),
)
_RULE_OF = {op: rule for rule in DLA_RULES for op in rule.ops}
_FALLBACK = DlaRule("unsupported", (), _unsupported)


@dataclass(frozen=True)
class Placement:
    node: str
    op: str
    device: str  # DLA or GPU
    rule: str
    why: str = ""


def _shapes(model) -> dict[str, list[int]]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        shapes[info.name] = [d.dim_value for d in info.type.tensor_type.shape.dim]
    for init in inferred.graph.initializer:
        shapes[init.name] = list(init.dims)
        if init.dims in ([], [1]):  # scalar constants (a Clip's bounds) by value
            from onnx import numpy_helper

            shapes[f"value:{init.name}"] = [float(numpy_helper.to_array(init).reshape(-1)[0])]
    return shapes


def dla_placement(model) -> list[Placement]:
    """Per node of the DLA form, in graph order: DLA, or the GPU (TensorRT's GPU fallback) and why."""
    shapes = _shapes(model)
    placements = []
    for node in model.graph.node:
        rule = _RULE_OF.get(node.op_type, _FALLBACK)
        why = rule.why(node, shapes)
        placements.append(Placement(node.name or node.output[0], node.op_type, "GPU" if why else "DLA", rule.name,
                                    why or ""))
    return placements


def equal_ranges(model, placements: list[Placement], scales: dict[str, float]) -> int:
    """DLA's INT8 element-wise layers take inputs of one range, and its pooling keeps its input's range
    (NvInfer.h's DLA notes): each such group of tensors gets the largest scale among them, in place. Returns
    how many scales were raised."""
    rule_on_dla = {p.node: p.rule for p in placements if p.device == "DLA"}
    raised = 0
    for node in model.graph.node:
        rule = rule_on_dla.get(node.name or node.output[0])
        if rule is None:
            continue
        if node.op_type in EQUAL_RANGE_OPS:
            group = [name for name in node.input if name in scales]
        elif rule == "pooling":
            group = [name for name in (node.input[0], node.output[0]) if name in scales]
        else:
            continue
        top = max((scales[name] for name in group), default=0.0)
        for name in group:
            if scales[name] < top:
                scales[name], raised = top, raised + 1
    return raised


def tensors_needing_scales(model, placements: list[Placement]) -> set[str]:
    """The float tensors a DLA layer reads or writes (weights excluded, and a convolution's output inside its
    fused activation): each needs a scale for INT8."""
    on_dla = {p.node for p in placements if p.device == "DLA"}
    weights = {init.name for init in model.graph.initializer} | fused_interiors(model)
    needed = set()
    for node in model.graph.node:
        if (node.name or node.output[0]) in on_dla:
            needed.update(name for name in [*node.input, *node.output] if name and name not in weights)
    return needed


def fake_quantized(model, scales: dict[str, float]):
    """A copy of `model` with a QuantizeLinear -> DequantizeLinear pair (symmetric int8) on every tensor that
    has a scale: what INT8 everywhere does to its numbers, for ONNX Runtime to score (the DLA form's accuracy)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    input_name = graph.input[0].name
    producer = {out: node for node in graph.node for out in node.output}
    pairs = []
    for name in sorted(scales):
        if name == input_name:  # the input keeps its name: its consumers read the quantized copy
            source, target = name, f"{name}__dla_fq"
            for node in graph.node:
                node.input[:] = [target if i == name else i for i in node.input]
        elif name in producer:  # the producer writes a raw tensor; the pair restores the name
            node = producer[name]
            source, target = f"{name}__dla_raw", name
            node.output[:] = [source if o == name else o for o in node.output]
        else:
            continue
        graph.initializer.extend([numpy_helper.from_array(np.array(scales[name], np.float32), f"{name}__dla_s"),
                                  numpy_helper.from_array(np.array(0, np.int8), f"{name}__dla_z")])
        pairs += [helper.make_node("QuantizeLinear", [source, f"{name}__dla_s", f"{name}__dla_z"], [f"{name}__dla_q"]),
                  helper.make_node("DequantizeLinear", [f"{name}__dla_q", f"{name}__dla_s", f"{name}__dla_z"],
                                   [target])]
    graph.node.extend(pairs)
    from qatpipe.graph.onnx_graph import sort_topologically

    sort_topologically(graph)
    return model


# ------------------------------------------------------------------------------------------------ report


def report_markdown(report: dict) -> str:
    lines = [f"# DLA export: {report['onnx']}", "",
             f"TensorRT 10 on Orin's DLA (core from `engine.dla_core`, GPU fallback `engine.gpu_fallback`), batch "
             f"{report['batch']} (DLA has no dynamic shapes), input {report['input_layout']}.", "",
             f"- layers on DLA: {report['on_dla']}; on the GPU (fallback): {report['on_gpu']}",
             f"- calibration cache `{Path(report['cache']).name}`: {report['scales']} tensors "
             f"({report['qat_scales']} from the QAT model, {report['calibrated_scales']} calibrated on "
             f"{report['calibration_images']} training images, {report['calibration_method']}); "
             f"{report['scales_raised_to_equal_ranges']} raised so that each DLA element-wise layer's inputs, and "
             f"each pooling's input and output, share one range", ""]
    fallback = [p for p in report["placement"] if p["device"] == "GPU"]
    if fallback:
        lines += ["## Layers TensorRT runs on the GPU, and why", "", "| node | op | rule | why |", "|---|---|---|---|"]
        lines += [f"| {p['node']} | {p['op']} | {p['rule']} | {p['why']} |" for p in fallback]
    else:
        lines += ["Every layer runs on DLA."]
    return "\n".join(lines) + "\n"


def write_dla_export(export_onnx: str | Path, implicit_onnx: str | Path, qat_scales: dict[str, float],
                     batches: Iterable[np.ndarray], batch: int, trt_version: int, images: int,
                     method: str = "percentile") -> dict:
    """Write the DLA form of the implicit graph at `implicit_onnx`, its full-tensor calibration cache
    (calibrated on `batches`, NHWC images, by `method`) and dla_report.json/.md beside `export_onnx` (their names:
    ExportBundle); returns the report. Fails when a tensor a DLA layer reads or writes is left without a scale."""
    from qatpipe.export.bundle import ExportBundle
    from qatpipe.export.onnx_export import save_onnx
    from qatpipe.export.qdq import calibration_cache_text
    from qatpipe.fileio import atomic_write_text, write_json
    from qatpipe.onnx_model import load_onnx_proto
    from qatpipe.quantization.ptq import tensor_amax

    bundle = ExportBundle(export_onnx)
    onnx_path, cache_path = bundle.dla, bundle.dla_cache
    model = dla_form(load_onnx_proto(implicit_onnx), batch)
    save_onnx(model, onnx_path)
    # the implicit graph computes every tensor of the DLA form under the same name (BN folded onto its output)
    present = {name for node in model.graph.node for name in [*node.input, *node.output]}
    interiors, weights = fused_interiors(model), {init.name for init in model.graph.initializer}
    absmax = {name: value for name, value in tensor_amax(implicit_onnx, batches, method).items()
              if name in present and name not in interiors and name not in weights}
    scales = full_tensor_scales(qat_scales, absmax)
    placements = dla_placement(model)
    raised = equal_ranges(model, placements, scales)
    missing = sorted(tensors_needing_scales(model, placements) - set(scales))
    if missing:
        raise QatpipeError(f"{onnx_path}: no INT8 scale for {len(missing)} tensors DLA layers use: "
                           f"{', '.join(missing[:5])}")
    atomic_write_text(cache_path, calibration_cache_text(scales, trt_version))
    report = {"onnx": str(onnx_path), "cache": str(cache_path), "batch": batch,
              "input_layout": input_layout(model), "scales": len(scales),
              "qat_scales": sum(name in qat_scales for name in scales),
              "calibrated_scales": sum(name not in qat_scales for name in scales), "calibration_images": images,
              "calibration_method": method,
              "scales_raised_to_equal_ranges": raised,
              "on_dla": sum(p.device == "DLA" for p in placements),
              "on_gpu": sum(p.device == "GPU" for p in placements),
              "placement": [asdict(p) for p in placements]}
    write_json(bundle.dla_report, report)
    atomic_write_text(bundle.dla_report_markdown, report_markdown(report))
    log.info("DLA form %s (batch %d): %d layers on DLA, %d on the GPU; cache %s with %d scales", onnx_path.name,
             batch, report["on_dla"], report["on_gpu"], cache_path.name, len(scales))
    return report


__all__ = ["DLA_RULES", "DlaRule", "Placement", "dla_form", "dla_placement", "equal_ranges", "fake_quantized",
           "full_tensor_scales", "fused_interiors", "input_layout", "tensors_needing_scales", "write_dla_export"]
