"""TensorRT engines (imported lazily: GPU images get TensorRT from NVIDIA's base image, PyPI has only stubs).

Q/DQ models build as strongly typed explicit-quantization engines: the ONNX's Q/DQ decide what runs in int8,
which is the only INT8 path TensorRT 11 keeps (it removed calibrators, implicit INT8 and the INT8 / FP16
builder flags). The FP32 model builds in FP16 on TensorRT 10 (BuilderFlag.FP16) and in TF32 on TensorRT 11.
Every engine gets an optimisation profile for the dynamic batch, a workspace limit and a timing cache, and
its metadata records the TensorRT version and GPU: an engine only runs where it was built.

An ONNX whose metadata carries a decoding record (models/decoding.py: an SSD's) builds with its NMS in the engine:
the record's boxes and scores added to the graph before parsing, then TensorRT's INMSLayer on them (`add_nms`); the
engine outputs the NMS results (boxes.NMS_INDICES and company) instead of the heads, which the architecture's
decode reads (models/ssd.py). One without a record outputs its heads.

A DLA form (export.target dla, export/dla.py) builds for Jetson Orin's DLA on TensorRT 10: DeviceType.DLA on
`engine.dla_core`, INT8 from its full-tensor calibration cache and FP16 for the rest (implicit precision, which
TensorRT 10 still has), GPU fallback as `engine.gpu_fallback` says, its fixed batch. TensorRT 11 builds DLA
only strongly typed (11.4.1+ on JetPack 7.2.2): refused with that reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qatpipe.engines.base import EngineBackend, EngineMetadata, EngineRunner, engine_label, is_explicitly_quantized
from qatpipe.fileio import file_sha256
from qatpipe.devices import gpu_names
from qatpipe.errors import ModelFileError, QatpipeError

log = logging.getLogger(__name__)

ENGINE_FILE = "model.engine"
TIMING_CACHE_FILE = "timing.cache"


def _import_tensorrt():
    try:
        import tensorrt
    except ImportError as exc:
        raise QatpipeError(f"TensorRT is not installed here ({exc}); use --backend onnxruntime, or the engine "
                           "image (images/) built on NVIDIA's TensorRT base image") from None
    return tensorrt


def gpu_name() -> str | None:
    """The first GPU's name (nvidia-smi), None without a GPU or driver."""
    names = gpu_names()
    return names[0] if names else None


def major_version(trt) -> int:
    return int(trt.__version__.split(".")[0])


@dataclass(frozen=True)
class DlaBuild:
    """How a DLA form is built: the core, GPU fallback, its fixed batch and calibration cache."""

    core: int
    gpu_fallback: bool
    batch: int
    calibration_cache: bytes


def dla_build(onnx_path: Path, settings, trt_major: int) -> DlaBuild | None:
    """The DLA build of `onnx_path` when it is a DLA form (None otherwise); refused on TensorRT 11 and without
    its calibration cache."""
    from qatpipe.export.bundle import ExportBundle
    from qatpipe.onnx_model import load_onnx_proto

    bundle = ExportBundle.of_dla_form(onnx_path)
    if bundle is None:
        return None
    if trt_major >= 11:
        raise QatpipeError(f"{onnx_path}: a DLA form for TensorRT 10's implicit INT8 (a calibration cache); TensorRT "
                           f"11 builds DLA only strongly typed (11.4.1+, JetPack 7.2.2): use JetPack 6's TensorRT 10")
    cache = bundle.dla_cache
    if not cache.is_file():
        raise QatpipeError(f"{onnx_path}: its calibration cache {cache.name} is not beside it")
    batch = load_onnx_proto(onnx_path).graph.input[0].type.tensor_type.shape.dim[0].dim_value
    return DlaBuild(settings.dla_core, settings.gpu_fallback, batch, cache.read_bytes())


def dla_cores() -> int:
    """DLA cores TensorRT sees here (0 without TensorRT or on a GPU without DLA)."""
    try:
        import tensorrt as trt
    except ImportError:
        return 0
    return int(trt.Builder(trt.Logger(trt.Logger.ERROR)).num_DLA_cores)


