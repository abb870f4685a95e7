"""The layer kinds QAT quantizes, and the ONNX ops each becomes: the one table the Keras wrappers
(layers.py), the placement rules (rules.py) and the ONNX-side lists (export/qdq.py's check, export/precision.py's
layer count, quantization/ptq.py's op types, export/dla.py's rules) derive from. Free of TensorFlow, so the
ONNX-only stages import it without loading it.

A new weighted kind (Conv2DTranspose, ...) is one row here: its Keras weight and axis, and its ONNX ops with
their weight's output-channel axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WeightedKind:
    """How TensorRT quantizes one weighted layer kind: per output channel of the weight in `weight`."""

    weight: str  # the Keras layer attribute holding the weight
    axis: int  # that weight's output-channel axis
    # the ONNX ops tf2onnx (or ONNX Runtime's fusions) write for it -> their weight's output-channel axis
    onnx_ops: dict[str, int] = field(default_factory=dict)


# Keras class name -> row (layers.py maps the names to the tf_keras classes)
WEIGHTED_KINDS: dict[str, WeightedKind] = {
    "Conv2D": WeightedKind("kernel", 3, {"Conv": 0}),  # HWIO; ONNX OIHW
    # HWCM: with depth_multiplier 1 each input channel is one output channel (rules.py requires 1); ONNX writes a
    # grouped Conv
    "DepthwiseConv2D": WeightedKind("depthwise_kernel", 2, {"Conv": 0}),
    # (in, out); ONNX: MatMul's (K, N), or Gemm's (K, N) (its transB (N, K): axis 0, onnx_weight_axis)
    "Dense": WeightedKind("kernel", 1, {"MatMul": 1, "Gemm": 1}),
}

# every ONNX op a weighted kind becomes, in table order: the compute layers TensorRT runs in int8 when their data
# and weight arrive through DequantizeLinear
WEIGHTED_ONNX_OPS: tuple[str, ...] = tuple(dict.fromkeys(op for row in WEIGHTED_KINDS.values() for op in row.onnx_ops))

# The unweighted layer kinds the rules quantize on their inputs (rules.ResidualAddInput, SqueezeExcitationScale,
# GlobalPoolingInput: Keras class name -> the ONNX ops tf2onnx writes for it): PTQ quantizes the same reads
INPUT_QUANTIZED_KINDS: dict[str, tuple[str, ...]] = {
    "Add": ("Add",), "Multiply": ("Mul",), "GlobalAveragePooling2D": ("GlobalAveragePool",),
    "AveragePooling2D": ("AveragePool",),
}
INPUT_QUANTIZED_ONNX_OPS: tuple[str, ...] = tuple(dict.fromkeys(op for ops in INPUT_QUANTIZED_KINDS.values()
                                                                 for op in ops))
# the merge rules.ResidualAddInput quantizes (a Keras Add), as ONNX writes it
(RESIDUAL_ADD_ONNX_OP,) = INPUT_QUANTIZED_KINDS["Add"]
# the product rules.SqueezeExcitationScale quantizes (a Keras Multiply of two activations)
(MULTIPLY_ONNX_OP,) = INPUT_QUANTIZED_KINDS["Multiply"]


def onnx_ops_of(*kinds: str) -> tuple[str, ...]:
    """The ONNX ops the Keras `kinds` (rows of WEIGHTED_KINDS) become."""
    return tuple(dict.fromkeys(op for kind in kinds for op in WEIGHTED_KINDS[kind].onnx_ops))


def onnx_weight_axis(op_type: str, trans_b: int = 0) -> int:
    """The output-channel axis of the weight of an ONNX op in WEIGHTED_ONNX_OPS (a Gemm with transB reads its
    weight transposed: axis 0)."""
    axis = next(row.onnx_ops[op_type] for row in WEIGHTED_KINDS.values() if op_type in row.onnx_ops)
    return 0 if op_type == "Gemm" and trans_b else axis


__all__ = ["INPUT_QUANTIZED_KINDS", "INPUT_QUANTIZED_ONNX_OPS", "MULTIPLY_ONNX_OP", "RESIDUAL_ADD_ONNX_OP",
           "WEIGHTED_KINDS", "WEIGHTED_ONNX_OPS", "WeightedKind", "onnx_ops_of", "onnx_weight_axis"]
