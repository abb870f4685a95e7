"""`qatpipe` command line: TAO-like verbs over the stage functions."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import qatpipe  # noqa: F401 - sets TF_USE_LEGACY_KERAS before TensorFlow loads
from qatpipe.errors import QatpipeError

log = logging.getLogger("qatpipe")


def _load(args):
    """The spec of -e/--set; a spec naming no data set gets its synthetic one (made once, then cached). Every verb
    that runs a stage resolves it the same way, whether or not it reads images (export's FP16 guard and DLA
    calibration read training images), so `-e default` means the same data set to all of them."""
    from qatpipe.data.prepare import with_default_dataset
    from qatpipe.spec_sources import load_spec_uri

    return with_default_dataset(load_spec_uri(args.experiment_spec, args.overrides))


def _add_spec_args(parser: argparse.ArgumentParser, *aliases: str) -> None:
    parser.add_argument("-e", "--experiment-spec", *aliases, required=True,
                        help="spec YAML file, s3://bucket/key, or a bundled spec name (default, full, tiny)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec key, e.g. --set train.epochs=5 (repeatable)")


def _add_model_conversion_args(parser: argparse.ArgumentParser, model_help: str, output_help: str) -> None:
    """-e/--set, then -m MODEL -o OUTPUT: the shape of the commands that turn one model file into another."""
    _add_spec_args(parser)
    parser.add_argument("-m", "--model", required=True, type=Path, help=model_help)
    parser.add_argument("-o", "--output", required=True, type=Path, help=output_help)


def cmd_data_synth(args) -> int:
    from qatpipe.data.synth import write_synthetic_dataset

    summary = write_synthetic_dataset(
        args.out, args.train, args.val, args.seed, image_height=args.height, image_width=args.width,
        overwrite=args.overwrite, object_height_px=tuple(args.object_height) if args.object_height else None,
        kind=args.kind,
    )
    log.info("synthetic dataset written to %s: %s", args.out, json.dumps(summary))
    return 0


def cmd_data_upload(args) -> int:
    """Push a local data set to S3 for the cluster path; with -e, its train/ and val/ are first checked as the
    pipeline will read them (KITTI layout, labels, the spec's classes), so a bad file fails here."""
    from qatpipe.data.storage import parse_s3_uri, upload_dir

    parse_s3_uri(args.to)  # a wrong destination fails before the data set is read
    if args.experiment_spec:
        from qatpipe.data.prepare import spec_with_prepared_dataset
        from qatpipe.data.splits import load_split
        from qatpipe.spec_sources import load_spec_uri

        spec = spec_with_prepared_dataset(load_spec_uri(args.experiment_spec, args.overrides), args.src,
                                          {"train": "train", "val": "val"})
        for split in ("train", "val"):
            log.info("%s: %d images checked", split, len(load_split(spec, split)))
    count = upload_dir(args.src, args.to)
    print(f"{count} files uploaded to {args.to} (dataset.train: {args.to.rstrip('/')}/train, dataset.val: "
          f"{args.to.rstrip('/')}/val)")
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: need at least 1")
    return value


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    """What train and retrain share: the results folder, AMP and the Horovod processes."""
    parser.add_argument("-r", "--results-dir", required=True, type=Path)
    parser.add_argument("--use-amp", action="store_true", help="mixed precision: float16 on a GPU, bfloat16 on a CPU with AMX/AVX512-BF16")
    parser.add_argument("--gpus", type=_at_least_one, default=1, metavar="N",
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

    spec = _load(args)  # once, before any Horovod processes: they find the data set it may generate
    if (code := _horovod_launch(args)) is not None:
        return code
    summary = train(spec, args.results_dir, use_amp=True if args.use_amp else None,
                    stage_name=args.stage_name or "train")
    log.info("training done: %s", json.dumps({k: summary[k] for k in ("model", "images_per_second", "wall_seconds")}))
    return 0


def cmd_pretrain(args) -> int:
    from qatpipe.data.prepare import with_default_dataset
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe.stages.pretrain import pretrain

    spec = load_spec_uri(args.experiment_spec, args.overrides)
    if not spec.pretrain.data:  # dataset.train's crops: a spec naming no data set gets its synthetic one, as train
        spec = with_default_dataset(spec)
    summary = pretrain(spec, args.results_dir, use_amp=True if args.use_amp else None)
    print(f"{summary['weights']}  {summary['backbone']}  val top-1 {summary['top1']:.4f} on {summary['val_crops']} "
          f"crops (chance {summary['chance']:.4f})  {summary['num_classes']} classes, {summary['crops']} crops of "
          f"{summary['images']} images")  # the answer, for scripts
    return 0


def cmd_evaluate(args) -> int:
    from qatpipe.stages.evaluate import evaluate

    result = evaluate(_load(args), args.model, args.output_dir)
    log.info("metrics: %s", result["metrics_file"])
    print(f"mAP@0.5 {result['map50']:.4f}  mAP@[.5:.95] {result['map']:.4f}")  # the answer, for scripts
    return 0


def _evaluation_folder(args) -> Path:
    """Where `evaluate` writes (the stage's default: beside the model, or inside an engine folder)."""
    return args.output_dir or (args.model if args.model.is_dir() else args.model.parent) / "evaluate"


def cmd_prune(args) -> int:
    from qatpipe.models import get_architecture
    from qatpipe.spec import PruneSpec
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe.stages.prune import prune

    spec = load_spec_uri(args.experiment_spec, args.overrides) if args.experiment_spec else None
    settings = spec.prune.model_dump() if spec else {}
    for key in ("threshold", "target_flops_ratio", "normalizer", "granularity", "min_filters", "equalization"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.threshold is not None and args.target_flops_ratio is None:
        settings["target_flops_ratio"] = None  # -pth given: TAO's threshold, not the spec's FLOPs budget
    if args.excluded_layers:
        settings["excluded_layers"] = args.excluded_layers
    try:
        prune_settings = PruneSpec(**settings)
    except ValueError as exc:
        log.error("prune settings: %s", exc)
        return 2
    result = prune(args.model, args.output, prune_settings, arch=get_architecture(spec) if spec else None)
    print(f"params {result['params_before']} -> {result['params_after']}  "
          f"FLOPs {result['flops_before'] / 1e9:.3f} G -> {result['flops_after'] / 1e9:.3f} G "
          f"(x{result['flops_ratio']:.3f})")
    return 0


def cmd_retrain(args) -> int:
    from qatpipe.stages.retrain import retrain

    if args.baseline and (args.finetune or not args.qat):
        raise QatpipeError("--baseline is QAT's fine-tuning of the FP32 baseline: give --qat, not --finetune, with it")
    if args.finetune and not args.qat:  # checked before _load makes any data
        from qatpipe.spec_sources import load_spec_uri

        if load_spec_uri(args.experiment_spec, args.overrides).qat.finetune_epochs == 0:
            raise QatpipeError("--finetune: qat.finetune_epochs is 0 in this spec, so its FP32 baseline is the FP32 "
                               "retrain's model itself and there is nothing to fine-tune; give `retrain --qat "
                               "--baseline` that model, or --set qat.finetune_epochs=N to fine-tune it anyway")
    spec = _load(args)  # once, before any Horovod processes: they find the data set it may generate
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


def cmd_export(args) -> int:
    from qatpipe.stages.export import export

    report = export(_load(args), args.model, args.output)
    worst = max(d["max_abs"] for d in report["difference_vs_tensorflow"].values())
    print(f"{report['onnx']}  opset {report['opset']}  {report['quantization']}  {report['size_mb']:.2f} MB  "
          f"max |TF - ORT| {worst:.1e}")
    return 0


def cmd_ptq(args) -> int:
    from qatpipe.stages.ptq import ptq

    report = ptq(_load(args), args.model, args.output)
    print(f"{report['onnx']}  PTQ {report['method']} on {report['calibration_images']} images  "
          f"{report['size_mb']:.2f} MB")
    return 0


def cmd_ptq_partial(args) -> int:
    from qatpipe.stages.ptq_partial import ptq_partial

    spec = _load(args)
    if args.keep_float:
        spec.ptq.keep_float = args.keep_float if args.keep_float != ["auto"] else "auto"
    report = ptq_partial(spec, args.fp32, args.model, args.output, args.sensitivity)
    print(f"{report['onnx']}  {len(report['float_layers'])} of {report['layers_total']} layers float  mAP@0.5 "
          f"{report['map50']:.4f} on {report['val_images']} val images (FP32 {report['map50_fp32']:.4f}, all INT8 "
          f"{report['map50_int8']:.4f}); budget {'met' if report['budget_met'] else 'NOT met'}")
    for node in report["float_layers"]:
        print(f"float: {node}")
    return 0


def cmd_sensitivity(args) -> int:
    from qatpipe.stages.sensitivity import JSON_FILE, sensitivity

    spec = _load(args)
    if args.layers:
        spec.sensitivity.layers = args.layers
    result = sensitivity(spec, args.model, args.output, fp32_onnx=args.fp32)
    log.info("report: %s", args.output / JSON_FILE)
    print(f"mAP@0.5 {result['map50_float']:.4f} float, {result['map50_int8']:.4f} INT8 on {result['val_images']} "
          f"images; {len(result['layers'])} of {result['layers_total']} layers, most sensitive first:")
    print("drop only INT8  drop all but  layer (ONNX node)")  # the answer, for scripts
    for row in result["layers"]:
        print(f"{100 * row['drop_only_int8']:+14.2f}  {100 * row['drop_all_but']:+12.2f}  {row['name']} "
              f"({row['node']})")
    return 0


def cmd_build_engine(args) -> int:
    from qatpipe.stages.build_engine import build_engine

    info = build_engine(_load(args), args.model, args.output, backend=args.backend)
    print(f"{args.output}  {info['backend']} {info['runtime_version']}  {info['precision']}  {info['device']}  "
          f"{info['engine_size_mb']:.2f} MB")
    return 0


def cmd_bench_engine(args) -> int:
    from qatpipe.stages.bench_engine import bench_engine

    report = bench_engine(_load(args), args.model, args.output)
    print(f"{args.model}: {report['backend']}, {report['precision']}, {report['device']}")
    print("batch  p50 ms   p95 ms   p99 ms   img/s")
    for row in report["batches"]:
        print(f"{row['batch_size']:<6} {row['latency_ms_p50']:<8.2f} {row['latency_ms_p95']:<8.2f} "
              f"{row['latency_ms_p99']:<8.2f} {row['throughput']:.1f}")
    print(f"model {report['model_size_mb']} MB, engine {report['engine_size_mb']} MB, peak memory "
          f"{report['peak_memory_mb']} MB")
    return 0


def cmd_validate(args) -> int:
    from qatpipe.stages.validate import validate

    report = validate(_load(args), args.model, args.baseline, args.output, variant=args.variant,
                      onnx_model=args.onnx)
    if not report["passed"]:
        return 1  # the stage has logged the gate's message
    print(f"{report['variant']}: PASSED  mAP@0.5 {report['map50']:.4f} (baseline {report['baseline_map50']:.4f}, "
          f"drop {100 * report['map50_drop']:+.2f} points, allowed {100 * report['max_map_drop']:.2f})")
    return 0


def cmd_run(args) -> int:
    from qatpipe.stages.compare import report
    from qatpipe_pipelines.local_run import SUMMARY_FILE, run_local

    summary = run_local(args.output, args.spec, args.overrides, run_name=args.run_name or "", runner=args.runner)
    log.info("summary: %s", args.output / SUMMARY_FILE)
    if "mlflow" in summary:
        log.info("MLflow: run %s in experiment %r at %s", summary["mlflow"]["run_id"],
                 summary["mlflow"]["experiment"], summary["mlflow"]["tracking_uri"])
    print(report(summary))  # the answer, for people and scripts
    return 0


def cmd_compile(args) -> int:
    from qatpipe_pipelines.submit import compile_pipeline

    if args.mpijob and not args.cache_pvc:
        raise QatpipeError("--mpijob needs --cache-pvc: the MPIJobs share their data and results through it")
    compile_pipeline(args.output, cache_pvc=args.cache_pvc, mpijob=args.mpijob, shm_size=args.shm_size)
    return 0


def cmd_submit(args) -> int:
    from qatpipe_pipelines.submit import parse_arguments, submit

    url = submit(args.host, parse_arguments(args.arguments), experiment=args.experiment,
                 namespace=args.namespace, run_name=args.run_name, package=args.package,
                 service_account=args.service_account)
    print(url)
    return 0


def cmd_compare(args) -> int:
    import os

    from qatpipe.stages.compare import comparisons_from_metrics, plot_variants, report
    from qatpipe.tracking.mlflow_runs import TRACKING_URI_ENV, MlflowTracker
    from qatpipe.tracking.registry import loading_snippet, pipeline_models

    uri = args.tracking_uri or os.environ.get(TRACKING_URI_ENV)
    if not uri:
        log.error("no MLflow server: set MLFLOW_TRACKING_URI or pass --tracking-uri")
        return 2
    tracker = MlflowTracker(uri)
    run_id = args.run_id or tracker.latest_pipeline_run(args.experiment)
    variants = tracker.read_variants(run_id)
    if not variants:
        log.error("MLflow run %s has no variant figures (did its compare stage run?)", run_id)
        return 2
    chart = plot_variants(variants, args.output)
    log.info("pipeline run %s; chart: %s", run_id, chart)
    print(report({"variants": variants, "comparisons": comparisons_from_metrics(tracker.read_comparisons(run_id))}))
    models, version = pipeline_models(tracker, run_id)
    if models:
        print("\nMLflow models: " + ", ".join(f"{name} {uri}" for name, uri in models.items()))
    if version is not None:
        alias = next(iter(sorted(version.aliases)), None)
        uri = f"models:/{version.name}@{alias}" if alias else f"models:/{version.name}/{version.version}"
        print(f"QAT: {version.name} version {version.version} ({version.tags.get('qatpipe.gate', '?')} the gate)"
              f"{f', @{alias}' if alias else ''}. To run it on an image:\n\n{loading_snippet(uri)}")
    return 0


def cmd_spec_show(args) -> int:
    """The spec as written, with every default: it runs no stage, so it does not make the synthetic data set."""
    import yaml

    from qatpipe.spec_sources import load_spec_uri

    sys.stdout.write(yaml.safe_dump(load_spec_uri(args.experiment_spec, args.overrides).to_dict(), sort_keys=False))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qatpipe", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_commands in (_add_data_commands, _add_training_commands, _add_deployment_commands,
                         _add_prune_command, _add_pipeline_commands, _add_spec_commands):
        add_commands(sub)
    return parser


def _add_data_commands(sub) -> None:
    """`qatpipe data synth`: a synthetic KITTI data set."""
    from qatpipe.data.synth import KINDS
    from qatpipe.spec import ImageSize, SyntheticDataSpec, field_default

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    synth = data.add_parser("synth", help="write a synthetic KITTI dataset (DIR/train, DIR/val)")
    synth.add_argument("--out", required=True, type=Path)
    synth.add_argument("--train", type=int, default=field_default(SyntheticDataSpec, "train_images"),
                       help="training images")
    synth.add_argument("--val", type=int, default=field_default(SyntheticDataSpec, "val_images"),
                       help="validation images")
    synth.add_argument("--seed", type=int, default=field_default(SyntheticDataSpec, "seed"))
    synth.add_argument("--height", type=int, default=field_default(ImageSize, "height"))
    synth.add_argument("--width", type=int, default=field_default(ImageSize, "width"))
    synth.add_argument("--kind", choices=sorted(KINDS), default=field_default(SyntheticDataSpec, "kind"),
                       help="shapes (3 classes by outline); glyphs, photos (10 classes by internal detail); "
                            "traffic (10 imbalanced classes in crowded scenes)")
    synth.add_argument("--object-height", type=float, nargs=2, metavar=("MIN", "MAX"),
                       help="object box sizes in px at a 192-px-high image: heights (shapes), sides (glyphs, "
                            "photos) or widths (traffic); default: the kind's")
    synth.add_argument("--overwrite", action="store_true", help="replace existing train/val folders")
    synth.set_defaults(func=cmd_data_synth, writes=lambda a: a.out)

    upload = data.add_parser("upload", help="upload a local data set (DIR/train, DIR/val) to S3 for the cluster")
    upload.add_argument("--src", required=True, type=Path, help="the data set folder")
    upload.add_argument("--to", required=True, help="s3://bucket/prefix (credentials: the AWS_* variables)")
    upload.add_argument("-e", "--experiment-spec", help="check train/ and val/ against this spec's classes first")
    upload.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    upload.set_defaults(func=cmd_data_upload)


def _add_training_commands(sub) -> None:
    """`qatpipe train | pretrain | evaluate | retrain`: the stages that run a Keras model."""
    train = sub.add_parser("train", help="train the spec's detector (FP32; resumes from checkpoints)")
    _add_spec_args(train)
    _add_training_args(train)
    train.set_defaults(func=cmd_train, writes=lambda a: a.results_dir)

    pretrain = sub.add_parser(
        "pretrain", help="pretrain the spec's backbone as a classifier of object crops or image folders "
        "(model.pretrained takes RESULTS/weights.keras)",
        description="Settings: the spec's `pretrain` section (data, crop_size, epochs, ...); docs/pretrain.md.")
    _add_spec_args(pretrain, "--spec")
    pretrain.add_argument("-r", "--results-dir", "-o", "--output", dest="results_dir", required=True, type=Path,
                          help="weights.keras, classes.json, pretrain_summary.json, pretrain_log.csv go here")
    pretrain.add_argument("--use-amp", action="store_true",
                          help="mixed precision (pretrain.use_amp): float16 on a GPU, bfloat16 on a CPU with "
                               "AMX/AVX512-BF16")
    pretrain.set_defaults(func=cmd_pretrain, writes=lambda a: a.results_dir)

    evaluate = sub.add_parser("evaluate", help="mAP of a model (.keras in TensorFlow, .onnx in ONNX Runtime)")
    _add_spec_args(evaluate)
    evaluate.add_argument("-m", "--model", required=True, type=Path)
    evaluate.add_argument("-o", "--output-dir", type=Path, help="default: MODEL_DIR/evaluate")
    evaluate.set_defaults(func=cmd_evaluate, writes=_evaluation_folder)

    retrain = sub.add_parser("retrain", help="retrain a pruned model, FP32 or QAT (resumes from checkpoints)",
                             description="Epochs: retrain.epochs (default train.epochs), with --finetune "
                                         "qat.finetune_epochs, with --baseline qat.epochs; QAT: the qat section.")
    _add_spec_args(retrain)
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
    retrain.set_defaults(func=cmd_retrain, writes=lambda a: a.results_dir)


def _add_prune_command(sub) -> None:
    """`qatpipe prune`: TAO's flags over the spec's prune section."""
    from qatpipe.spec import PruneSpec, field_choices

    prune = sub.add_parser("prune", help="structured pruning of a trained model (TAO `prune`)",
                           description="Settings: the spec's `prune` section (-e), overridden by the flags.")
    prune.add_argument("-m", "--model", required=True, type=Path, help="trained model (.keras)")
    prune.add_argument("-o", "--output", required=True, type=Path,
                       help="output folder, or a .keras file (the report goes beside it)")
    prune.add_argument("-e", "--experiment-spec", help="spec for defaults and model checks (optional)")
    prune.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
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
    prune.set_defaults(func=cmd_prune, writes=lambda a: a.output.parent if a.output.suffix == ".keras" else a.output)


def _add_deployment_commands(sub) -> None:
    """`qatpipe export | ptq | ptq-partial | sensitivity | build-engine | bench-engine | validate`: a trained model to a validated
    engine."""
    from qatpipe.engines import BACKENDS

    export = sub.add_parser("export", help="export a model to ONNX (tf2onnx), checked in ONNX Runtime")
    _add_model_conversion_args(export, "model (.keras)", "the .onnx file to write")
    export.set_defaults(func=cmd_export, writes=lambda a: a.output.parent)

    ptq = sub.add_parser("ptq", help="post-training INT8 quantization of an FP32 ONNX (the PTQ baseline)",
                         description="Settings: the spec's `ptq` section (--set ptq.method=percentile ...).")
    _add_model_conversion_args(ptq, "FP32 model (.onnx, from `qatpipe export`)", "the INT8 Q/DQ .onnx to write")
    ptq.set_defaults(func=cmd_ptq, writes=lambda a: a.output.parent)

    partial = sub.add_parser("ptq-partial", help="the PTQ model with its most sensitive layers kept float, within "
                             "validate.max_map_drop of FP32 (ptq.keep_float auto) or the layers named",
                             description="Settings: ptq.keep_float, validate.max_map_drop, the spec's `sensitivity` "
                             "section (the val sample it scores on); docs/quantization.md.")
    _add_model_conversion_args(partial, "the PTQ model (.onnx, from `qatpipe ptq`)", "the partial Q/DQ .onnx to write")
    partial.add_argument("--fp32", type=Path, required=True, help="the FP32 ONNX the PTQ model was quantized from "
                         "(a float layer reads its weights)")
    partial.add_argument("--sensitivity", type=Path, help="the folder of the PTQ model's sensitivity.json "
                         "(`qatpipe sensitivity`), which keep_float auto ranks the layers by")
    partial.add_argument("--keep-float", nargs="+", metavar="LAYER", help="auto, or layer / ONNX node names "
                         "(sets ptq.keep_float)")
    partial.set_defaults(func=cmd_ptq_partial, writes=lambda a: a.output.parent)

    sens = sub.add_parser("sensitivity", help="per-layer INT8 sensitivity of a Q/DQ ONNX (PTQ or QAT): the mAP@0.5 "
                          "drop with only each layer INT8, and with every layer but it INT8",
                          description="Settings: the spec's `sensitivity` section (val_images, max_layers, layers); "
                          "docs/sensitivity.md.")
    _add_model_conversion_args(sens, "the Q/DQ model (.onnx, from `qatpipe ptq` or a QAT export)",
                               "the folder for sensitivity.json, sensitivity.png and sensitivity.md")
    sens.add_argument("--fp32", type=Path, help="the FP32 ONNX the model was quantized from: a bypassed layer reads "
                      "its weights where they match (a PTQ model's), and the report adds its mAP")
    sens.add_argument("--layers", nargs="+", metavar="NODE", help="score only these layers (ONNX node names; "
                      "sets sensitivity.layers)")
    sens.set_defaults(func=cmd_sensitivity, writes=lambda a: a.output)

    engine = sub.add_parser("build-engine", help="build an inference engine from an ONNX model",
                            description="Settings: the spec's `engine` section (batch profile, workspace, fp16).")
    _add_model_conversion_args(engine, "the ONNX model", "the engine folder to write")
    engine.add_argument("--backend", choices=("auto", *BACKENDS),
                        help="default: engine.backend (auto: TensorRT with a GPU, else ONNX Runtime)")
    engine.set_defaults(func=cmd_build_engine, writes=lambda a: a.output)

    bench = sub.add_parser("bench-engine", help="latency, throughput, size and memory of an engine",
                           description="Settings: engine.bench (batch sizes, warm-up, iterations).")
    _add_spec_args(bench)
    bench.add_argument("-m", "--model", required=True, type=Path, help="the engine folder")
    bench.add_argument("-o", "--output", type=Path, help="report JSON (default ENGINE/bench.json)")
    bench.set_defaults(func=cmd_bench_engine, writes=lambda a: a.output.parent if a.output else a.model)

    validate = sub.add_parser("validate", help="mAP of an engine vs the FP32 baseline, and the gate",
                              description="Exits 1 when mAP@0.5 (and, for an INT8 engine, the TensorRT-emulated "
                              "mAP@0.5) drops more than validate.max_map_drop.")
    _add_spec_args(validate)
    validate.add_argument("-m", "--model", required=True, type=Path, help="the engine folder")
    validate.add_argument("--baseline", required=True, type=Path, help="the FP32 model's metrics.json")
    validate.add_argument("-o", "--output", type=Path, help="report folder (default ENGINE/validate)")
    validate.add_argument("--variant", default="int8", help="name in the report (e.g. qat, ptq)")
    validate.add_argument("--onnx", type=Path, help="the ONNX the engine was built from, for the TensorRT-emulated "
                          "mAP (default: the path in engine.json)")
    validate.set_defaults(func=cmd_validate, writes=lambda a: a.output or a.model / "validate")


def _add_pipeline_commands(sub) -> None:
    """`qatpipe run | compile | submit | compare`: the whole pipeline, here or on Kubeflow."""
    run = sub.add_parser("run", help="run the whole pipeline (--local: through kfp.local on this machine)")
    run.add_argument("--local", action="store_true", required=True,
                     help="run here, each stage a subprocess (on a cluster: `qatpipe submit`)")
    run.add_argument("--spec", default="default", help="spec file, s3:// URI or bundled name (default: default)")
    run.add_argument("--output", type=Path, default=Path("results/pipeline"),
                     help="results, MLflow store and stage cache (default: results/pipeline); re-use it to resume")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a spec key (repeatable)")
    run.add_argument("--run-name", help="MLflow parent run name (default: the output folder's name)")
    run.add_argument("--runner", choices=("subprocess", "docker"), default="subprocess",
                     help="subprocess: each stage a process here; docker: each stage in its image (`make images`), "
                          "MLflow in the MLflow image, through Docker or podman ($DOCKER_HOST)")
    run.set_defaults(func=cmd_run)

    compile_ = sub.add_parser("compile", help="compile the pipeline to a KFP package (YAML)")
    compile_.add_argument("-o", "--output", type=Path, default=Path("qat_pipeline.yaml"))
    compile_.add_argument("--cache-pvc", help="mount this PVC as the dataset cache of the data-reading stages")
    compile_.add_argument("--mpijob", action="store_true",
                          help="train and retrain always run as MPIJobs (workers x gpus); their own tasks only "
                               "follow the job and request no GPU (needs --cache-pvc)")
    compile_.add_argument("--shm-size", help="memory-backed /dev/shm of the training tasks (default 8Gi; counted "
                                             "in their memory limit, training_memory)")
    compile_.set_defaults(func=cmd_compile)

    submit = sub.add_parser("submit", help="create a pipeline run on a Kubeflow Pipelines backend",
                            description="Token: $KFP_TOKEN, else the kube config's current user.")
    submit.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
    submit.add_argument("--experiment", default="qatpipe", help="KFP experiment (default: qatpipe)")
    submit.add_argument("--namespace", help="Kubeflow profile namespace (multi-user deployments)")
    submit.add_argument("--service-account", help="the ServiceAccount the run's pods use (standalone KFP: "
                                                  "pipeline-runner; Kubeflow profiles: default-editor)")
    submit.add_argument("--run-name", help="KFP run name")
    submit.add_argument("--package", type=Path, help="a compiled pipeline YAML (default: compile now)")
    submit.add_argument("arguments", nargs="*", metavar="NAME=VALUE",
                        help="pipeline parameters, e.g. spec_uri=s3://bucket/spec.yaml gpus=2")
    submit.set_defaults(func=cmd_submit)

    compare = sub.add_parser("compare", help="the FP32/PTQ/QAT table of a pipeline run, from MLflow")
    compare.add_argument("--run-id", help="MLflow parent run id (default: the experiment's latest pipeline run)")
    compare.add_argument("--experiment", default="qatpipe")
    compare.add_argument("--tracking-uri", help="default: $MLFLOW_TRACKING_URI")
    compare.add_argument("-o", "--output", type=Path, default=Path("comparison.png"), help="bar chart (PNG)")
    compare.set_defaults(func=cmd_compare)


def _add_spec_commands(sub) -> None:
    """`qatpipe spec show`."""
    spec = sub.add_parser("spec", help="spec tools").add_subparsers(dest="spec_command", required=True)
    show = spec.add_parser("show", help="print the validated spec with every default filled in")
    _add_spec_args(show)
    show.set_defaults(func=cmd_spec_show)


def _holding(args):
    """The lock on the folder this command writes (`writes` of its parser; `run` locks its own in run_local):
    two commands writing one results folder at once would clobber each other. A process that horovodrun or
    mpirun started is one of N: its launcher holds the lock."""
    import contextlib

    from qatpipe.fileio import folder_lock
    from qatpipe.training.distributed import launched_by_horovod

    writes = getattr(args, "writes", None)
    if writes is None or launched_by_horovod():
        return contextlib.nullcontext()
    return folder_lock(writes(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # `--gpus N` re-runs this command line under horovodrun
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    for noisy in ("botocore", "urllib3", "matplotlib", "PIL", "h5py", "absl", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        with _holding(args):
            return args.func(args)
    except QatpipeError as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:  # one a writer did not name: its file, else the folder this command writes
        from qatpipe.fileio import os_error_line

        writes = getattr(args, "writes", None)
        log.error("%s", os_error_line(exc, writes(args) if writes else None))
        return 2
    except KeyboardInterrupt:
        log.error("interrupted; re-run the same command to resume from the last checkpoint")
        return 130


if __name__ == "__main__":
    sys.exit(main())
