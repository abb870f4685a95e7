"""The sections of the stages after the model: augmentation, training, pruning, retraining, QAT, PTQ, layer
sensitivity, export, engine, pretraining, validation and tracking."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, model_validator

from qatpipe.spec.base import Section
from qatpipe.spec.registries import BACKENDS


class AugmentationSpec(Section):
    hflip_prob: float = Field(0.5, ge=0, le=1)
    scale_min: float = Field(0.8, gt=0, description="zoom jitter: image scaled by a factor in [min, max]")
    scale_max: float = Field(1.25, gt=0)
    translate: float = Field(0.1, ge=0, le=0.5, description="max shift as a fraction of the image size")
    brightness: float = Field(0.15, ge=0, le=1)
    contrast: float = Field(0.2, ge=0, le=1)
    saturation: float = Field(0.2, ge=0, le=1)
    hue: float = Field(0.03, ge=0, le=0.5)
    min_visible_fraction: float = Field(
        0.5, ge=0, le=1, description="boxes cut by the crop to less than this fraction of their area are dropped"
    )

    @model_validator(mode="after")
    def _check_scale(self) -> "AugmentationSpec":
        if self.scale_min > self.scale_max:
            raise ValueError(f"scale_min ({self.scale_min}) > scale_max ({self.scale_max})")
        return self


# --------------------------------------------------------------------------------------------- training


class LearningRateSpec(Section):
    """TAO's soft-start annealing schedule: log-linear ramp min->max, plateau, log-linear decay to min."""

    min_lr: float = Field(1e-5, gt=0)
    max_lr: float = Field(2e-3, gt=0)
    soft_start: float = Field(0.1, ge=0, lt=1, description="fraction of training spent ramping up")
    annealing_point: float = Field(0.6, gt=0, le=1, description="fraction of training where decay starts")

    @model_validator(mode="after")
    def _check_order(self) -> "LearningRateSpec":
        if self.min_lr > self.max_lr:
            raise ValueError(f"min_lr ({self.min_lr}) > max_lr ({self.max_lr})")
        if self.soft_start > self.annealing_point:
            raise ValueError(f"soft_start ({self.soft_start}) > annealing_point ({self.annealing_point})")
        return self


class TrainSpec(Section):
    epochs: int = Field(6, ge=1)
    batch_size: int = Field(16, ge=1)
    seed: int = 42
    optimizer: Literal["adam", "sgd"] = "adam"
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum / Adam beta_1")
    learning_rate: LearningRateSpec = Field(default_factory=LearningRateSpec)
    checkpoint_interval: int = Field(1, ge=1, description="epochs between checkpoints")
    keep_checkpoints: int = Field(3, ge=1)
    validation_interval: int = Field(
        1, ge=0, description="epochs between validations on dataset.val during training (TAO's "
        "validation_period_during_training): val loss, mAP@0.5 and mAP@[.5:.95] as `evaluate` scores them, into "
        "training_log.csv and MLflow; the last epoch is always validated; 0: off (docs/design/recipe-notes.md: why "
        "every epoch by default)")
    val_images: int | None = Field(
        300, ge=1, description="dataset.val images (a fixed seeded sample, the same every epoch and in every training "
        "stage) that validation during training scores; null: all of them. The final evaluations (evaluate, "
        "validate, compare) always score all of dataset.val")
    keep: Literal["best", "last"] = Field(
        "best", description="which weights become model.keras: those of the epoch with the best val mAP@0.5 "
        "(ties: the later epoch), or the last epoch's; without validation, the last")
    use_amp: Union[bool, Literal["auto"]] = Field(
        "auto", description="mixed precision: true: float16 on a GPU, bfloat16 on a CPU with AMX-BF16 or "
        "AVX512-BF16, else FP32 with a warning; auto: float16 on a GPU, bfloat16 only on a CPU with AMX-BF16 (1.65x "
        "float32's training speed on a 2-core Xeon, the default run's mAP unchanged within its CI: bench/README.md), "
        "else FP32; false: FP32 (training/precision.py; docs/scale-out.md). QAT always trains in FP32")
    log_every_n_steps: int = Field(25, ge=1)


class EvaluateSpec(Section):
    batch_size: int = Field(32, ge=1)


