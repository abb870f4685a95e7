"""Post-training quantization with ONNX Runtime: an FP32 ONNX -> an explicit-quantization (Q/DQ) ONNX with
symmetric int8 activations (zero point 0) and per-channel symmetric int8 weights, which TensorRT builds as
a strongly typed INT8 engine and ONNX Runtime runs on CPU."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.graph.onnx_graph import attribute, drop_unused_initializers, graph_maps
from qatpipe.fileio import temp_path
from qatpipe.onnx_model import load_onnx_proto
from qatpipe.quantization.kinds import (INPUT_QUANTIZED_ONNX_OPS, MULTIPLY_ONNX_OP, RESIDUAL_ADD_ONNX_OP,
                                       WEIGHTED_ONNX_OPS)
from qatpipe.spec import PtqSpec, field_default

log = logging.getLogger(__name__)

METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}
# what ORT quantizes: the inputs of the ops of every kind the QAT rules quantize (kinds.py: the weighted kinds, the
# residual Add, the squeeze-excitation Mul, average pooling); products that are no Keras Multiply stay float
# (float_products), and so do the other readers of a quantized tensor (float_reads_stay_float). Outputs stay
# float (OpTypesToExcludeOutputQuantization): by default ORT also requantizes every output, a Q/DQ that neither
# the QAT model nor TensorRT's fusions have, read by the ReLU after each convolution and by the SSD heads'
# reshapes; most of PTQ's measured losses came from it (bench/README.md, bench/ptq_tools.py).
OP_TYPES = [*WEIGHTED_ONNX_OPS, *INPUT_QUANTIZED_ONNX_OPS]
HISTOGRAM_BINS = 2048  # TensorRT's entropy calibrator's histogram
# Levels of the quantized distribution the entropy search compares with: ORT's default, TensorRT's 128. On ORT's
# histogram, symmetric about zero, 255 (all of int8's) made every window under 510 bins an exact copy of the
# data, so only the clipped tail counted and a ReLU output's range fell to the smallest window, 1/8 of its
# maximum (measured: the tiny test model's mAP@0.5 fell from 0.24 to 0.08). quantize_static itself passes no
# bin counts to its calibrator, whose defaults (128 bins) leave one candidate, the maximum: entropy then
# computed minmax's ranges (measured under ORT 1.31).
QUANTIZED_BINS = 128


def entropy_threshold(histogram: tuple, levels: int = QUANTIZED_BINS) -> tuple:
    """The (low, high) range of one tensor by TensorRT's entropy method, exactly as ONNX Runtime's
    HistogramCollector.get_entropy_threshold computes it from the same histogram (hist, edges, min, max, ...):
    for each symmetric window of the histogram, the KL divergence between the clipped distribution and its
    `levels`-level quantized version; the window of least divergence wins. ORT loops in Python over every bin
    of every window (1 s per tensor at 2048 bins, 2.7 s at 4096); this does each window's work in whole-array
    numpy (tests/test_export.py checks it gives ORT's thresholds)."""
    from onnxruntime.quantization.quant_utils import smooth_distribution
    from scipy.special import rel_entr

    hist, edges, low, high = histogram[:4]
    n = hist.size
    zero, half = n // 2, levels // 2
    before = np.concatenate([[0], np.cumsum(hist)])  # before[k]: counts in bins < k
    total = before[-1]
    best, best_window = np.inf, None
    for i in range(half, zero + 1):
        start, end = zero - i, min(zero + i + 1, n)
        sliced = hist[start:end]
        p = sliced.astype(np.int64)
        p[0] += before[start]  # the clipped outliers go to the edge bins
        p[-1] += total - before[end]
        merged = sliced.size // levels
        body = levels * merged
        quantized = sliced[:body].reshape(levels, merged).sum(axis=1)
        quantized[-1] += sliced[body:].sum()
        nonzeros = (p[:body] != 0).reshape(levels, merged).sum(axis=1)
        q = np.zeros(p.size, dtype=np.int64)  # int64 as in ORT: each level's share is truncated
        q[:body] = np.repeat(np.where(nonzeros > 0, quantized / np.maximum(nonzeros, 1), 0), merged)
        p_smooth, q_smooth = smooth_distribution(p), smooth_distribution(q)
        # scipy.stats.entropy(p, q) without its per-call overhead (0.6 ms, most of the time here)
        divergence = np.inf if p_smooth is None or q_smooth is None else np.sum(
            rel_entr(p_smooth / np.sum(p_smooth), q_smooth / np.sum(q_smooth)))
        if divergence < best or best_window is None:  # the first minimum, as np.argmin takes it
            best, best_window = divergence, (edges[start], edges[end])
    lo, hi = best_window
    return (low if lo < low else lo), (high if hi > high else hi)


def entropy_ranges(calibrator, levels: int = QUANTIZED_BINS):
    """The TensorsData of an entropy calibrator that has collected its histograms (entropy_threshold per
    tensor), in the form quantize_static reads from a calibration cache."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import TensorsData

    histograms = calibrator.collector.histogram_dict
    return TensorsData(CalibrationMethod.Entropy,
                       {name: (*entropy_threshold(h, levels), *h[:2]) for name, h in histograms.items()})


def calibrator_options(method: str, percentile: float) -> dict:
    """The options of ORT's calibrator for `method` (create_calibrator's extra_options)."""
    if method == "entropy":
        return {"num_bins": HISTOGRAM_BINS, "num_quantized_bins": QUANTIZED_BINS}
    if method == "percentile":
        return {"num_bins": HISTOGRAM_BINS, "percentile": percentile, "symmetric": True}
    return {}


class BatchReader:
    """ONNX Runtime's CalibrationDataReader over NHWC float32 batches, one image per read: ORT's histogram
    calibrators stack the reads' outputs and fail on a short last batch."""

    def __init__(self, input_name: str, batches: Iterable[np.ndarray]):
        self.input_name = input_name
        self._images: Iterator[np.ndarray] = (image for batch in batches for image in np.asarray(batch, np.float32))
        self.images = 0

    def get_next(self):
        image = next(self._images, None)
        if image is None:
            return None
        self.images += 1
        return {self.input_name: image[None]}