def _configure_dla(trt, builder, config, dla: DlaBuild) -> str:
    """TensorRT 10's DLA build settings on `config`; returns the precision, for people."""
    if builder.num_DLA_cores <= dla.core:
        raise QatpipeError(f"no DLA core {dla.core} here ({gpu_name()} has {builder.num_DLA_cores}): DLA engines "
                           f"build on Jetson Orin")

    class CacheCalibrator(trt.IInt8EntropyCalibrator2):  # hands TensorRT the cache; it never asks for images
        def __init__(self):
            super().__init__()

        def get_batch_size(self):
            return dla.batch

        def get_batch(self, names):
            return None

        def read_calibration_cache(self):
            return dla.calibration_cache

        def write_calibration_cache(self, cache):
            return None

    config.default_device_type = trt.DeviceType.DLA
    config.DLA_core = dla.core
    config.set_flag(trt.BuilderFlag.INT8)
    config.set_flag(trt.BuilderFlag.FP16)
    if dla.gpu_fallback:
        config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
    config.int8_calibrator = CacheCalibrator()
    return f"int8 (DLA core {dla.core}, calibration cache{', GPU fallback' if dla.gpu_fallback else ''})"


def add_nms(trt, network, decoding) -> list:
    """Replace the outputs of a parsed network (with models/decoding.py's BOXES and SCORES, from `decoding`'s
    add_outputs) by TensorRT's NMS on them, with `decoding`'s settings: INMSLayer (TensorRT 8.6+, strongly typed or not) keeps per image and class the boxes scoring above
    confidence_threshold and overlapping a better one by at most nms_iou, at most min(top_k, max_detections) of
    each class, from the image's top_k x classes best (box, class) pairs (its TopK limit: 5000 at most); gathers
    give their boxes and scores. Outputs: boxes.NMS_INDICES, NMS_BOXES, NMS_SCORES, NMS_IMAGES. Returns the
    arrays behind the layers' weights, which must outlive the build."""
    from qatpipe.boxes import NMS_BOXES, NMS_IMAGES, NMS_INDICES, NMS_SCORES
    from qatpipe.models.decoding import BOXES, SCORES

    if not hasattr(network, "add_nms"):
        raise QatpipeError(f"TensorRT {trt.__version__} has no INMSLayer (TensorRT 8.6+): a {decoding.kind} decoding "
                           "needs it")
    outputs = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
    boxes, scores = outputs[BOXES], outputs[SCORES]
    for tensor in outputs.values():
        network.unmark_output(tensor)
    weights = []

    def constant(values, dtype, shape=()):
        weights.append(np.ascontiguousarray(values, dtype).reshape(-1))
        return network.add_constant(shape, trt.Weights(weights[-1])).get_output(0)

    per_class = constant([min(decoding.top_k, decoding.max_detections)], np.int32)
    try:
        nms = network.add_nms(boxes, scores, per_class, trt.int32)  # TensorRT 10.14+: the indices' type named
    except TypeError:
        nms = network.add_nms(boxes, scores, per_class)  # earlier: int32 indices
    nms.bounding_box_format = trt.BoundingBoxFormat.CORNER_PAIRS  # x1 y1 x2 y2
    nms.topk_box_limit = min(nms.topk_box_limit, decoding.top_k * decoding.num_classes)
    nms.set_input(3, constant([decoding.nms_iou], np.float32))
    nms.set_input(4, constant([decoding.confidence_threshold], np.float32))
    indices = nms.get_output(0)  # (K, 3): image, class, box

    def columns(picked):  # indices' columns in this order: (K, len(picked))
        return network.add_gather(indices, constant(picked, np.int32, (len(picked),)), 1).get_output(0)

    kept_boxes = network.add_gather_v2(boxes, columns([0, 2]), trt.GatherMode.ND).get_output(0)  # (K, 4)
    kept_scores = network.add_gather_v2(scores, columns([0, 2, 1]), trt.GatherMode.ND).get_output(0)  # (K,)
    best = network.add_reduce(scores, trt.ReduceOperation.MAX, 0b110, False).get_output(0)  # (N,)
    for tensor, name in ((indices, NMS_INDICES), (kept_boxes, NMS_BOXES), (kept_scores, NMS_SCORES),
                         (best, NMS_IMAGES)):
        tensor.name = name
        network.mark_output(tensor)
    return weights