# ---------------------------------------------------------------- later stages (room kept, typed now)


class PruneSpec(Section):
    threshold: float = Field(0.1, ge=0, description="TAO's -pth: channels whose normalised norm is below it go, "
                             "when target_flops_ratio is null (a section giving a threshold and no "
                             "target_flops_ratio sets it null)")
    target_flops_ratio: float | None = Field(
        0.5, gt=0, le=1, description="instead of `threshold`: the lowest threshold that leaves at most this "
        "share of the model's FLOPs (the same threshold prunes models trained on other data to very different "
        "sizes); the threshold it found is in prune_report.json; null: prune at `threshold`")
    normalizer: Literal["max", "L2"] = "max"
    granularity: int = Field(8, ge=1)
    min_filters: int = Field(16, ge=1)
    equalization: Literal["union", "intersection", "arithmetic_mean", "geometric_mean"] = Field(
        "arithmetic_mean", description="how the channel scores of layers joined by an add are combined (TAO)")
    excluded_layers: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _threshold_given(cls, data: Any) -> Any:
        # a threshold written without a FLOPs target means that threshold (as `qatpipe prune -pth` does), not
        # the default target's
        if isinstance(data, dict) and "threshold" in data and "target_flops_ratio" not in data:
            data = {**data, "target_flops_ratio": None}
        return data


class RetrainSpec(Section):
    """Retraining of the pruned model (FP32 and QAT): the train section's settings, except these."""

    epochs: int | None = Field(3, ge=1, description="the FP32 retrain's epochs (and QAT's under qat.start "
                               "pruned); null: train.epochs")


