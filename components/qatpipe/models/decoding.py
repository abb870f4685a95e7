"""SSD's box decoding as ONNX graph ops, and the decoding an SSD's ONNX carries for the engine backends.

`add_decoded_boxes` appends to an SSD ONNX (outputs `output_cls` (N, P, 1 + C), softmax with the background at
index 0, and `output_loc` (N, P, 4), offsets from the priors) the output `output_boxes` (N, P, 4): x1 y1 x2 y2 as
fractions of the image, what `boxes.centres_to_corners(boxes.decode_offsets(output_loc, priors, variances))`
computes in NumPy, in standard ops TensorRT's ONNX parser reads (Slice, Mul, Add, Clip, Exp, Sub, Concat) with the
priors and variances as constants; on request also `output_scores` (N, P, C), the class scores without the
background, as an NMS without a background class takes them.

The export writes the SSD's decoding (its priors' settings, the variances and model.decoder's thresholds) into the
ONNX's metadata (`SsdDecoding`, key DECODING_KEY): an engine backend gets only the ONNX, and TensorRT's adds the
decoded boxes and its NMS from it (engines/tensorrt_backend.py). The Q/DQ, implicit, FP16 and DLA forms copy the
metadata, and PTQ keeps the FP32 model's (stages/ptq.py). DeepStream's layout (deploy/deepstream.py) builds from
the spec instead.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qatpipe.boxes import prior_boxes
from qatpipe.errors import QatpipeError

CLS, LOC = "output_cls", "output_loc"  # the SSD ONNX's outputs (models/ssd.py)
BOXES = "output_boxes"  # (N, P, 4) x1 y1 x2 y2, fractions of the image
SCORES = "output_scores"  # (N, P, C): output_cls without its background column
DECODING_KEY = "qatpipe.ssd_decoding"  # metadata_props key: SsdDecoding as JSON
EXP_CLIP = 10.0  # boxes.decode_offsets clips the scaled log sizes to +-10 before exp
_PREFIX = "ssd_decode"


@dataclass(frozen=True)
class SsdDecoding:
    """What turns an SSD's outputs into detections: the priors (from their settings, boxes.prior_boxes), the
    variances, and model.decoder's settings (for the NMS an engine adds)."""

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

    @classmethod
    def of(cls, spec) -> "SsdDecoding":
        """The decoding of an ExperimentSpec whose model.arch is ssd (the priors models/ssd.py's SSD makes)."""
        model, size = spec.model, spec.dataset.image_size
        priors, decoder = model.ssd, model.decoder
        return cls(
            image_hw=(size.height, size.width),
            map_hws=tuple((size.height // s, size.width // s) for s in priors.feature_strides),
            scales=tuple(priors.scales),
            aspect_ratios=tuple(tuple(priors.ratios_of(k)) for k in range(len(priors.feature_strides))),
            two_boxes_for_ar1=priors.two_boxes_for_ar1, clip_boxes=priors.clip_boxes,
            variances=tuple(priors.variances), num_classes=spec.num_classes,
            confidence_threshold=decoder.confidence_threshold, nms_iou=decoder.nms_iou, top_k=decoder.top_k,
            max_detections=decoder.max_detections)

    def priors(self) -> np.ndarray:
        """(P, 4) cx cy w h, fractions of the image."""
        return prior_boxes(self.image_hw, list(self.map_hws), list(self.scales),
                           [list(r) for r in self.aspect_ratios], self.two_boxes_for_ar1, self.clip_boxes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "SsdDecoding":
        values = json.loads(text)
        values["image_hw"] = tuple(values["image_hw"])
        values["map_hws"] = tuple(tuple(hw) for hw in values["map_hws"])
        values["aspect_ratios"] = tuple(tuple(r) for r in values["aspect_ratios"])
        for key in ("scales", "variances"):
            values[key] = tuple(values[key])
        return cls(**values)


def export_metadata(spec) -> dict[str, str]:
    """The metadata an export of `spec`'s detector carries for the engine backends: an SSD's decoding; none for
    DetectNet_v2, whose engines output its heads."""
    if spec.model.arch != "ssd":
        return {}
    return {DECODING_KEY: SsdDecoding.of(spec).to_json()}


def write_export_metadata(spec, onnx_path: str | Path) -> dict[str, str]:
    """Add `export_metadata(spec)` to the ONNX file at `onnx_path` (its other metadata kept); returns it."""
    import onnx

    from qatpipe.export.onnx_export import save_onnx

    metadata = export_metadata(spec)
    if metadata:
        model = onnx.load(onnx_path)
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, **metadata})
        save_onnx(model, onnx_path)
    return metadata


def read_decoding(model) -> SsdDecoding | None:
    """The SsdDecoding an ONNX model (a ModelProto) carries, None when it has none (not an SSD, or exported
    before the export wrote it)."""
    for prop in model.metadata_props:
        if prop.key == DECODING_KEY:
            return SsdDecoding.from_json(prop.value)
    return None


def add_decoded_boxes(model, priors: np.ndarray, variances, scores: bool = False):
    """A copy of the SSD ONNX `model` with the output BOXES (and with `scores`, SCORES) after its own outputs;
    `priors` (P, 4) cx cy w h and `variances` (4,) as models/ssd.py's SSD has them (see the module docstring)."""
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


__all__ = ["BOXES", "DECODING_KEY", "SCORES", "SsdDecoding", "add_decoded_boxes", "export_metadata",
           "read_decoding", "write_export_metadata"]
