"""Layer sensitivity of a Q/DQ ONNX (a PTQ model or a QAT export): how much mAP@0.5 each quantizable layer costs.

Each quantizable layer L (qdq_graph.py: a Conv, MatMul or Gemm reading int8 input and weight) is scored (on a
val subset, in ONNX Runtime's exact CPU form of TensorRT's int8: graph/cpu_qdq.py) in two variants of the model
(qdq_graph.variant): only L in INT8, and every layer but L in INT8 (L's output requantization read float too).
Both drops are measured from the model with no Q/DQ at all (`map50_float`): the first is what L's int8 costs on
its own, the second what the whole INT8 model costs while L stays float (compared with the full INT8 model's
drop, what keeping L float would win back: `recovery`). Where there are more layers than `max_layers`, a cheap
screen (`quantization_noise`) picks the noisiest to score. The report: a JSON-ready result, a bar chart and a
Markdown table.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.graph.onnx_graph import RANGE_KEEPING_OPS
from qatpipe.quantization.qdq_graph import (ALL_BUT, ONLY, FloatSources, QuantizedLayer, fp32_weights, node_named,
                                            output_requantization, quantizable_layers, resolve_layers, variant,
                                            weights_of_all_but)

log = logging.getLogger(__name__)


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
        node = node_named(model, layer.node)
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
        w_dq = producers[node_named(model, layer.node).input[1]]
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



__all__ = ["LayerSensitivity", "SensitivityResult", "exact_scorer", "measure", "plot_sensitivity", "quantization_noise",
           "sensitivity_markdown", "sort_layers"]
