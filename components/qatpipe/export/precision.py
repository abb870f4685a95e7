"""Where a detector's float tensors can live in FP16, and where a deployed model first parts from its FP32 form.

- `record_ranges`: every float tensor's range over calibration images (ONNX Runtime, each intermediate tensor
  made a graph output): its largest magnitude, and the share of its non-zero values that FP16 would flush
  to zero (below 2^-24) or keep only as subnormals (below 2^-14, fewer significant bits).
- `fp16_flags`: the tensors that must stay FP32: those whose largest magnitude exceeds FP16's 65,504 (with
  a safety margin, since unseen images go further) or that FP16 would flush in large part. A TensorRT 11
  engine computes FP16 only where the ONNX casts to it, so these flags are what an FP16 graph must leave out.
- `compare_layers`: a deployed ONNX (PTQ, FP16) against the FP32 ONNX it came from, tensor by tensor in graph
  order: the largest and mean absolute error relative to the FP32 tensor's range, and the first tensor where
  the error jumps (Polygraphy's layer-by-layer bisection, in one pass).
- `precision_report` / `report_markdown`: both, as the JSON and markdown the pipeline shows.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.graph.onnx_graph import tensor_types
from qatpipe.onnx_model import load_onnx_proto
from qatpipe.quantization.kinds import WEIGHTED_ONNX_OPS

log = logging.getLogger(__name__)

FP16_MAX = 65504.0
FP16_TINIEST = 2.0 ** -24  # the smallest subnormal: anything smaller becomes 0
FP16_SMALLEST_NORMAL = 2.0 ** -14  # below this, fewer than 11 significant bits
OVERFLOW_MARGIN = 0.5  # flag a tensor whose calibration maximum passes half of FP16_MAX
FLUSH_SHARE = 0.01  # flag a tensor FP16 would zero 1% of the non-zero values of
JSON_FILE, MARKDOWN_FILE = "precision_report.json", "precision_report.md"  # written beside the model
JUMP_FACTOR = 10.0  # the first tensor whose relative error is this many times its inputs' is "where it parts"


@dataclass
class TensorRange:
    name: str
    op: str  # the producing node's op type
    node: str  # the producing node's name
    absmax: float
    flushed_share: float  # of the non-zero values: |x| < 2^-24, zero in FP16
    subnormal_share: float  # of the non-zero values: |x| < 2^-14, FP16 subnormals


def _float_tensors(model) -> list[tuple[str, str, str, int]]:
    """(tensor, producer op, producer name, element type) for every float32 or float16 tensor a node produces,
    in graph order."""
    import onnx

    types = tensor_types(model)
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    return [(out, node.op_type, node.name or out, types[out]) for node in model.graph.node for out in node.output
            if out and types.get(out) in floats]


def _session_with_every_tensor(onnx_path: str | Path):
    """An ORT session whose outputs are all float tensors of the graph (optimisations off: a fused graph would
    not have them); returns (session, [(tensor, op, node)])."""
    import onnx
    import onnxruntime as ort

    model = load_onnx_proto(onnx_path)
    typed = _float_tensors(model)
    tensors = [(name, op, node) for name, op, node, _ in typed]
    present = {o.name for o in model.graph.output}
    for name, _, _, elem_type in typed:
        if name not in present:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_type, None))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise QatpipeError(f"{onnx_path}: cannot run it with every tensor exposed: {type(exc).__name__}: {exc}") \
            from None
    return session, tensors


def _run(session, batch: np.ndarray, names: list[str]) -> dict[str, np.ndarray]:
    feed = {session.get_inputs()[0].name: np.asarray(batch, np.float32)}
    return dict(zip(names, session.run(names, feed)))


def record_ranges(onnx_path: str | Path, batches: Iterable[np.ndarray]) -> list[TensorRange]:
    """Each float tensor's range over `batches` (NHWC float32, as the model takes them), in graph order."""
    session, tensors = _session_with_every_tensor(onnx_path)
    names = [name for name, _, _ in tensors]
    absmax = dict.fromkeys(names, 0.0)
    counts = {name: np.zeros(3, np.int64) for name in names}  # non-zero, flushed, subnormal
    images = 0
    for batch in batches:
        images += len(batch)
        for name, value in _run(session, batch, names).items():
            magnitude = np.abs(value[np.isfinite(value)])
            absmax[name] = max(absmax[name], float(magnitude.max(initial=0.0)))
            nonzero = magnitude[magnitude > 0]
            counts[name] += (nonzero.size, int((nonzero < FP16_TINIEST).sum()),
                             int((nonzero < FP16_SMALLEST_NORMAL).sum()))
    if not images:
        raise QatpipeError("precision ranges: no calibration images")
    ranges = []
    for name, op, node in tensors:
        nonzero, flushed, subnormal = counts[name]
        ranges.append(TensorRange(name, op, node, absmax[name], flushed / max(nonzero, 1),
                                  subnormal / max(nonzero, 1)))
    log.info("precision: ranges of %d float tensors over %d images", len(ranges), images)
    return ranges