class QatSpec(Section):
    """Quantization-aware training for TensorRT (quantization/rules.py documents each placement rule)."""

    enabled: bool = Field(False, description="retrain with fake quantization (TAO's enable_qat)")
    start: Literal["pruned", "fp32", "baseline"] = Field(
        "baseline", description="where QAT starts. baseline (the default; the textbook order, PyTorch's and "
        "TensorRT's QAT guides): the FP32 baseline is the FP32 retrain's model fine-tuned for finetune_epochs, and "
        "QAT fine-tunes that baseline itself, briefly (epochs, learning_rate), so PTQ and QAT quantize the same FP32 "
        "weights; retrain-qat waits for finetune-fp32. fp32 (NVIDIA's QAT toolkit's order): QAT fine-tunes the FP32 "
        "retrain's model beside the baseline, as long, so both have had the same training. pruned (TAO's order): the "
        "pruned model, for retrain.epochs, like the FP32 retrain, which is then the baseline (docs/quantization.md: "
        "the orders measured)")
    finetune_epochs: int | None = Field(
        0, ge=0, description="start: fp32 and baseline: the epochs of the FP32 baseline's fine-tuning (under fp32 "
        "also of the QAT fine-tuning beside it); null: retrain.epochs. 0 (start: baseline only; the default, and "
        "a section naming another start without finetune_epochs gets null): no second FP32 training, the FP32 "
        "retrain's model is the baseline that PTQ quantizes and QAT fine-tunes")
    finetune_learning_rate: LearningRateSpec | None = Field(
        None, description="start: fp32 and baseline: the learning-rate schedule of the FP32 baseline's fine-tuning "
        "(under fp32 also of the QAT fine-tuning beside it; they start from a trained model, which "
        "train.learning_rate's peak first knocks back; bench/README.md finetune.py: shorter, gentler fine-tunings "
        "lost mAP). Default train.learning_rate; keys left out of it take the schedule's own defaults, not train's")
    epochs: int = Field(1, ge=1, description="start: baseline: the epochs QAT fine-tunes the FP32 baseline "
                        "(PyTorch's and NVIDIA's QAT guides: a small fraction of the training)")
    learning_rate: LearningRateSpec = Field(
        default_factory=lambda: LearningRateSpec(min_lr=1e-6, max_lr=2e-4, soft_start=0.1, annealing_point=0.6),
        description="start: baseline: the learning-rate schedule of that QAT fine-tuning (a converged model: about "
        "a tenth of the default train.learning_rate's peak; the guides: 1-10% of the training's)")
    calibration_batches: int = Field(8, ge=1, description="training batches that initialise activation ranges")
    ema_decay: float = Field(0.999, ge=0, lt=1, description="moving average of activation ranges in training")
    bn_update_epochs: int | None = Field(
        None, ge=0, description="BatchNormalization updates its moving statistics in the first N epochs of the QAT "
        "retrain only; after them it normalises with those statistics, as the exported model does, while its scale "
        "and offset keep training (PyTorch's freeze_bn_stats; torchvision's QAT recipe: 3). None: every epoch "
        "(quantization/freeze.py)")
    range_update_epochs: int | None = Field(
        None, ge=0, description="activation ranges follow their moving average (ema_decay) in the first N epochs "
        "of the QAT retrain only; after them they stay as they are (PyTorch's disable_observer; torchvision's QAT "
        "recipe: 4). None: every epoch; 0: the calibrated ranges throughout")
    excluded_layers: Union[Literal["auto"], list[str]] = Field(
        default_factory=list, description="layer names kept in float; or auto: the layers partial PTQ keeps float "
        "in the FP32 model QAT starts from (its PTQ, that model's layer sensitivity, then ptq.keep_float auto's "
        "search to validate.max_map_drop; stages/retrain.py, docs/quantization.md), resolved by the QAT retrain")
    excluded_layer_types: list[str] = Field(default_factory=list, description="layer classes kept in float, e.g. Dense")
    quantize_outputs: list[str] = Field(
        default_factory=list, description="model outputs given Q/DQ too; none by default (TAO: a quantized bbox "
        "output ruins detection)")
    relu6: bool = Field(False, description="replace ReLU by ReLU6 before QAT (TAO-style)")
    distill_weight: float = Field(
        0.0, ge=0, description="distillation during QAT: the weight of a loss that pulls the QAT model's outputs "
        "towards those of its FP32 teacher, added to the task loss. The teacher is the model QAT starts from (start "
        "fp32: the FP32 retrain's; start baseline: the FP32 baseline; start pruned: the pruned model), frozen, run "
        "in inference mode on the same augmented batch; train time only, the exported model is unchanged. 0: off, "
        "the default until a bench/ "
        "measurement decides (docs/quantization.md: Distillation)")

    @model_validator(mode="before")
    @classmethod
    def _start_given(cls, data: Any) -> Any:
        # the default finetune_epochs 0 belongs to the default start; another start, written without it,
        # fine-tunes for retrain.epochs as it always did
        if isinstance(data, dict) and data.get("start", "baseline") != "baseline" and "finetune_epochs" not in data:
            data = {**data, "finetune_epochs": None}
        return data

    @model_validator(mode="after")
    def _check_finetune(self) -> "QatSpec":
        if self.finetune_epochs == 0 and self.start != "baseline":
            raise ValueError(f"finetune_epochs 0 (no FP32 fine-tuning) needs start: baseline; under start {self.start} "
                             "QAT fine-tunes for finetune_epochs too")
        return self


class PtqSpec(Section):
    """Post-training quantization of the FP32 model (the baseline QAT must beat): Q/DQ format, symmetric int8
    activations and per-channel weights, by ONNX Runtime's static quantization or NVIDIA Model Optimizer's ONNX
    quantizer (`tool`)."""

    tool: Literal["onnxruntime", "modelopt"] = Field(
        "onnxruntime", description="onnxruntime: ONNX Runtime's quantize_static; "
        "modelopt: NVIDIA Model Optimizer's ONNX INT8 PTQ (modelopt.onnx.quantization), TensorRT's own tooling, "
        "calibrated on CPU in its own environment (quantization/modelopt_ptq.py; `make modelopt`)")
    calibration_images: int = Field(200, ge=1, description="training images the ranges are calibrated on")
    method: Optional[Literal["entropy", "percentile", "minmax"]] = Field(
        None, description="the calibration method; unset: the tool's default, percentile for onnxruntime, entropy "
        "for modelopt (TensorRT's calibrator; modelopt has no percentile); docs/quantization.md: why")
    percentile: float = Field(99.99, gt=90, le=100, description="for method: percentile")
    seed: int = 0
    report_images: int = Field(16, ge=0, description="calibration images of the precision report (FP16 flags, "
                               "the INT8 model against FP32 layer by layer); 0: no report")
    keep_float: Union[Literal["auto"], list[str]] = Field(
        "auto", description="the ptq-partial variant (stages/ptq_partial.py): layers of the PTQ model kept float. "
        "auto: the most sensitive (the sensitivity stage's ranking, then the layers it did not score), fewest "
        "first, until the model scores within validate.max_map_drop of FP32 on the sensitivity val sample; or a "
        "list of layer / ONNX node names")

    @model_validator(mode="after")
    def _check_method(self) -> "PtqSpec":
        if self.tool == "modelopt" and self.method == "percentile":
            raise ValueError("tool modelopt calibrates by entropy or minmax (its 'max'); it has no percentile method")
        return self

    @property
    def calibration_method(self) -> str:
        """`method`, or the tool's default when it is unset."""
        return self.method or PTQ_DEFAULT_METHODS[self.tool]


