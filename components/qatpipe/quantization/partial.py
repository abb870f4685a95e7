"""Partial quantization under an accuracy budget: a Q/DQ model with its most sensitive layers kept float.

Starting from the all-INT8 model (a PTQ model), layers are kept float in the order a sensitivity ranking gives,
fewest first, until the model scores within the budget of the FP32 model (NNCF's accuracy-aware quantization
and Model Optimizer's AutoQuantize do the same search for PyTorch / OpenVINO). A layer kept float reads its
input and weight without Q/DQ (qdq_graph.float_layers: the FP32 ONNX's weight where it matches) and its output
stays float up to the next INT8 layer's input quantizer, so TensorRT runs it in the float region: FP16 in the
model's FP16 form (export/fp16.py), FP32 in the exact CPU form.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from qatpipe.errors import QatpipeError

log = logging.getLogger(__name__)

KEEP_FLOAT_KEY = "qatpipe.keep_float"  # ONNX metadata: the layers a partial model keeps float, comma-separated


def ranking(sensitivity: dict) -> list[str]:
    """The layers of a sensitivity.json (quantization/sensitivity.py), in the order to keep them float: the most
    recovered by keeping the layer float first (what NNCF's accuracy-aware search ranks by), then the largest
    drop with only it INT8; then the layers it did not score (sensitivity.max_layers screened them out), the
    noisiest first. Where the loss is spread over many layers (MobileNetV2's PTQ), the scored ones alone may
    not reach the budget (bench/README.md, ptq_partial.py)."""
    rows = sensitivity.get("layers")
    if not isinstance(rows, list):
        raise QatpipeError("the sensitivity report has no `layers` list")
    skipped = sensitivity.get("skipped") or {}
    scored = sorted(rows, key=lambda r: (-r["recovery"], -r["drop_only_int8"], r["node"]))
    return [row["node"] for row in scored] + sorted(skipped, key=lambda node: (-skipped[node], node))


@dataclass
class Step:
    float_layers: list[str]
    map50: float
    map50_all: float | None = None  # on every val image: scored where the sample put the model within the budget


@dataclass
class PartialResult:
    float_layers: list[str]  # ONNX node names kept float, in the order they were added
    map50: float  # the chosen model's score
    map50_fp32: float
    map50_int8: float  # the model with every layer INT8
    target: float  # map50_fp32 - budget
    budget: float
    budget_met: bool
    mode: str  # "auto" or "list"
    layers_total: int  # quantizable layers of the INT8 model
    steps: list[Step] = field(default_factory=list)  # every model scored, fewest float layers first
    seconds: float = 0.0
    # with a confirmation (search's `confirm`): the chosen model and FP32 on every val image, and how many
    map50_all: float | None = None
    map50_fp32_all: float | None = None
    val_images_all: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def keep_float(int8_model, layers: Sequence[str], reference: dict | None = None):
    """`int8_model` (an onnx.ModelProto) with `layers` (node or layer names: qdq_graph.resolve_layers; an
    unknown one fails naming it) reading float; its metadata records them (KEEP_FLOAT_KEY)."""
    import onnx

    from qatpipe.quantization.qdq_graph import float_layers, resolve_layers

    nodes = [layer.node for layer in resolve_layers(int8_model, layers)] if layers else []
    model, _ = float_layers(int8_model, nodes, reference)
    props = {p.key: p.value for p in model.metadata_props}
    props[KEEP_FLOAT_KEY] = ",".join(nodes)
    onnx.helper.set_model_props(model, props)
    return model


@dataclass(frozen=True)
class Confirm:
    """The search's second look, on every val image (the gate's images): `score(onnx.ModelProto) -> mAP@0.5` there,
    FP32's figure there and how many images."""
    score: Callable[[object], float]
    map50_fp32: float
    images: int


def search(int8_model, order: Sequence[str], score: Callable[[object], float], map50_fp32: float, budget: float,
           reference: dict | None = None, confirm: Confirm | None = None) -> tuple[object, PartialResult]:
    """Keep the first k layers of `order` float for k = 0, 1, ... len(order), scoring each model
    with `score(onnx.ModelProto) -> mAP@0.5`, until one scores >= map50_fp32 - budget. With `confirm`, such a model
    is scored on every val image too and chosen only if it is within the budget there as well; else the search goes
    on (a 100-image sample can put within the budget a model that the gate's images do not: bench/README.md,
    `traffic_night`). Returns that model
    (or, where no k meets the budget, the best scoring one on the sample, with a warning naming the budget and the
    best figure) and the search's record."""
    from qatpipe.quantization.qdq_graph import quantizable_layers

    started = time.perf_counter()
    target = map50_fp32 - budget
    target_all = confirm.map50_fp32 - budget if confirm else None
    order = list(order)
    steps: list[Step] = []
    best = None
    met = False
    for k in range(len(order) + 1):
        model = keep_float(int8_model, order[:k], reference)
        steps.append(Step(list(order[:k]), score(model)))
        log.info("partial quantization: %d layer(s) float: mAP@0.5 %.4f (target %.4f)", k, steps[-1].map50, target)
        met = steps[-1].map50 >= target
        if met and confirm:
            steps[-1].map50_all = confirm.score(model)
            met = steps[-1].map50_all >= target_all
            log.log(logging.INFO if met else logging.WARNING, "partial quantization: %d layer(s) float: mAP@0.5 %.4f "
                    "on all %d val images (target %.4f): %s", k, steps[-1].map50_all, confirm.images, target_all,
                    "within the budget" if met else "not within the budget there, going on")
        if met or best is None or steps[-1].map50 > best[1].map50:
            best = (model, steps[-1])
        if met:
            break
    model, chosen = best
    if not met:
        log.warning("partial quantization: no model met the budget (mAP@0.5 >= FP32 %.4f - %.4f = %.4f%s) with up to "
                    "%d layer(s) float; the best, %.4f with %d float, is kept", map50_fp32, budget, target,
                    f", and on all {confirm.images} val images >= {target_all:.4f}" if confirm else "",
                    len(order), chosen.map50, len(chosen.float_layers))
    result = PartialResult(chosen.float_layers, chosen.map50, map50_fp32, steps[0].map50, target, budget, met,
                           "auto", len(quantizable_layers(int8_model)), steps,
                           round(time.perf_counter() - started, 2), chosen.map50_all,
                           confirm.map50_fp32 if confirm else None, confirm.images if confirm else None)
    return model, result


__all__ = ["KEEP_FLOAT_KEY", "Confirm", "PartialResult", "Step", "keep_float", "ranking", "search"]
