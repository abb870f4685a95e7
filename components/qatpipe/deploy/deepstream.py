"""DeepStream hand-off: the `nvinfer` config TAO users deploy a DetectNet_v2 model with, and the model in the
layout nvinfer's built-in DetectNet_v2 parser reads.

Written with `labels.txt` into the folder that also receives the model (the pipeline registers them together
under `deployment/`), so paths are relative to it. The INT8 variants are explicit-quantization ONNX
(network-mode 1 = INT8; the Q/DQ carry the scales, no calibration file).

nvinfer's built-in parser reads, per class c, a coverage plane and four bbox planes (CHW) and decodes
    x1 = (i * stride + 0.5) - o_x1 * 35,   x2 = (i * stride + 0.5) + o_x2 * 35   (y alike; 35 is fixed in it)
while qatpipe's heads are NHWC with distances from the cell centre ((i + 0.5) * stride) in units of
`model.target.bbox_norm`. `deepstream_onnx` appends the exact conversion to the graph: a per-channel scale and
offset on the bbox output, and a transpose of both outputs to CHW, named as TAO names them.

An SSD deploys as TAO deploys its SSD: the ONNX ends in TensorRT's NMS plugin (`NMSDynamic_TRT`, as TAO's SSD
export writes it) and nvinfer reads its two outputs with TAO's custom parser `NvDsInferParseCustomNMSTLT`, from
deepstream_tao_apps' libnvds_infercustomparser_tao.so (`ssd_deepstream_onnx`, `SsdLayout`; docs/ssd.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text
from qatpipe.spec import DecoderSpec, ExperimentSpec, SsdDecoderSpec

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


# --------------------------------------------------------------------------------------------------------- SSD

# TAO's SSD in DeepStream (deepstream_tao_apps: configs/nvinfer/ssd_tao/pgie_ssd_tao_config.txt and
# post_processor/nvdsinfer_custombboxparser_tao.cpp; TAO's SSD ONNX export names the NMS node and its outputs)
SSD_PARSER = "NvDsInferParseCustomNMSTLT"
SSD_PARSER_LIBRARY = "libnvds_infercustomparser_tao.so"  # built from deepstream_tao_apps' post_processor/
SSD_PARSER_SOURCE = "https://github.com/NVIDIA-AI-IOT/deepstream_tao_apps/tree/master/post_processor"
NMS_PLUGIN = "NMSDynamic_TRT"  # TensorRT's nmsPlugin (dynamic shapes); TensorRT 11 removed it
NMS_OUTPUTS = ("NMS", "NMS_1")  # [N, 1, keepTopK, 7] detections, [N, 1, 1, 1] keep count (int32 bits, float type)
BACKGROUND_LABEL = "background"  # the parser's class ids count the background: labels.txt lists it first
CORNER = 1  # nmsPlugin's CodeTypeSSD::CORNER: with zero priors and variance in the target, box = loc_data


def ssd_deepstream_onnx(model, priors: np.ndarray, variances, num_classes: int, decoder: SsdDecoderSpec):
    """A copy of the SSD ONNX `model` ending in TensorRT's NMS plugin as NvDsInferParseCustomNMSTLT reads it.

    The boxes are decoded in the graph (export/ssd_boxes.py: output_boxes, corners as fractions of the image) and
    handed to the plugin as `loc_data` with corner coding, zero priors and the variance taken as encoded in the
    target, so the plugin's own decoding returns them unchanged; `conf_data` is output_cls with its background
    column (backgroundLabelId 0, numClasses 1 + C), so a detection's label is its class id + 1. Per class the
    `top_k` most confident priors above `confidence_threshold` go through NMS at `nms_iou`; `max_detections`
    (keepTopK) stay per image. The outputs are NMS_OUTPUTS only (the parser takes exactly two)."""
    from onnx import TensorProto, helper, numpy_helper

    from qatpipe.export.ssd_boxes import BOXES, CLS, add_decoded_boxes

    num_priors = len(priors)
    model = add_decoded_boxes(model, priors, variances)
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


@dataclass(frozen=True, eq=False)
class SsdLayout:
    """What TAO's SSD parser needs (the `nvinfer_layout` of an SSD spec): the model ending in the NMS plugin,
    the parser's function and library, no clustering, and a labels file that starts with the background."""

    priors: np.ndarray
    variances: tuple[float, ...]
    num_classes: int
    decoder: SsdDecoderSpec
    description = (f"TAO's SSD parser {SSD_PARSER} ({SSD_PARSER_LIBRARY}): the ONNX decodes the boxes and ends in "
                   f"TensorRT's {NMS_PLUGIN} plugin")

    def onnx(self, model):
        return ssd_deepstream_onnx(model, self.priors, self.variances, self.num_classes, self.decoder)

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


NETWORK_MODES = {"fp32": 0, "int8": 1, "fp16": 2}