def calibrated_ranges(onnx_path: str | Path, op_types: list[str], batches: Iterable[np.ndarray], method: str,
                      percentile: float, work: str | Path):
    """(ORT's TensorsData, images read): the ranges `method` calibrates on `batches` for the tensors of the
    `op_types` nodes of `onnx_path`, with the bin counts each method needs (calibrator_options); `work` holds
    the calibrator's augmented model."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    if method not in METHODS:
        raise QatpipeError(f"unknown calibration method {method!r}: one of {', '.join(METHODS)}")
    import onnx  # not load_onnx_proto: quantize_ptq calibrates its pre-processed copy, a .part file

    reader = BatchReader(onnx.load(str(onnx_path)).graph.input[0].name, batches)
    calibrator = create_calibrator(Path(onnx_path), op_types, augmented_model_path=str(Path(work) / "augmented.onnx"),
                                   calibrate_method=getattr(CalibrationMethod, METHODS[method]),
                                   extra_options=calibrator_options(method, percentile))
    calibrator.collect_data(reader)
    if reader.images == 0:
        raise QatpipeError("post-training quantization got no calibration images")
    return (entropy_ranges(calibrator) if method == "entropy" else calibrator.compute_data()), reader.images


def tensor_amax(fp32_onnx: str | Path, batches: Iterable[np.ndarray], method: str,
                percentile: float = field_default(PtqSpec, "percentile")) -> dict[str, float]:
    """max(|low|, |high|) of the range `method` calibrates (as quantize_ptq does) for every tensor the nodes of
    `fp32_onnx` read or write, over `batches`."""
    import tempfile

    op_types = sorted({node.op_type for node in load_onnx_proto(fp32_onnx).graph.node})
    with tempfile.TemporaryDirectory(prefix="qatpipe-calibrate-") as work:
        data, _ = calibrated_ranges(fp32_onnx, op_types, batches, method, percentile, work)
    return {name: float(max(abs(np.asarray(ranges.range_value[0]).ravel()[0]),
                            abs(np.asarray(ranges.range_value[1]).ravel()[0])))
            for name, ranges in data.data.items()}


def float_products(model) -> list[str]:
    """The Mul nodes of `model` that are no Keras Multiply of two activations, which the QAT rules leave float
    (rules.SqueezeExcitationScale quantizes a Multiply, rules.PointwiseActivationsStayFloat an activation): an
    activation's own product (SiLU's x * sigmoid(x), as tf2onnx writes Swish: the Mul and its one-input gate are
    nodes of one layer) and a product with a constant (an initializer or a Constant node's output, as `x * 0.5`
    in a model writes it). Unnamed ones are named here (ORT excludes nodes by name); changes `model` in place."""
    from qatpipe.quantization.qdq_graph import layer_name

    graph = model.graph
    producers, _ = graph_maps(graph)
    constants = {init.name for init in graph.initializer}
    constants |= {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    names = []
    for index, node in enumerate(graph.node):
        if node.op_type != MULTIPLY_ONNX_OP:
            continue
        gates = [producers[name] for name in node.input if name in producers and len(producers[name].input) == 1]
        own_product = any(gate.input[0] in node.input and layer_name(gate.name) == layer_name(node.name)
                          for gate in gates)
        if own_product or any(name in constants for name in node.input):
            node.name = node.name or f"qatpipe_float_mul_{index}"
            names.append(node.name)
    return names


def float_reads_stay_float(model, float_nodes: Iterable[str] = ()) -> int:
    """ONNX Runtime makes every reader of a tensor it quantizes read the DequantizeLinear; the QAT rules quantize
    a tensor only where a quantized layer reads it. The other readers (ops outside OP_TYPES, and the `float_nodes`
    ORT was told to leave alone) read the float tensor again (qdq_graph.bypass, which drops the Q/DQ left
    unread). Returns the reads changed (changes `model` in place)."""
    from qatpipe.quantization.qdq_graph import FloatSources, bypass, dequantized_reads

    float_nodes = set(float_nodes)
    reads = [(node, index) for node, index in dequantized_reads(model)
             if node.op_type not in OP_TYPES or node.name in float_nodes]
    if reads:
        bypass(model, reads, FloatSources(model))
    return len(reads)


def float_fusable_add_inputs(model) -> int:
    """rules.ResidualAddInput on a PTQ model: ONNX Runtime quantizes every input of an Add, the QAT rules all but
    the one a convolution can fuse with (a non-grouped Conv whose output only this Add reads; the first such
    input, as the Keras rule takes it). That input reads the convolution's float output again, where another
    input stays quantized. Returns the Adds changed (changes `model` in place)."""
    graph = model.graph
    producers, consumers = graph_maps(graph)
    changed = 0
    for add in [node for node in graph.node if node.op_type == RESIDUAL_ADD_ONNX_OP]:
        chains = []  # (input index, Q, DQ) of each dequantized input
        for index, name in enumerate(add.input):
            dq = producers.get(name)
            q = producers.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is not None and q.op_type == "QuantizeLinear":
                chains.append((index, q, dq))
        fusable = [(index, q, dq) for index, q, dq in chains
                   if (conv := producers.get(q.input[0])) is not None and conv.op_type == "Conv"
                   and attribute(conv, "group", 1) == 1 and len(consumers[q.input[0]]) == 1
                   and len(consumers[dq.output[0]]) == 1]
        if not fusable or len(chains) < 2:
            continue
        index, q, dq = fusable[0]
        add.input[index] = q.input[0]
        graph.node.remove(q)
        graph.node.remove(dq)
        changed += 1
    drop_unused_initializers(graph)
    return changed


def quantize_ptq(fp32_onnx: str | Path, output: str | Path, batches: Iterable[np.ndarray], method: str,
                 percentile: float = field_default(PtqSpec, "percentile")) -> dict:
    """Calibrate on `batches` by `method` (minmax, entropy, percentile) and write the Q/DQ model. The ranges
    come from ORT's own calibrator, run here with the bin counts each method needs (calibrator_options), and
    reach quantize_static as its calibration cache."""
    import tempfile

    import onnxruntime
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import save_tensors_data
    from onnxruntime.quantization.shape_inference import quant_pre_process

    if method not in METHODS:
        raise QatpipeError(f"unknown calibration method {method!r}: one of {', '.join(METHODS)}")
    fp32_onnx, output = Path(fp32_onnx), Path(output)
    load_onnx_proto(fp32_onnx)  # a missing, mis-named or corrupt model fails here, naming it
    output.parent.mkdir(parents=True, exist_ok=True)
    prepared, tmp = temp_path(output), temp_path(output)
    calibrate_method = getattr(CalibrationMethod, METHODS[method])
    try:
        with tempfile.TemporaryDirectory(prefix="qatpipe-ptq-") as work:
            # shape inference and graph clean-up first, as ORT's quantization guide asks
            quant_pre_process(str(fp32_onnx), str(prepared), skip_symbolic_shape=True)
            import onnx

            prepared_model = onnx.load(str(prepared))
            float_muls = float_products(prepared_model)
            onnx.save(prepared_model, str(prepared))
            data, images = calibrated_ranges(prepared, OP_TYPES, batches, method, percentile, work)
            ranges = Path(work) / "ranges.json"
            save_tensors_data(data, ranges)
            quantize_static(
                str(prepared), str(tmp), None, quant_format=QuantFormat.QDQ, per_channel=True,
                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, op_types_to_quantize=OP_TYPES,
                calibrate_method=calibrate_method, calibration_cache_path=str(ranges), nodes_to_exclude=float_muls,
                # float bias: TensorRT's ONNX parser rejects an int32 bias behind DequantizeLinear
                # ForceQuantizeNoInputCheck: ORT's AveragePool handler quantizes its input only with it
                extra_options={"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False,
                               "OpTypesToExcludeOutputQuantization": OP_TYPES, "ForceQuantizeNoInputCheck": True},
            )
        quantized = onnx.load(str(tmp))
        float_reads = float_reads_stay_float(quantized, float_muls)
        fused = float_fusable_add_inputs(quantized)
        onnx.save(quantized, str(tmp))
        os.replace(tmp, output)
    except QatpipeError:
        raise
    except Exception as exc:
        raise QatpipeError(f"{fp32_onnx}: post-training quantization failed: {type(exc).__name__}: {exc}") from None
    finally:
        prepared.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    log.info("PTQ (%s) calibrated on %d images: %s (%d residual Adds read a convolution's output float, %d products "
             "that are no Multiply layer stay float, %d float reads of a quantized tensor, as the QAT rules place "
             "them)", method, images, output, fused, len(float_muls), float_reads)
    return {"tool": "onnxruntime", "method": method, "calibration_images": images, "onnx": str(output),
            "size_mb": round(output.stat().st_size / 2**20, 3), "versions": {"onnxruntime": onnxruntime.__version__}}
