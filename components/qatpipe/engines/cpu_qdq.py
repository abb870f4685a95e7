"""ONNX Runtime CPU form of a TensorRT Q/DQ model: the same numbers, activations as uint8.

TensorRT wants symmetric int8 activations (zero point 0). ONNX Runtime's CPU provider fuses
DQ → Conv → (Relu) → Q into QLinearConv only for some of those nodes when the activations are int8, and
runs the rest as float convolutions between Q/DQ pairs: slower than FP32. Shifting every activation
Q/DQ pair to uint8 with zero point 128 represents exactly the same values (q_u8 = q_i8 + 128 over the same
scale, and int8 saturation [-128, 127] becomes [0, 255]), and ORT fuses all of them. Weights stay int8.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

LAYOUT_OPS = ("Transpose", "Reshape", "Identity", "MaxPool")  # ops ORT runs on quantised tensors unchanged


def activations_to_uint8(model) -> int:
    """Rewrite `model` in place; returns the number of activation Q/DQ chains shifted to uint8."""
    from onnx import TensorProto, numpy_helper

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    shifted = 0
    changed_tensors = set()
    for node in list(graph.node):
        if node.op_type != "QuantizeLinear" or node.input[0] in inits:
            continue  # weights (initializers) stay int8
        zero_point = numpy_helper.to_array(inits[node.input[2]])
        if zero_point.dtype != np.int8 or zero_point.any():
            continue
        new_zp = f"{node.output[0]}_zero_point_u8"
        graph.initializer.append(numpy_helper.from_array(np.full(zero_point.shape, 128, np.uint8), new_zp))
        node.input[2] = new_zp
        # follow the quantised tensor through layout ops to every DequantizeLinear that reads it
        frontier = [node.output[0]]
        while frontier:
            tensor = frontier.pop()
            changed_tensors.add(tensor)
            for consumer in consumers[tensor]:
                if consumer.op_type == "DequantizeLinear":
                    consumer.input[2] = new_zp
                elif consumer.op_type in LAYOUT_OPS:
                    frontier.extend(consumer.output)
                else:
                    raise ValueError(f"{consumer.name}: reads the int8 tensor {tensor} directly; cannot shift it")
        shifted += 1
    for info in list(graph.value_info):  # stale int8 type annotations; ORT re-infers them
        if info.name in changed_tensors:
            graph.value_info.remove(info)
    return shifted