PTQ_DEFAULT_METHODS = {"onnxruntime": "percentile", "modelopt": "entropy"}


class SensitivitySpec(Section):
    """Layer sensitivity of a Q/DQ model (`qatpipe sensitivity`; quantization/sensitivity.py, docs/sensitivity.md):
    per quantizable layer, the mAP@0.5 drop with only it INT8 and with every layer but it INT8."""

    val_images: int = Field(100, ge=1, description="dataset.val images (a seeded sample) every variant is scored "
                            "on; two variants per layer, so the time grows with layers x images")
    max_layers: int = Field(32, ge=1, description="score at most this many layers: where the model has more, those "
                            "whose quantizers (input, weight, output requantization) add the most noise on one "
                            "batch")
    layers: list[str] = Field(default_factory=list, description="the layers to score, by ONNX node name (or the "
                              "layer name the report shows); empty: every quantizable layer")
    seed: int = 0


class ExportSpec(Section):
    opset: int = Field(17, ge=13)
    calibration_cache_trt_version: int = Field(
        100300, description="TensorRT version in the QAT calibration cache header, as NV_TENSORRT_VERSION "
        "(10.3.0 -> 100300, DeepStream 7.1; 8.6.1 -> 8601)")
    fp16_onnx: bool = Field(
        True, description="also write <stem>_fp16.onnx: the float regions in FP16 through explicit casts (the only "
        "FP16 a strongly typed TensorRT 11 build has), the output tail after the last compute layer and every tensor "
        "the FP16 guard flags kept FP32; with "
        "precision_report.json/.md beside it")
    fp16_images: int = Field(16, ge=1, description="training images (a seeded sample) the FP16 guard records "
                             "ranges on and the FP16 form is compared on, layer by layer")
    target: Literal["gpu", "dla"] = Field(
        "gpu", description="dla: the QAT export also writes <stem>_dla.onnx (fixed batch, NCHW input) and "
        "<stem>_dla.cache, a scale for every tensor (the QAT model's where it has them, the rest calibrated: TAO's "
        "force_ptq), and dla_report.md (which layers fall back to the GPU, and why); engines on TensorRT 10 are "
        "then built for Jetson Orin's DLA (export/dla.py)")
    dla_batch: int = Field(1, ge=1, description="target dla: the fixed batch of the DLA form (DLA has no dynamic "
                           "shapes; DeepStream's batch-size)")
    dla_calibration_images: int = Field(64, ge=1, description="target dla: training images (a seeded sample) the "
                                        "tensors without a QAT scale are calibrated on")
    dla_calibration_method: Literal["percentile", "entropy", "minmax"] = Field(
        "percentile", description="target dla: how those tensors are calibrated (ONNX Runtime's calibrator, as "
        "PTQ; percentile at PTQ's default 99.99th; docs/deployment.md: why)")


class EngineBenchSpec(Section):
    """The latency harness (`qatpipe bench-engine`): the same for every backend."""

    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8], min_length=1)
    warmup: int = Field(10, ge=0, description="untimed runs first")
    iterations: int = Field(50, ge=1, description="timed runs, at least")
    min_seconds: float = Field(2.0, ge=0, description="and at least this long")