def fp16_flags(ranges: list[TensorRange], margin: float = OVERFLOW_MARGIN,
               flush_share: float = FLUSH_SHARE) -> dict[str, str]:
    """{tensor: why} for every tensor that must stay FP32."""
    flags = {}
    for r in ranges:
        if r.absmax > margin * FP16_MAX:
            flags[r.name] = (f"overflow: reaches {r.absmax:.4g} on the calibration images, beyond "
                             f"{margin:g} x FP16's {FP16_MAX:g}")
        elif r.flushed_share > flush_share:
            flags[r.name] = f"underflow: FP16 would zero {100 * r.flushed_share:.1f}% of its non-zero values"
    return flags


def compare_layers(reference_onnx: str | Path, deployed_onnx: str | Path,
                   batches: Iterable[np.ndarray]) -> dict:
    """The deployed model's tensors against the reference's of the same name, in the reference's graph order
    (the deployed model must be derived from the reference: a retrained twin shares names but not weights):
    per tensor the max and mean absolute error divided by the reference tensor's largest magnitude, and the
    first tensor where that error jumps (JUMP_FACTOR times the largest error before it, and above 1%)."""
    ref_session, ref_tensors = _session_with_every_tensor(reference_onnx)
    dep_session, dep_tensors = _session_with_every_tensor(deployed_onnx)
    deployed = {name for name, _, _ in dep_tensors}
    shared = [(n, op, node) for n, op, node in ref_tensors if n in deployed]
    if not shared:
        raise QatpipeError(f"{deployed_onnx}: no tensor name in common with {reference_onnx}; a layer-by-layer "
                           "comparison needs a model derived from it (PTQ, FP16), not a retrained one")
    names = [n for n, _, _ in shared]
    worst = dict.fromkeys(names, 0.0)
    total = dict.fromkeys(names, 0.0)
    scale = dict.fromkeys(names, 0.0)
    elements = dict.fromkeys(names, 0)
    for batch in batches:
        ref = _run(ref_session, batch, names)
        dep = _run(dep_session, batch, names)
        for name in names:
            error = np.abs(dep[name].astype(np.float64) - ref[name])  # an FP16 form's tensors: as float64
            worst[name] = max(worst[name], float(error.max(initial=0.0)))
            total[name] += float(error.sum())
            elements[name] += error.size
            scale[name] = max(scale[name], float(np.abs(ref[name]).max(initial=0.0)))
    rows, first_jump, so_far = [], None, 0.0
    for name, op, node in shared:
        s = scale[name] or 1.0
        row = {"tensor": name, "op": op, "node": node, "max_error": worst[name] / s,
               "mean_error": total[name] / max(elements[name], 1) / s}
        if first_jump is None and row["max_error"] > 0.01 and row["max_error"] > JUMP_FACTOR * max(so_far, 1e-6):
            first_jump = row
        so_far = max(so_far, row["max_error"])
        rows.append(row)
    return {"tensors": rows, "first_jump": first_jump, "compared": len(rows),
            "worst": max(rows, key=lambda r: r["max_error"])}


def precision_report(fp32_onnx: str | Path, batches: list[np.ndarray],
                     deployed_onnx: str | Path | None = None) -> dict:
    """The FP16 ranges and flags of the FP32 model, and (with `deployed_onnx`) its layer-by-layer comparison."""
    ranges = record_ranges(fp32_onnx, batches)
    flags = fp16_flags(ranges)
    report = {"fp16_max": FP16_MAX, "overflow_margin": OVERFLOW_MARGIN, "flush_share": FLUSH_SHARE,
              "images": int(sum(len(b) for b in batches)), "tensors": len(ranges),
              "fp16_flags": [{**asdict(r), "why": flags[r.name]} for r in ranges if r.name in flags],
              "largest": [asdict(r) for r in sorted(ranges, key=lambda r: -r.absmax)[:10]]}
    if deployed_onnx is not None:
        report["layers"] = compare_layers(fp32_onnx, deployed_onnx, batches)
    return report


