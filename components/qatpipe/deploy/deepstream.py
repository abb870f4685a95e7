"""DeepStream hand-off: the `nvinfer` config TAO users deploy a DetectNet_v2 model with.

Written with `labels.txt` into the folder that also receives the model (the pipeline registers them together
under `deployment/`), so paths are relative to it. The ONNX is the explicit-quantisation one (network-mode 1 =
INT8; the Q/DQ carry the scales). Known gap, stated in the file: the outputs are NHWC with boxes relative to
cell centres, while nvinfer's built-in DetectNet_v2 parser reads CHW with TAO's offsets, so a custom
`parse-bbox-func-name` is needed until an NCHW export lands.
"""

from __future__ import annotations

from pathlib import Path

from qatpipe.fileio import atomic_write_text
from qatpipe.spec import ExperimentSpec

NETWORK_MODES = {"fp32": 0, "int8": 1, "fp16": 2}


def write_nvinfer_config(spec: ExperimentSpec, onnx_path: str | Path, folder: str | Path, variant: str,
                         network_mode: str = "int8", calibration_cache: str | Path | None = None) -> Path:
    """Write the nvinfer config and labels file into `folder`; returns the config path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    labels = folder / "labels.txt"
    atomic_write_text(labels, "\n".join(spec.dataset.classes) + "\n")
    size = spec.dataset.image_size
    decoder = spec.model.decoder
    target = spec.model.target
    lines = [
        "# DeepStream nvinfer config for a qatpipe DetectNet_v2 model (gst-nvinfer property groups).",
        "# The outputs are NHWC (batch, grid_h, grid_w, C) with boxes relative to cell centres; nvinfer's",
        "# built-in DetectNet_v2 parser reads CHW with TAO's offsets: set parse-bbox-func-name and",
        "# custom-lib-path to a parser for this layout.",
        "[property]",
        "gpu-id=0",
        "net-scale-factor=0.00392156862745098",  # 1/255: the model takes RGB in [0, 1]
        "model-color-format=0",  # RGB
        f"onnx-file={Path(onnx_path).name}",
        f"model-engine-file={Path(onnx_path).name}_b{spec.engine.max_batch}_gpu0_{network_mode}.engine",
        f"labelfile-path={labels.name}",
        f"batch-size={spec.engine.max_batch}",
        f"network-mode={NETWORK_MODES[network_mode]}",
        f"num-detected-classes={spec.num_classes}",
        f"infer-dims=3;{size.height};{size.width}",
        "network-input-order=1",  # NHWC: the ONNX input is input_1 (batch, height, width, 3)
        "output-blob-names=output_cov;output_bbox",
        "interval=0",
        "gie-unique-id=1",
        "cluster-mode=" + ("1" if decoder.method == "dbscan" else "2"),  # 1 DBSCAN, 2 NMS
        "",
        "[class-attrs-all]",
        f"pre-cluster-threshold={decoder.coverage_threshold}",
        f"nms-iou-threshold={decoder.nms_iou}",
        f"eps={decoder.dbscan_eps}",
        f"minBoxes={decoder.dbscan_min_samples}",
        f"topk={decoder.max_detections}",
        f"# bbox outputs are distances in units of bbox_norm={target.bbox_norm} px from {16}-px grid cells",
    ]
    if calibration_cache is not None:
        lines.insert(lines.index("[property]") + 1, f"int8-calib-file={Path(calibration_cache).name}")
    path = folder / f"config_infer_primary_{variant}.txt"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
