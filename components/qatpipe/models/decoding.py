"""How a detector's raw outputs become boxes, as a typed record an export carries in its ONNX metadata for the engine
backends and DeepStream, and as ONNX graph ops.

A DetectorArchitecture's `decoding()` gives its record (None: its engines output the heads, as DetectNet_v2's do).
The export writes it into the ONNX's metadata (DECODING_KEY: its `kind` and settings as JSON; export/onnx_export.py)
and the Q/DQ, implicit, FP16 and DLA forms copy the metadata (PTQ keeps the FP32 model's, stages/ptq.py). An engine
backend gets only the ONNX and reads the record, never the architecture: TensorRT's adds `add_outputs` (boxes and
scores) and its NMS from it (engines/tensorrt_backend.py). An ONNX exported before the record had a kind carries
SSD's under LEGACY_KEY, read as a PriorBoxDecoding.

PriorBoxDecoding (SSD's): outputs `output_cls` (N, P, 1 + C), softmax with the background at index 0, and
`output_loc` (N, P, 4), offsets from the priors. `add_decoded_boxes` appends `output_boxes` (N, P, 4): x1 y1 x2 y2 as
fractions of the image, what `boxes.centres_to_corners(boxes.decode_offsets(output_loc, priors, variances))`
computes in NumPy, in standard ops TensorRT's ONNX parser reads (Slice, Mul, Add, Clip, Exp, Sub, Concat) with the
priors and variances as constants; on request also `output_scores` (N, P, C), the class scores without the
background, as an NMS without a background class takes them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from qatpipe.boxes import prior_boxes
from qatpipe.errors import ModelFileError, QatpipeError

CLS, LOC = "output_cls", "output_loc"  # a prior-box detector's outputs (models/ssd.py)
BOXES = "output_boxes"  # (N, P, 4) x1 y1 x2 y2, fractions of the image
SCORES = "output_scores"  # (N, P, C): output_cls without its background column
DECODING_KEY = "qatpipe.decoding"  # metadata_props key: the record as JSON, with its `kind`
LEGACY_KEY = "qatpipe.ssd_decoding"  # what exports wrote before the record had a kind: a PriorBoxDecoding's JSON
EXP_CLIP = 10.0  # boxes.decode_offsets clips the scaled log sizes to +-10 before exp
_PREFIX = "ssd_decode"


class Decoding:
    """A decoding record: a frozen dataclass of JSON-able fields with a `kind`, which engines and DeepStream read.
    Every kind gives the engine's NMS its settings (num_classes, confidence_threshold, nms_iou, top_k,
    max_detections) and `add_outputs`: the ONNX with BOXES (corners, fractions of the image) and SCORES after its
    own outputs."""

    kind: ClassVar[str]
    num_classes: int
    confidence_threshold: float
    nms_iou: float
    top_k: int
    max_detections: int

    def add_outputs(self, model, scores: bool = True):
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_values(cls, values: dict) -> "Decoding":
        return cls(**values)


@dataclass(frozen=True)
class PriorBoxDecoding(Decoding):
    """What turns a prior-box detector's outputs (SSD's) into detections: the priors (from their settings,
    boxes.prior_boxes), the variances, and model.decoder's settings (for the NMS an engine adds)."""

    kind: ClassVar[str] = "prior_boxes"
    image_hw: tuple[int, int]
    map_hws: tuple[tuple[int, int], ...]
    scales: tuple[float, ...]
    aspect_ratios: tuple[tuple[float, ...], ...]  # one list per map
    two_boxes_for_ar1: bool
    clip_boxes: bool
    variances: tuple[float, ...]
    num_classes: int  # object classes, without the background
    confidence_threshold: float
    nms_iou: float
    top_k: int
    max_detections: int

    def priors(self) -> np.ndarray:
        """(P, 4) cx cy w h, fractions of the image."""
        return prior_boxes(self.image_hw, list(self.map_hws), list(self.scales),
                           [list(r) for r in self.aspect_ratios], self.two_boxes_for_ar1, self.clip_boxes)

    def add_outputs(self, model, scores: bool = True):
        return add_decoded_boxes(model, self.priors(), self.variances, scores=scores)

    @classmethod
    def from_values(cls, values: dict) -> "PriorBoxDecoding":
        values = dict(values)
        values["image_hw"] = tuple(values["image_hw"])
        values["map_hws"] = tuple(tuple(hw) for hw in values["map_hws"])
        values["aspect_ratios"] = tuple(tuple(r) for r in values["aspect_ratios"])
        for key in ("scales", "variances"):
            values[key] = tuple(values[key])
        return cls(**values)


# kind -> its record class: what an engine or DeepStream can read from an export
DECODINGS: dict[str, type[Decoding]] = {PriorBoxDecoding.kind: PriorBoxDecoding}


def decoding_from_json(text: str, legacy: bool = False) -> Decoding:
    """The record of DECODING_KEY's JSON (`legacy`: LEGACY_KEY's, a PriorBoxDecoding without a kind)."""
    values = json.loads(text)
    kind = PriorBoxDecoding.kind if legacy else values.pop("kind", None)
    if kind not in DECODINGS:
        raise ModelFileError(f"{DECODING_KEY}: decoding kind {kind!r} is not one of {', '.join(DECODINGS)} (an "
                             "export of a newer qatpipe?)")
    return DECODINGS[kind].from_values(values)