@dataclass(frozen=True)
class DetectNetV2Layout:
    """What nvinfer's built-in DetectNet_v2 parser needs (the `nvinfer_layout` of a DetectNet_v2 spec): the
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


# model.arch -> its layout, made from the spec and its architecture. The table lives here, not on the
# architectures, so that models/ never imports deploy/ (tests/test_layers.py).
NVINFER_LAYOUTS = {
    "detectnet_v2": lambda spec, arch: DetectNetV2Layout(arch.stride, arch.bbox_norm, spec.model.decoder),
    "ssd": lambda spec, arch: SsdLayout(arch.priors, tuple(spec.model.ssd.variances), spec.num_classes,
                                        spec.model.decoder),
}


def nvinfer_layout(spec: ExperimentSpec, arch):
    """How DeepStream's nvinfer runs the spec's detector (`arch`, its architecture): an object with `onnx(model)`
    (the exported ONNX in the layout its parser reads), `labels(classes)` (labels.txt's lines, in the parser's
    class ids) and `properties()` / `class_attributes()` (the config lines that parser needs)."""
    make = NVINFER_LAYOUTS.get(spec.model.arch)
    if make is None:
        raise QatpipeError(f"model.arch {spec.model.arch}: no DeepStream nvinfer layout for this architecture")
    return make(spec, arch)


def write_nvinfer_config(spec: ExperimentSpec, onnx_path: str | Path, folder: str | Path, variant: str,
                         network_mode: str = "int8", calibration_cache: str | Path | None = None,
                         dla_core: int | None = None) -> Path:
    """Write the nvinfer config, the labels file and the model in DeepStream's layout (`<stem>_deepstream.onnx`,
    from the ONNX at `onnx_path`) into `folder`; returns the config path. `dla_core`: the model is a DLA form
    (export/dla.py: fixed batch, NCHW input) for that core, INT8 from `calibration_cache` (copied beside it)."""
    from qatpipe.export.onnx_export import save_onnx
    from qatpipe.models import get_architecture
    from qatpipe.onnx_model import load_onnx_proto

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arch = get_architecture(spec)
    layout = nvinfer_layout(spec, arch)
    (height, width), stride = arch.input_hw, arch.stride
    if height % stride or width % stride:
        raise QatpipeError(f"dataset.image_size {height}x{width}: nvinfer's parser needs multiples of the output "
                           f"stride {stride}")
    model_path = folder / f"{Path(onnx_path).stem}_deepstream.onnx"
    source = load_onnx_proto(onnx_path)
    save_onnx(layout.onnx(source), model_path)
    batch, device = spec.engine.max_batch, "gpu0"
    if dla_core is not None:  # DLA: the fixed batch of the form, its calibration cache beside the model
        import shutil

        from qatpipe.export.dla import input_layout

        if calibration_cache is None or input_layout(source) != "NCHW":
            raise QatpipeError(f"{onnx_path}: a DLA config needs the DLA form (NCHW input) and its calibration cache")
        batch, device = source.graph.input[0].type.tensor_type.shape.dim[0].dim_value, f"dla{dla_core}"
        calibration_cache = shutil.copyfile(calibration_cache, folder / Path(calibration_cache).name)
    labels = folder / "labels.txt"
    label_names = layout.labels(list(spec.dataset.classes))
    atomic_write_text(labels, "\n".join(label_names) + "\n")
    lines = [
        f"# DeepStream nvinfer config for a qatpipe {spec.model.arch} model (gst-nvinfer property groups), for",
        f"# {layout.description}.",
        "[property]",
        "gpu-id=0",
        "net-scale-factor=0.00392156862745098",  # 1/255: the model takes RGB in [0, 1]
        "model-color-format=0",  # RGB
        f"onnx-file={model_path.name}",
        f"model-engine-file={model_path.name}_b{batch}_{device}_{network_mode}.engine",
        f"labelfile-path={labels.name}",
        f"batch-size={batch}",
        f"network-mode={NETWORK_MODES[network_mode]}",
        f"num-detected-classes={len(label_names)}",
        f"infer-dims=3;{height};{width}",
        # NHWC: the ONNX input is input_1 (batch, height, width, 3); the DLA form's is NCHW
        f"network-input-order={0 if dla_core is not None else 1}",
        *layout.properties(),
        "interval=0",
        "gie-unique-id=1",
        "",
        "[class-attrs-all]",
        *layout.class_attributes(),
    ]
    if calibration_cache is not None:
        lines.insert(lines.index("[property]") + 1, f"int8-calib-file={Path(calibration_cache).name}")
    if dla_core is not None:
        lines[lines.index("[property]") + 1:lines.index("[property]") + 1] = [
            "enable-dla=1", f"use-dla-core={dla_core}"]
    path = folder / f"config_infer_primary_{variant}.txt"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
