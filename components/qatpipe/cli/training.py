"""`qatpipe train | pretrain | evaluate | retrain | prune`: the stages that run or reshape a Keras model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qatpipe.cli.common import (add_overrides, add_spec_args, at_least, check_folders, check_model, load_spec,
                                log, with_data)
from qatpipe.errors import QatpipeError


def add_commands(sub) -> None:
    train = sub.add_parser("train", help="train the spec's detector (FP32; resumes from checkpoints)")
    add_spec_args(train)
    _add_training_args(train)
    train.set_defaults(func=cmd_train, writes=lambda a: a.results_dir)

    pretrain = sub.add_parser(
        "pretrain", help="pretrain the spec's backbone as a classifier of object crops or image folders "
        "(model.pretrained takes RESULTS/weights.keras)",
        description="Settings: the spec's `pretrain` section (data, crop_size, epochs, ...); docs/pretrain.md.")
    add_spec_args(pretrain, "--spec")
    pretrain.add_argument("-r", "--results-dir", "-o", "--output", dest="results_dir", required=True, type=Path,
                          help="weights.keras, classes.json, pretrain_summary.json, pretrain_log.csv go here")
    pretrain.add_argument("--use-amp", action="store_true",
                          help="mixed precision (pretrain.use_amp): float16 on a GPU, bfloat16 on a CPU with "
                               "AMX/AVX512-BF16")
    pretrain.set_defaults(func=cmd_pretrain, check=check_pretrain, writes=lambda a: a.results_dir)

    evaluate = sub.add_parser("evaluate", help="mAP of a model (.keras in TensorFlow, .onnx in ONNX Runtime)")
    add_spec_args(evaluate)
    evaluate.add_argument("-m", "--model", required=True, type=Path, help="a .keras or .onnx file, or an engine "
                          "folder")
    evaluate.add_argument("-o", "--output-dir", type=Path, help="default: MODEL_DIR/evaluate")
    evaluate.set_defaults(func=cmd_evaluate, check=lambda a: check_model(a.model, "any"), writes=_evaluation_folder)

    retrain = sub.add_parser("retrain", help="retrain a pruned model, FP32 or QAT (resumes from checkpoints)",
                             description="Epochs: retrain.epochs (default train.epochs), with --finetune "
                                         "qat.finetune_epochs, with --baseline qat.epochs; QAT: the qat section.")
    add_spec_args(retrain)
    retrain.add_argument("-m", "--model", required=True, type=Path, help="the pruned model (.keras)")
    _add_training_args(retrain)
    retrain.add_argument("--qat", action="store_true",
                         help="quantization-aware training for TensorRT INT8 (sets qat.enabled)")
    retrain.add_argument("--finetune", action="store_true",
                         help="-m is the FP32 retrain's model, fine-tuned as the pipeline's qat.start fp32 does (with "
                              "--qat, and in FP32 as its baseline): for qat.finetune_epochs under "
                              "qat.finetune_learning_rate")
    retrain.add_argument("--baseline", action="store_true",
                         help="with --qat: -m is the FP32 baseline, which QAT fine-tunes briefly as the pipeline's "
                              "qat.start baseline does: for qat.epochs under qat.learning_rate")
    retrain.set_defaults(func=cmd_retrain, check=check_retrain, writes=lambda a: a.results_dir)

    _add_prune_command(sub)


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    """What train and retrain share: the results folder, AMP and the Horovod processes."""
    parser.add_argument("-r", "--results-dir", required=True, type=Path)
    parser.add_argument("--use-amp", action="store_true",
                        help="mixed precision: float16 on a GPU, bfloat16 on a CPU with AMX/AVX512-BF16")
    parser.add_argument("--gpus", type=at_least(1), default=1, metavar="N",
                        help="data-parallel Horovod processes on this host, one per GPU (TAO's --gpus); "
                             "without GPUs, N CPU processes")
    parser.add_argument("--horovod-controller", choices=("gloo", "mpi"), default="gloo",
                        help="how horovodrun starts and connects the processes (default gloo)")
    parser.add_argument("--stage-name", metavar="NAME",
                        help="the name of the tracking record and the live MLflow curves (the pipeline's "
                             "finetune_fp32); default: train, retrain_fp32 or retrain_qat")


def _horovod_launch(args) -> int | None:
    """With --gpus N > 1, run this command as N Horovod processes and return their exit code; None when this
    process should train itself (a single process, or one of the N)."""
    from qatpipe.training.distributed import launch, launched_by_horovod

    if args.gpus == 1 or launched_by_horovod():
        return None
    return launch(args.gpus, args.argv, args.horovod_controller)


def cmd_train(args) -> int:
    from qatpipe.stages.train import train

    spec = with_data(args)  # once, before any Horovod processes: they find the data set it may generate
    if (code := _horovod_launch(args)) is not None:
        return code
    summary = train(spec, args.results_dir, use_amp=True if args.use_amp else None,
                    stage_name=args.stage_name or "train")
    log.info("training done: %s", json.dumps({k: summary[k] for k in ("model", "images_per_second", "wall_seconds")}))
    return 0


def check_pretrain(args) -> None:
    """The folders it crops (pretrain.data's, else dataset.train's), as the stage names them."""
    spec = load_spec(args)
    entries = [(f"pretrain.data[{index}]", where) for index, where in enumerate(spec.pretrain.data)]
    check_folders(entries or [("dataset.train", spec.dataset.train)], "data set folder")


def cmd_pretrain(args) -> int:
    from qatpipe.data.prepare import with_default_dataset
    from qatpipe.stages.pretrain import pretrain

    spec = load_spec(args)
    if not spec.pretrain.data:  # dataset.train's crops: a spec naming no data set gets its synthetic one, as train
        spec = with_default_dataset(spec)
    summary = pretrain(spec, args.results_dir, use_amp=True if args.use_amp else None)
    print(f"{summary['weights']}  {summary['backbone']}  val top-1 {summary['top1']:.4f} on {summary['val_crops']} "
          f"crops (chance {summary['chance']:.4f})  {summary['num_classes']} classes, {summary['crops']} crops of "
          f"{summary['images']} images")  # the answer, for scripts
    return 0


def cmd_evaluate(args) -> int:
    from qatpipe.stages.evaluate import evaluate

    result = evaluate(with_data(args), args.model, args.output_dir)
    log.info("metrics: %s", result["metrics_file"])
    print(f"mAP@0.5 {result['map50']:.4f}  mAP@[.5:.95] {result['map']:.4f}")  # the answer, for scripts
    return 0


def _evaluation_folder(args) -> Path:
    """Where `evaluate` writes (the stage's default: beside the model, or inside an engine folder)."""
    return args.output_dir or (args.model if args.model.is_dir() else args.model.parent) / "evaluate"


def check_retrain(args) -> None:
    """The flags and the model before any data is made."""
    if args.baseline and (args.finetune or not args.qat):
        raise QatpipeError("--baseline is QAT's fine-tuning of the FP32 baseline: give --qat, not --finetune, with it")
    if args.finetune and not args.qat and load_spec(args).qat.finetune_epochs == 0:
        raise QatpipeError("--finetune: qat.finetune_epochs is 0 in this spec, so its FP32 baseline is the FP32 "
                           "retrain's model itself and there is nothing to fine-tune; give `retrain --qat "
                           "--baseline` that model, or --set qat.finetune_epochs=N to fine-tune it anyway")
    check_model(args.model, "keras")


def cmd_retrain(args) -> int:
    from qatpipe.stages.retrain import retrain

    spec = with_data(args)  # once, before any Horovod processes: they find the data set it may generate
    if (code := _horovod_launch(args)) is not None:
        return code
    if args.qat:
        spec.qat.enabled = True
    stage_name = args.stage_name
    if args.finetune or args.baseline:  # the fine-tunings of qat.start fp32, or QAT's of qat.start baseline
        from qatpipe.stages.retrain_plan import plan_retrain

        start = "baseline" if args.baseline else "fp32"
        plan = plan_retrain(spec.model_copy(update={"qat": spec.qat.model_copy(update={"start": start})}),
                            spec.qat.enabled, args.model, args.model, args.model)
        spec, stage_name = plan.applied(spec), stage_name or plan.stage_name
    summary = retrain(spec, args.model, args.results_dir, use_amp=True if args.use_amp else None,
                      stage_name=stage_name)
    log.info("retraining done: %s", json.dumps({k: summary[k] for k in ("model", "params", "wall_seconds")}))
    return 0


PRUNE_FLAGS = ("threshold", "target_flops_ratio", "normalizer", "granularity", "min_filters", "equalization")


def _add_prune_command(sub) -> None:
    """`qatpipe prune`: TAO's flags over the spec's prune section."""
    from qatpipe.spec import PruneSpec, field_choices

    prune = sub.add_parser("prune", help="structured pruning of a trained model (TAO `prune`)",
                           description="Settings: the spec's `prune` section (-e), overridden by the flags.")
    prune.add_argument("-m", "--model", required=True, type=Path, help="trained model (.keras)")
    prune.add_argument("-o", "--output", required=True, type=Path,
                       help="output folder, or a .keras file (the report goes beside it)")
    prune.add_argument("-e", "--experiment-spec", help="spec for defaults and model checks (optional)")
    add_overrides(prune)
    prune.add_argument("-pth", "--threshold", type=float, help="normalised filter norm below which it goes")
    prune.add_argument("--target-flops-ratio", dest="target_flops_ratio", type=float,
                       help="instead of -pth: the lowest threshold leaving at most this share of the FLOPs")
    prune.add_argument("-n", "--normalizer", choices=field_choices(PruneSpec, "normalizer"))
    prune.add_argument("-pg", "--granularity", type=int, help="kept filters are a multiple of this")
    prune.add_argument("-nf", "--min-filters", dest="min_filters", type=int, help="never fewer filters than this")
    prune.add_argument("-eq", "--equalization",
                       choices=field_choices(PruneSpec, "equalization"),
                       help="how convs joined by a residual add agree on their channels")
    prune.add_argument("-el", "--excluded-layers", nargs="+", metavar="LAYER", help="layers never pruned")
    prune.set_defaults(func=cmd_prune, check=check_prune,
                       writes=lambda a: a.output.parent if a.output.suffix == ".keras" else a.output)


def check_prune(args) -> None:
    """The model, and the spec's prune section under the flags (args.prune_settings), before any work."""
    from pydantic import ValidationError

    from qatpipe.spec import PruneSpec, format_validation_error

    settings = load_spec(args).prune.model_dump() if args.experiment_spec else {}
    for key in PRUNE_FLAGS:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.threshold is not None and args.target_flops_ratio is None:
        settings["target_flops_ratio"] = None  # -pth given: TAO's threshold, not the spec's FLOPs budget
    if args.excluded_layers:
        settings["excluded_layers"] = args.excluded_layers
    try:
        args.prune_settings = PruneSpec(**settings)
    except ValidationError as exc:
        raise QatpipeError(f"prune settings: {format_validation_error(exc)}") from None
    check_model(args.model, "keras")


def cmd_prune(args) -> int:
    from qatpipe.models import get_architecture
    from qatpipe.stages.prune import prune

    arch = get_architecture(load_spec(args)) if args.experiment_spec else None
    result = prune(args.model, args.output, args.prune_settings, arch=arch)
    print(f"params {result['params_before']} -> {result['params_after']}  "
          f"FLOPs {result['flops_before'] / 1e9:.3f} G -> {result['flops_after'] / 1e9:.3f} G "
          f"(x{result['flops_ratio']:.3f})")
    return 0
