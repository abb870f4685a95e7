"""SSD in DeepStream, as TAO deploys its SSD: the ONNX ends in TensorRT's NMS plugin (`NMSDynamic_TRT`, as TAO's
SSD export writes it) and nvinfer reads its two outputs with TAO's custom parser `NvDsInferParseCustomNMSTLT`, from
deepstream_tao_apps' libnvds_infercustomparser_tao.so (`SsdLayout`, the architecture's `nvinfer_layout()`, made from
its decoding record; deploy/deepstream.py writes the config; docs/ssd.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from qatpipe.models.decoding import BOXES, CLS, PriorBoxDecoding, add_decoded_boxes

# TAO's SSD in DeepStream (deepstream_tao_apps: configs/nvinfer/ssd_tao/pgie_ssd_tao_config.txt and
# post_processor/nvdsinfer_custombboxparser_tao.cpp; TAO's SSD ONNX export names the NMS node and its outputs)
SSD_PARSER = "NvDsInferParseCustomNMSTLT"
SSD_PARSER_LIBRARY = "libnvds_infercustomparser_tao.so"  # built from deepstream_tao_apps' post_processor/
SSD_PARSER_SOURCE = "https://github.com/NVIDIA-AI-IOT/deepstream_tao_apps/tree/master/post_processor"
NMS_PLUGIN = "NMSDynamic_TRT"  # TensorRT's nmsPlugin (dynamic shapes); TensorRT 11 removed it
NMS_OUTPUTS = ("NMS", "NMS_1")  # [N, 1, keepTopK, 7] detections, [N, 1, 1, 1] keep count (int32 bits, float type)
BACKGROUND_LABEL = "background"  # the parser's class ids count the background: labels.txt lists it first
CORNER = 1  # nmsPlugin's CodeTypeSSD::CORNER: with zero priors and variance in the target, box = loc_data


def ssd_deepstream_onnx(model, decoding: PriorBoxDecoding):
    """A copy of the SSD ONNX `model` ending in TensorRT's NMS plugin as NvDsInferParseCustomNMSTLT reads it.

    The boxes are decoded in the graph (models/decoding.py: output_boxes, corners as fractions of the image) and
    handed to the plugin as `loc_data` with corner coding, zero priors and the variance taken as encoded in the
    target, so the plugin's own decoding returns them unchanged; `conf_data` is output_cls with its background
    column (backgroundLabelId 0, numClasses 1 + C), so a detection's label is its class id + 1. Per class the
    `top_k` most confident priors above `confidence_threshold` go through NMS at `nms_iou`; `max_detections`
    (keepTopK) stay per image: the decoding record's settings. The outputs are NMS_OUTPUTS only (the parser takes
    exactly two)."""
    from onnx import TensorProto, helper, numpy_helper

    decoder, num_classes, priors = decoding, decoding.num_classes, decoding.priors()
    num_priors = len(priors)
    model = add_decoded_boxes(model, priors, decoding.variances)
    graph = model.graph
    batch = graph.output[0].type.tensor_type.shape.dim[0]
    batch = batch.dim_param or batch.dim_value or "batch"
    graph.initializer.extend([
        numpy_helper.from_array(np.array([-1, num_priors * 4, 1, 1], np.int64), "loc_data_shape"),
        numpy_helper.from_array(np.array([-1, num_priors * (1 + num_classes), 1, 1], np.int64), "conf_data_shape"),
        # [1, 2, P x 4, 1]: the priors, then their variances (one set for the whole batch: isBatchAgnostic)
        numpy_helper.from_array(np.concatenate([np.zeros(num_priors * 4), np.ones(num_priors * 4)])
                                .astype(np.float32).reshape(1, 2, num_priors * 4, 1), "prior_data"),
    ])
    graph.node.extend([
        helper.make_node("Reshape", [BOXES, "loc_data_shape"], ["loc_data"], name="loc_data"),
        helper.make_node("Reshape", [CLS, "conf_data_shape"], ["conf_data"], name="conf_data"),
        helper.make_node(
            NMS_PLUGIN, ["loc_data", "conf_data", "prior_data"], list(NMS_OUTPUTS), name=NMS_OUTPUTS[0],
            shareLocation=1, varianceEncodedInTarget=1, backgroundLabelId=0, numClasses=1 + num_classes,
            topK=decoder.top_k, keepTopK=decoder.max_detections,
            confidenceThreshold=float(decoder.confidence_threshold), nmsThreshold=float(decoder.nms_iou),
            codeType=CORNER, inputOrder=[0, 1, 2], confSigmoid=0, isNormalized=1, isBatchAgnostic=1),
    ])
    del graph.output[:]
    graph.output.extend([
        helper.make_tensor_value_info(NMS_OUTPUTS[0], TensorProto.FLOAT, [batch, 1, decoder.max_detections, 7]),
        helper.make_tensor_value_info(NMS_OUTPUTS[1], TensorProto.FLOAT, [batch, 1, 1, 1]),
    ])
    return model


def nms_tlt_objects(detections: np.ndarray, keep_count: np.ndarray, network_hw: tuple[int, int], threshold: float):
    """What NvDsInferParseCustomNMSTLT makes of one image's NMS outputs (detections (1, keepTopK, 7), keep count
    (1, 1, 1) as the plugin's int32 bits): (boxes x1 y1 x2 y2 in network pixels, scores, class ids counting the
    background) for the first keep-count rows at or above `threshold` (pre-cluster-threshold), the box's left and
    top clipped to the network's width - 1 and height - 1, and its width and height alike. For tests and for
    checking an export by hand."""
    height, width = network_hw
    count = int(np.asarray(keep_count, np.float32).reshape(-1)[:1].view(np.int32)[0])
    rows = np.asarray(detections, np.float32).reshape(-1, 7)[:count]
    rows = rows[rows[:, 2] >= threshold]
    left, top = np.clip(rows[:, 3] * width, 0, width - 1), np.clip(rows[:, 4] * height, 0, height - 1)
    box_w = np.clip((rows[:, 5] - rows[:, 3]) * width, 0, width - 1)
    box_h = np.clip((rows[:, 6] - rows[:, 4]) * height, 0, height - 1)
    return np.stack([left, top, left + box_w, top + box_h], axis=1), rows[:, 2], rows[:, 1].astype(np.int32)


@dataclass(frozen=True)
class SsdLayout:
    """What TAO's SSD parser needs (SSD's `nvinfer_layout()`, from its decoding record): the model ending in the
    NMS plugin, the parser's function and library, no clustering, and a labels file that starts with the
    background."""

    decoder: PriorBoxDecoding
    description = (f"TAO's SSD parser {SSD_PARSER} ({SSD_PARSER_LIBRARY}): the ONNX decodes the boxes and ends in "
                   f"TensorRT's {NMS_PLUGIN} plugin")

    def onnx(self, model):
        return ssd_deepstream_onnx(model, self.decoder)

    def labels(self, classes: list[str]) -> list[str]:
        return [BACKGROUND_LABEL, *classes]

    def properties(self) -> list[str]:
        d = self.decoder
        return [f"output-blob-names={NMS_OUTPUTS[0]}",
                f"parse-bbox-func-name={SSD_PARSER}",
                f"# {SSD_PARSER_LIBRARY}: build it from {SSD_PARSER_SOURCE} (make; CUDA_VER as your DeepStream's)",
                "# and copy it beside this config, or point custom-lib-path at it",
                f"custom-lib-path={SSD_PARSER_LIBRARY}",
                f"# NMS runs in the model's {NMS_PLUGIN} node: IoU {d.nms_iou}, top {d.top_k} per class above "
                f"{d.confidence_threshold}, {d.max_detections} kept an image",
                "cluster-mode=3"]  # 3: no clustering

    def class_attributes(self) -> list[str]:
        return [f"pre-cluster-threshold={self.decoder.confidence_threshold}"]
