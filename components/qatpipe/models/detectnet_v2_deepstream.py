"""DetectNet_v2 in DeepStream: the model in the layout nvinfer's built-in DetectNet_v2 parser reads, and the
config lines that parser needs (`DetectNetV2Layout`, the architecture's `nvinfer_layout()`; deploy/deepstream.py
writes the config).

nvinfer's built-in parser reads, per class c, a coverage plane and four bbox planes (CHW) and decodes
    x1 = (i * stride + 0.5) - o_x1 * 35,   x2 = (i * stride + 0.5) + o_x2 * 35   (y alike; 35 is fixed in it)
while qatpipe's heads are NHWC with distances from the cell centre ((i + 0.5) * stride) in units of
`model.target.bbox_norm`. `deepstream_onnx` appends the exact conversion to the graph: a per-channel scale and
offset on the bbox output, and a transpose of both outputs to CHW, named as TAO names them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.spec import DecoderSpec

NVINFER_BBOX_NORM = 35.0  # bboxNormX/Y of nvinfer's DetectNet_v2 parser
# qatpipe output -> TAO's blob name (what TAO's DeepStream configs list in output-blob-names)
DEEPSTREAM_OUTPUTS = {"output_cov": "output_cov/Sigmoid", "output_bbox": "output_bbox/BiasAdd"}


def deepstream_onnx(model, stride: int, bbox_norm: float):
    """A copy of the ONNX `model` whose outputs are TAO's: CHW coverage, and CHW bbox offsets in nvinfer's
    encoding (see the module docstring); the network itself is untouched."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    outputs = {output.name: output for output in graph.output}
    missing = set(DEEPSTREAM_OUTPUTS) - set(outputs)
    if missing:
        raise QatpipeError(f"not a DetectNet_v2 ONNX: no output {', '.join(sorted(missing))} "
                           f"(outputs: {', '.join(outputs)})")
    dims = outputs["output_bbox"].type.tensor_type.shape.dim
    channels = dims[3].dim_value if len(dims) == 4 else 0
    if channels == 0 or channels % 4:
        raise QatpipeError(f"output_bbox: expected a static (batch, grid_h, grid_w, 4 x classes) shape, got "
                           f"{[d.dim_param or d.dim_value for d in dims]}")
    half_cell = (stride / 2 - 0.5) / NVINFER_BBOX_NORM  # cell centre vs nvinfer's cell origin + 0.5 px
    # channel 4c+k is x1, y1, x2, y2 for k = 0..3: the near edges are subtracted, the far edges added
    offset = np.tile(np.array([-half_cell, -half_cell, half_cell, half_cell], np.float32), channels // 4)
    graph.initializer.extend([
        numpy_helper.from_array(np.full(channels, bbox_norm / NVINFER_BBOX_NORM, np.float32), "deepstream_bbox_scale"),
        numpy_helper.from_array(offset, "deepstream_bbox_offset"),
    ])
    graph.node.extend([
        helper.make_node("Mul", ["output_bbox", "deepstream_bbox_scale"], ["deepstream_bbox_scaled"]),
        helper.make_node("Add", ["deepstream_bbox_scaled", "deepstream_bbox_offset"], ["deepstream_bbox_nhwc"]),
        helper.make_node("Transpose", ["deepstream_bbox_nhwc"], [DEEPSTREAM_OUTPUTS["output_bbox"]],
                         perm=[0, 3, 1, 2]),
        helper.make_node("Transpose", ["output_cov"], [DEEPSTREAM_OUTPUTS["output_cov"]], perm=[0, 3, 1, 2]),
    ])
    new_outputs = []
    for name, output in outputs.items():
        if name not in DEEPSTREAM_OUTPUTS:
            new_outputs.append(output)
            continue
        dims = output.type.tensor_type.shape.dim
        shape = [dims[0].dim_param or dims[0].dim_value or "batch", dims[3].dim_value, dims[1].dim_value,
                 dims[2].dim_value]
        new_outputs.append(helper.make_tensor_value_info(DEEPSTREAM_OUTPUTS[name], output.type.tensor_type.elem_type,
                                                         shape))
    del graph.output[:]
    graph.output.extend(new_outputs)
    return model


def nvinfer_boxes(coverage_chw: np.ndarray, bbox_chw: np.ndarray, image_hw: tuple[int, int], threshold: float):
    """What nvinfer's built-in DetectNet_v2 parser makes of one image's CHW outputs, before clustering:
    (boxes x1 y1 x2 y2 clipped to the image, scores, classes). For tests and for checking an export by hand."""
    num_classes, grid_h, grid_w = coverage_chw.shape
    height, width = image_hw
    stride_x, stride_y = -(-width // grid_w), -(-height // grid_h)  # DIVIDE_AND_ROUND_UP
    boxes, scores, classes = [], [], []
    for c in range(num_classes):
        ys, xs = np.nonzero(coverage_chw[c] >= threshold)
        o = bbox_chw[4 * c: 4 * c + 4, ys, xs]
        origin_x, origin_y = xs * stride_x + 0.5, ys * stride_y + 0.5
        found = np.stack([origin_x - o[0] * NVINFER_BBOX_NORM, origin_y - o[1] * NVINFER_BBOX_NORM,
                          origin_x + o[2] * NVINFER_BBOX_NORM, origin_y + o[3] * NVINFER_BBOX_NORM], axis=1)
        boxes.append(np.clip(found, 0, [width - 1, height - 1, width - 1, height - 1]))
        scores.append(coverage_chw[c, ys, xs])
        classes.append(np.full(len(ys), c))
    return np.concatenate(boxes), np.concatenate(scores), np.concatenate(classes)


@dataclass(frozen=True)
class DetectNetV2Layout:
    """What nvinfer's built-in DetectNet_v2 parser needs (DetectNet_v2's `nvinfer_layout()`): the
    model with TAO's CHW outputs and bbox encoding, its output blob names and the clustering settings."""

    stride: int
    bbox_norm: float
    decoder: DecoderSpec
    description = "nvinfer's built-in DetectNet_v2 parser: the ONNX has TAO's CHW outputs and bbox encoding"

    def onnx(self, model):
        return deepstream_onnx(model, self.stride, self.bbox_norm)

    def labels(self, classes: list[str]) -> list[str]:
        return list(classes)

    def properties(self) -> list[str]:
        return ["output-blob-names=" + ";".join(DEEPSTREAM_OUTPUTS[name] for name in ("output_cov", "output_bbox")),
                "cluster-mode=" + ("1" if self.decoder.method == "dbscan" else "2")]  # 1 DBSCAN, 2 NMS

    def class_attributes(self) -> list[str]:
        d = self.decoder
        return [f"pre-cluster-threshold={d.coverage_threshold}", f"nms-iou-threshold={d.nms_iou}",
                f"eps={d.dbscan_eps}", f"minBoxes={d.dbscan_min_samples}", f"topk={d.max_detections}"]