def join_batches(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The outputs of consecutive chunks of one batch as the batch's: concatenated, with the image index of NMS
    results (boxes.NMS_INDICES' first column) counted from the batch's start."""
    from qatpipe.boxes import NMS_IMAGES, NMS_INDICES

    start, joined = 0, {name: [] for name in parts[0]}
    for part in parts:
        for name, value in part.items():
            if name == NMS_INDICES:
                value = value.copy()
                value[:, 0] += start
            joined[name].append(value)
        start += len(part[NMS_IMAGES]) if NMS_IMAGES in part else 0
    return {name: np.concatenate(values) for name, values in joined.items()}


class TensorRTRunner(EngineRunner):
    """Runs a deserialised engine through Polygraphy's TrtRunner (shipped with TensorRT's images), which
    owns the CUDA buffers and streams for both the TensorRT 10 and 11 execution APIs."""

    def __init__(self, engine_bytes: bytes, metadata: EngineMetadata):
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner

        self.metadata = metadata
        self.max_batch = int(metadata.batch_profile["max"])
        self._runner = TrtRunner(EngineFromBytes(engine_bytes))
        self._runner.activate()

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        """Batches larger than the profile's max run in chunks (evaluation batches need not fit it)."""
        return join_batches([self._infer(batch[i:i + self.max_batch]) for i in range(0, len(batch), self.max_batch)])

    def _infer(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        outputs = self._runner.infer({self.metadata.input_name: np.ascontiguousarray(batch, np.float32)})
        return {name: np.array(value) for name, value in outputs.items()}  # a copy: buffers are reused

    def close(self) -> None:
        if getattr(self, "_runner", None) is not None and self._runner.is_active:
            self._runner.deactivate()

    def __del__(self):
        self.close()


class TensorRTBackend(EngineBackend):
    name = "tensorrt"

    @classmethod
    def source(cls, bundle, settings) -> Path:
        """On a DLA core (Jetson Orin) the export's DLA form when it has one (export.target dla); else under
        `engine.fp16` its FP16 form when there is one (float regions FP16 through casts, strongly typed: the same
        on TensorRT 10 and 11); else the export itself."""
        if bundle.dla.is_file():
            if dla_cores() > settings.dla_core:
                log.info("engine from the DLA form %s on DLA core %d (export.target dla)", bundle.dla.name,
                         settings.dla_core)
                return bundle.dla
            log.info("the export has a DLA form, but no DLA core %d here: building for the GPU; on the Jetson, "
                     "DeepStream builds the DLA engine from the validated model's *_dla nvinfer config",
                     settings.dla_core)
        if settings.fp16 and bundle.fp16.is_file():
            log.info("engine from the FP16 form %s (engine.fp16)", bundle.fp16.name)
            return bundle.fp16
        return bundle.onnx

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            return "the tensorrt package is not importable"
        if gpu_name() is None:
            return "no NVIDIA GPU visible (nvidia-smi)"
        return None

    @classmethod
    def device(cls) -> str:
        return gpu_name() or "unknown GPU"

    def build(self, onnx_path: Path, folder: Path, settings) -> EngineMetadata:
        trt = _import_tensorrt()
        from qatpipe.models.decoding import read_decoding
        from qatpipe.onnx_model import load_onnx_proto

        model = load_onnx_proto(onnx_path)
        decoding = read_decoding(model)  # a decoding record: its boxes, scores and NMS go into the engine
        quantized = is_explicitly_quantized(model)
        fp16_casts = any(node.op_type == "Cast" and any(a.name == "to" and a.i == 10 for a in node.attribute)
                         for node in model.graph.node)  # an FP16 form (export/fp16.py): its types decide
        dla = dla_build(Path(onnx_path), settings, major_version(trt))
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        flags = 0
        strongly_typed = (quantized or fp16_casts or major_version(trt) >= 11) and dla is None
        if strongly_typed:
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        source = (decoding.add_outputs(model, scores=True).SerializeToString() if decoding
                  else Path(onnx_path).read_bytes())
        if not parser.parse(source):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise QatpipeError(f"{onnx_path}: TensorRT cannot parse the ONNX model: {errors}")
        nms_weights = add_nms(trt, network, decoding) if decoding else None  # kept alive until the engine is built
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_mb << 20)
        if dla is not None:
            precision, compute = _configure_dla(trt, builder, config, dla), "int8"
        elif strongly_typed:
            precision = ("int8 (explicit Q/DQ, strongly typed)" if quantized else
                         "fp16 (explicit casts, strongly typed)" if fp16_casts else "tf32 (strongly typed)")
            if quantized and fp16_casts:
                precision = "int8 + fp16 float regions (explicit Q/DQ and casts, strongly typed)"
            compute = "int8" if quantized else "fp16" if fp16_casts else "tf32"
        elif settings.fp16 and hasattr(trt.BuilderFlag, "FP16"):  # TensorRT 10
            config.set_flag(trt.BuilderFlag.FP16)
            precision = compute = "fp16"
        else:
            precision = compute = "tf32"
        input_tensor = network.get_input(0)
        _, *chw = input_tensor.shape
        if dla is None:  # the DLA form's batch is fixed: no profile
            profile = builder.create_optimization_profile()
            profile.set_shape(input_tensor.name, (settings.min_batch, *chw), (settings.opt_batch, *chw),
                              (settings.max_batch, *chw))
            config.add_optimization_profile(profile)
        cache_path = folder / TIMING_CACHE_FILE
        timing_cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(timing_cache, ignore_mismatch=False)
        log.info("building TensorRT %s engine (%s) for %s", trt.__version__, precision, onnx_path)
        serialized = builder.build_serialized_network(network, config)
        del nms_weights
        if serialized is None:
            raise QatpipeError(f"{onnx_path}: TensorRT could not build an engine (see the log above)")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ENGINE_FILE).write_bytes(bytes(serialized))
        cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
        metadata = EngineMetadata(
            backend=self.name, engine_file=ENGINE_FILE, source_onnx=str(onnx_path),
            source_sha256=file_sha256(onnx_path), precision=precision, compute_precision=compute,
            label=engine_label(self.name, "", compute),
            runtime_version=trt.__version__,
            device=self.device(), input_name=input_tensor.name,
            batch_profile=({"min": settings.min_batch, "opt": settings.opt_batch, "max": settings.max_batch}
                           if dla is None else dict.fromkeys(("min", "opt", "max"), dla.batch)),
            extra={"workspace_mb": settings.workspace_mb, "timing_cache": TIMING_CACHE_FILE,
                   **({"nms": {"layer": "INMSLayer", "confidence_threshold": decoding.confidence_threshold,
                               "nms_iou": decoding.nms_iou, "top_k": decoding.top_k,
                               "max_detections": decoding.max_detections}}
                      if decoding else {})},
        )
        metadata.write(folder)
        return metadata

    def load(self, folder: Path, metadata: EngineMetadata) -> EngineRunner:
        trt = _import_tensorrt()
        device = gpu_name()
        if metadata.runtime_version != trt.__version__ or metadata.device != device:
            raise ModelFileError(
                f"{folder}: engine built with TensorRT {metadata.runtime_version} for {metadata.device}; this "
                f"machine has TensorRT {trt.__version__} and {device or 'no GPU'}. TensorRT engines only run "
                "where they were built: rebuild it here with `qatpipe build-engine`")
        return TensorRTRunner((folder / metadata.engine_file).read_bytes(), metadata)