class EngineSpec(Section):
    """Engine build: TensorRT with a GPU, ONNX Runtime anywhere (`auto` picks)."""

    backend: str = Field("auto", description="auto, or a backend of spec/registries.py's BACKENDS (tensorrt, "
                                             "onnxruntime)")
    min_batch: int = Field(1, ge=1, description="TensorRT optimisation profile for the dynamic batch")
    opt_batch: int = Field(8, ge=1)
    max_batch: int = Field(16, ge=1)
    workspace_mb: int = Field(2048, ge=64, description="TensorRT builder workspace limit")
    fp16: bool = Field(True, description="the FP32 model in FP16 on TensorRT 10 (TensorRT 11: TF32)")
    dla_core: int = Field(0, ge=0, description="an export for DLA (export.target: dla): the DLA core TensorRT and "
                          "DeepStream use (Orin has two: 0 and 1)")
    gpu_fallback: bool = Field(True, description="an export for DLA: layers DLA cannot run go to the GPU (off: "
                               "the build fails on them)")
    cpu_form: Literal["auto", "exact", "fast"] = Field(
        "auto", description="ONNX Runtime CPU engine of a Q/DQ model: fast (BN folded, ReLU absorbed: integer "
        "kernels; graph/cpu_qdq.py) or exact (TensorRT's numbers, mostly float kernels); auto: fast where the "
        "CPU's int8 dot products cannot saturate (VNNI, AMX; not an x86 CPU), else exact; validate scores a fast "
        "engine's exact form too, as map50_tensorrt_emulated")
    bench: EngineBenchSpec = Field(default_factory=EngineBenchSpec)

    @model_validator(mode="after")
    def _check_profile(self) -> "EngineSpec":
        if not self.min_batch <= self.opt_batch <= self.max_batch:
            raise ValueError(f"engine: need min_batch <= opt_batch <= max_batch, got {self.min_batch}, "
                             f"{self.opt_batch}, {self.max_batch}")
        return self

    @model_validator(mode="after")
    def _check_backend(self) -> "EngineSpec":
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not an engine backend: one of auto, {', '.join(BACKENDS)}")
        return self


class PretrainSpec(Section):
    """qatpipe pretrain: the backbone trained as a classifier of object crops (and background crops) or of a
    class-per-folder image tree; model.pretrained takes the weights it writes (stages/pretrain.py,
    docs/pretrain.md)."""

    data: list[str] = Field(
        default_factory=list, description="KITTI folders (each labelled object cropped) or class-per-folder image "
        "trees, local or s3://; empty: the spec's dataset.train")
    crop_size: int = Field(64, ge=32, multiple_of=32, description="crops are resized to this square, a multiple "
                           "of 32")
    crop_margin: float = Field(0.1, ge=0, le=1, description="an object's box grows by this fraction of its width "
                               "and height on each side before it is cropped (context around the object)")
    min_box_size: float = Field(8.0, ge=1, description="objects whose box has a side shorter than this (pixels) "
                                "are not cropped")
    background_crops: int = Field(1, ge=0, description="random crops per KITTI image, class `background`, each of "
                                  "the size of one of the data set's objects and overlapping no labelled box")
    background_max_iou: float = Field(0.1, ge=0, lt=1, description="a background crop's largest IoU with any "
                                      "labelled box")
    epochs: int = Field(8, ge=1)
    batch_size: int = Field(64, ge=1)
    learning_rate: float = Field(1e-3, gt=0, description="Adam's peak learning rate, in train's soft-start "
                                 "annealing schedule: up from 1/100 of it over the first 10% of the steps, down "
                                 "again from 70%")
    val_fraction: float = Field(0.1, gt=0, lt=1, description="share of the images whose crops are held back for "
                                "the top-1 figure")
    use_amp: bool = Field(False, description="mixed precision, as train.use_amp")
    seed: int = 0


class ValidateSpec(Section):
    max_map_drop: float = Field(0.01, ge=0, description="largest allowed mAP@0.5 drop vs FP32 (0.01 = 1 point)")


class TrackingSpec(Section):
    experiment: str = "qatpipe"
    registered_model: str | None = Field(None, description="MLflow registry name of the validated model; None: "
                                                           "qatpipe-<model.arch> (qatpipe-detectnet-v2, qatpipe-ssd)")
    champion_alias: str = Field("champion", pattern=r"^[A-Za-z][\w-]*$",
                                description="registry alias of the QAT version that passed the gate (the one it "
                                            "replaces keeps previous-<alias>; a failed one gets rejected)")