def report_markdown(report: dict) -> str:
    """The report as markdown, for the KFP UI and MLflow."""
    lines = ["# Precision report", "",
             f"{report['tensors']} float tensors over {report['images']} calibration images. FP16 keeps values up "
             f"to {report['fp16_max']:g}; a tensor is kept FP32 when it passes {report['overflow_margin']:g} x that, "
             f"or when FP16 would zero more than {100 * report['flush_share']:g}% of its non-zero values.", ""]
    if report["fp16_flags"]:
        lines += ["## Tensors that must stay FP32", "", "| tensor | op | node | largest value | why |",
                  "|---|---|---|---|---|"]
        lines += [f"| `{f['name']}` | {f['op']} | `{f['node']}` | {f['absmax']:.4g} | {f['why']} |"
                  for f in report["fp16_flags"]]
    else:
        lines += ["No tensor needs FP32: every one fits FP16 on these images."]
    lines += ["", "## Largest tensors", "", "| tensor | op | largest value | zeroed in FP16 |", "|---|---|---|---|"]
    lines += [f"| `{r['name']}` | {r['op']} | {r['absmax']:.4g} | {100 * r['flushed_share']:.2f}% |"
              for r in report["largest"]]
    form = report.get("fp16_form")
    if form:
        reasons = ", ".join(f"{why} {count}" for why, count in form["fp32_reasons"].items()) or "none"
        lines += ["", "## FP16 form", "",
                  f"{form['fp16_nodes']} nodes compute in FP16, {form['fp32_nodes']} stay FP32 ({reasons}); "
                  f"{form['casts']} casts, inputs and outputs float32."]
    layers = report.get("layers")
    if layers:
        jump = layers["first_jump"]
        lines += ["", "## Layer by layer against the float32 model", "",
                  f"{layers['compared']} tensors compared (error relative to the FP32 tensor's largest value). "
                  + (f"The error first jumps at `{jump['tensor']}` ({jump['op']}, node `{jump['node']}`): "
                     f"max {jump['max_error']:.3g}." if jump else "No tensor's error jumps."),
                  f"Worst: `{layers['worst']['tensor']}`, max {layers['worst']['max_error']:.3g}, mean "
                  f"{layers['worst']['mean_error']:.3g}."]
    return "\n".join(lines) + "\n"


COMPUTE_OPS = WEIGHTED_ONNX_OPS  # the ops a weighted kind (quantization/kinds.py) becomes


def layer_precision(onnx_path: str | Path) -> dict[str, int]:
    """How many compute layers (COMPUTE_OPS: Conv, MatMul, Gemm) the ONNX runs in each precision, as a strongly typed
    TensorRT engine reads it: int8 where both the data and the weight come through DequantizeLinear, fp16
    where the data is float16 (an explicit cast), fp32 elsewhere."""
    import onnx

    model = load_onnx_proto(onnx_path)
    types = tensor_types(model, initializers=True)
    producers = {out: node.op_type for node in model.graph.node for out in node.output}
    counts = {"int8": 0, "fp16": 0, "fp32": 0}
    for node in model.graph.node:
        if node.op_type not in COMPUTE_OPS or len(node.input) < 2:
            continue
        data, weight = node.input[0], node.input[1]
        if producers.get(data) == producers.get(weight) == "DequantizeLinear":
            counts["int8"] += 1
        elif types.get(data) == onnx.TensorProto.FLOAT16:
            counts["fp16"] += 1
        else:
            counts["fp32"] += 1
    return counts


def write_report(report: dict, folder: str | Path) -> tuple[Path, Path]:
    """precision_report.json and precision_report.md in `folder`."""
    from qatpipe.fileio import write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / JSON_FILE, report)
    (folder / MARKDOWN_FILE).write_text(report_markdown(report), encoding="utf-8")
    return folder / JSON_FILE, folder / MARKDOWN_FILE
