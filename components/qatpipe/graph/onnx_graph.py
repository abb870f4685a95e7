"""Small helpers for editing ONNX graphs in place (the Q/DQ passes of quantization/, export/qdq.py, export/dla.py and
graph/cpu_qdq.py).
"""

from __future__ import annotations

from collections import defaultdict

# ops that move or pick values without changing them: their output has the input's range (a tensor they make
# from a quantized one has its scale: tf2onnx puts a Transpose between the model input's Q and DQ, max pooling
# follows ReLU) and its sign (a ReLU output stays non-negative through them)
RANGE_KEEPING_OPS = ("Transpose", "Reshape", "Identity", "Flatten", "MaxPool")


def attribute(node, name: str, default=None):
    """The value of a node attribute, or `default`."""
    from onnx import helper

    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def tensor_types(model, initializers: bool = False) -> dict[str, int]:
    """Tensor name -> ONNX element type (onnx.TensorProto.FLOAT, ...) of the graph's inputs, outputs and node outputs,
    by shape inference; with `initializers`, of its initializers too."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in
             [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    if initializers:
        types.update({i.name: i.data_type for i in model.graph.initializer})
    return types


def graph_maps(graph) -> tuple[dict, dict]:
    """(tensor -> producing node, tensor -> consuming nodes)."""
    producers = {out: node for node in graph.node for out in node.output}
    consumers = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    return producers, consumers


def batch_norm_factor(bn, value):
    """gamma / sqrt(var + epsilon) of BatchNormalization `bn`, and its (mean, beta), as float64; `value(name)`
    gives a constant input's array. A convolution before it folds in as weight * factor and bias
    (bias - mean) * factor + beta."""
    import numpy as np

    gamma, beta, mean, var = (value(name).astype(np.float64) for name in bn.input[1:5])
    return gamma / np.sqrt(var + attribute(bn, "epsilon", 1e-5)), mean, beta


def absorb_batch_norm(graph, conv, bn, bias: str) -> None:
    """`conv` takes BatchNormalization `bn`'s place, with the folded bias initializer `bias`: it writes bn's
    output, and bn leaves the graph (its weights are the caller's to fold)."""
    del conv.input[2:]
    conv.input.append(bias)
    conv.output[0] = bn.output[0]
    graph.node.remove(bn)


def drop_unused_initializers(graph) -> None:
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)


def sort_topologically(graph) -> None:
    """Nodes appended by a pass must come before their consumers (ONNX requires a sorted graph)."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(name in available for name in n.input)]
        if not ready:
            raise ValueError("graph has a cycle or a dangling input")
        for node in ready:
            ordered.append(node)
            available.update(node.output)
            pending.remove(node)
    del graph.node[:]
    graph.node.extend(ordered)
