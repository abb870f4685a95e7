"""DeepStream hand-off: the `nvinfer` config TAO users deploy a model with, and the model in the layout nvinfer's
parser for its architecture reads.

Written with `labels.txt` into the folder that also receives the model (the pipeline registers them together
under `deployment/`), so paths are relative to it. The INT8 variants are explicit-quantization ONNX
(network-mode 1 = INT8; the Q/DQ carry the scales, no calibration file).

What differs by architecture (which parser, the model's outputs in its layout, labels, clustering) is the
architecture's `nvinfer_layout()` (models/detectnet_v2_deepstream.py: nvinfer's built-in DetectNet_v2 parser;
models/ssd_deepstream.py: TAO's NMS parser); this module writes the config around it.
"""

from __future__ import annotations

from pathlib import Path

from qatpipe.errors import QatpipeError
from qatpipe.fileio import atomic_write_text
from qatpipe.spec import ExperimentSpec

NETWORK_MODES = {"fp32": 0, "int8": 1, "fp16": 2}


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
    layout = arch.nvinfer_layout()
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