def decoding_metadata(decoding: Decoding | None) -> dict[str, str]:
    """The ONNX metadata that carries `decoding`: {} for none (the engines output the heads)."""
    return {} if decoding is None else {DECODING_KEY: decoding.to_json()}


def read_decoding(model) -> Decoding | None:
    """The decoding record an ONNX model (a ModelProto) carries, None when it has none (its engines output its
    heads, or it was exported before the export wrote one)."""
    props = {prop.key: prop.value for prop in model.metadata_props}
    if DECODING_KEY in props:
        return decoding_from_json(props[DECODING_KEY])
    if LEGACY_KEY in props:
        return decoding_from_json(props[LEGACY_KEY], legacy=True)
    return None


def add_decoded_boxes(model, priors: np.ndarray, variances, scores: bool = False):
    """A copy of the prior-box (SSD) ONNX `model` with the output BOXES (and with `scores`, SCORES) after its own
    outputs; `priors` (P, 4) cx cy w h and `variances` (4,) as models/ssd.py's SSD has them (the module docstring)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    outputs = {output.name: output for output in graph.output}
    missing = [name for name in (LOC, *([CLS] if scores else [])) if name not in outputs]
    if missing:
        raise QatpipeError(f"not an SSD ONNX: no output {', '.join(missing)} (outputs: {', '.join(outputs)})")
    priors = np.asarray(priors, np.float32)
    v = np.asarray(variances, np.float32)
    dims = outputs[LOC].type.tensor_type.shape.dim
    if len(dims) != 3 or dims[1].dim_value not in (0, len(priors)):
        raise QatpipeError(f"{LOC}: expected (batch, {len(priors)} priors, 4), got "
                           f"{[d.dim_param or d.dim_value for d in dims]}")
    batch = dims[0].dim_param or dims[0].dim_value or "batch"

    def name(part: str) -> str:
        return f"{_PREFIX}/{part}"

    constants = {
        "xy_start": np.array([0], np.int64), "xy_end": np.array([2], np.int64),
        "wh_start": np.array([2], np.int64), "wh_end": np.array([4], np.int64),
        "last_axis": np.array([2], np.int64),
        "centre_scale": v[:2] * priors[:, 2:],  # (P, 2): the centre shift's variance x the prior's size
        "prior_centres": priors[:, :2],
        "size_variances": v[2:],
        "exp_min": np.array(-EXP_CLIP, np.float32), "exp_max": np.array(EXP_CLIP, np.float32),
        "prior_sizes": priors[:, 2:],
        "half": np.array(0.5, np.float32),
    }
    graph.initializer.extend(numpy_helper.from_array(value, name(key)) for key, value in constants.items())
    nodes = [
        ("Slice", [LOC, name("xy_start"), name("xy_end"), name("last_axis")], "loc_xy"),
        ("Slice", [LOC, name("wh_start"), name("wh_end"), name("last_axis")], "loc_wh"),
        ("Mul", [name("loc_xy"), name("centre_scale")], "shift"),
        ("Add", [name("shift"), name("prior_centres")], "centres"),
        ("Mul", [name("loc_wh"), name("size_variances")], "log_scale"),
        ("Clip", [name("log_scale"), name("exp_min"), name("exp_max")], "log_scale_clipped"),
        ("Exp", [name("log_scale_clipped")], "scale"),
        ("Mul", [name("scale"), name("prior_sizes")], "sizes"),
        ("Mul", [name("sizes"), name("half")], "half_sizes"),
        ("Sub", [name("centres"), name("half_sizes")], "top_left"),
        ("Add", [name("centres"), name("half_sizes")], "bottom_right"),
    ]
    graph.node.extend(helper.make_node(op, inputs, [name(out)], name=name(out)) for op, inputs, out in nodes)
    graph.node.append(helper.make_node("Concat", [name("top_left"), name("bottom_right")], [BOXES], axis=2,
                                       name=name("concat")))
    graph.output.append(helper.make_tensor_value_info(BOXES, TensorProto.FLOAT, [batch, len(priors), 4]))
    if scores:
        cls_dims = outputs[CLS].type.tensor_type.shape.dim
        classes = cls_dims[2].dim_value - 1 if len(cls_dims) == 3 else -1
        if classes < 1:
            raise QatpipeError(f"{CLS}: expected (batch, priors, 1 + classes) with the classes static, got "
                               f"{[d.dim_param or d.dim_value for d in cls_dims]}")
        graph.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), name("scores_start")),
                                  numpy_helper.from_array(np.array([classes + 1], np.int64), name("scores_end"))])
        graph.node.append(helper.make_node("Slice", [CLS, name("scores_start"), name("scores_end"),
                                                     name("last_axis")], [SCORES], name=name("scores")))
        graph.output.append(helper.make_tensor_value_info(SCORES, TensorProto.FLOAT, [batch, len(priors), classes]))
    return model


__all__ = ["BOXES", "CLS", "DECODINGS", "DECODING_KEY", "LEGACY_KEY", "LOC", "SCORES", "Decoding",
           "PriorBoxDecoding", "add_decoded_boxes", "decoding_from_json", "decoding_metadata", "read_decoding"]
