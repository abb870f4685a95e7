"""`qatpipe export | ptq | ptq-partial | sensitivity | build-engine | bench-engine | validate`: a trained model to
a validated engine."""

from __future__ import annotations

from pathlib import Path

from qatpipe.cli.common import (EXIT_GATE_FAILED, add_model_conversion_args, add_spec_args, check_file, check_model,
                                log, with_data)


def add_commands(sub) -> None:
    from qatpipe.engines import BACKENDS

    export = sub.add_parser("export", help="export a model to ONNX (tf2onnx), checked in ONNX Runtime")
    add_model_conversion_args(export, "model (.keras)", "the .onnx file to write")
    export.set_defaults(func=cmd_export, check=lambda a: check_model(a.model, "keras"),
                        writes=lambda a: a.output.parent)

    ptq = sub.add_parser("ptq", help="post-training INT8 quantization of an FP32 ONNX (the PTQ baseline)",
                         description="Settings: the spec's `ptq` section (--set ptq.method=percentile ...).")
    add_model_conversion_args(ptq, "FP32 model (.onnx, from `qatpipe export`)", "the INT8 Q/DQ .onnx to write")
    ptq.set_defaults(func=cmd_ptq, check=lambda a: check_model(a.model, "onnx"), writes=lambda a: a.output.parent)

    partial = sub.add_parser("ptq-partial", help="the PTQ model with its most sensitive layers kept float, within "
                             "validate.max_map_drop of FP32 (ptq.keep_float auto) or the layers named",
                             description="Settings: ptq.keep_float, validate.max_map_drop, the spec's `sensitivity` "
                             "section (the val sample it scores on); docs/quantization.md.")
    add_model_conversion_args(partial, "the PTQ model (.onnx, from `qatpipe ptq`)", "the partial Q/DQ .onnx to write")
    partial.add_argument("--fp32", type=Path, required=True, help="the FP32 ONNX the PTQ model was quantized from "
                         "(a float layer reads its weights)")
    partial.add_argument("--sensitivity", type=Path, help="the folder of the PTQ model's sensitivity.json "
                         "(`qatpipe sensitivity`), which keep_float auto ranks the layers by")
    partial.add_argument("--keep-float", nargs="+", metavar="LAYER", help="auto, or layer / ONNX node names "
                         "(sets ptq.keep_float)")
    partial.set_defaults(func=cmd_ptq_partial, check=check_ptq_partial, writes=lambda a: a.output.parent)

    sens = sub.add_parser("sensitivity", help="per-layer INT8 sensitivity of a Q/DQ ONNX (PTQ or QAT): the mAP@0.5 "
                          "drop with only each layer INT8, and with every layer but it INT8",
                          description="Settings: the spec's `sensitivity` section (val_images, max_layers, layers); "
                          "docs/sensitivity.md.")
    add_model_conversion_args(sens, "the Q/DQ model (.onnx, from `qatpipe ptq` or a QAT export)",
                              "the folder for sensitivity.json, sensitivity.png and sensitivity.md")
    sens.add_argument("--fp32", type=Path, help="the FP32 ONNX the model was quantized from: a bypassed layer reads "
                      "its weights where they match (a PTQ model's), and the report adds its mAP")
    sens.add_argument("--layers", nargs="+", metavar="NODE", help="score only these layers (ONNX node names; "
                      "sets sensitivity.layers)")
    sens.set_defaults(func=cmd_sensitivity, writes=lambda a: a.output,
                      check=lambda a: (check_model(a.model, "onnx"), check_model(a.fp32, "onnx", "--fp32")))

    engine = sub.add_parser("build-engine", help="build an inference engine from an ONNX model",
                            description="Settings: the spec's `engine` section (batch profile, workspace, fp16).")
    add_model_conversion_args(engine, "the ONNX model", "the engine folder to write")
    engine.add_argument("--backend", choices=("auto", *BACKENDS),
                        help="default: engine.backend (auto: TensorRT with a GPU, else ONNX Runtime)")
    engine.set_defaults(func=cmd_build_engine, check=lambda a: check_model(a.model, "onnx"), writes=lambda a: a.output)

    bench = sub.add_parser("bench-engine", help="latency, throughput, size and memory of an engine",
                           description="Settings: engine.bench (batch sizes, warm-up, iterations).")
    add_spec_args(bench)
    bench.add_argument("-m", "--model", required=True, type=Path, help="the engine folder")
    bench.add_argument("-o", "--output", type=Path, help="report JSON (default ENGINE/bench.json)")
    bench.set_defaults(func=cmd_bench_engine, check=lambda a: check_model(a.model, "engine"),
                       writes=lambda a: a.output.parent if a.output else a.model)

    validate = sub.add_parser("validate", help="mAP of an engine vs the FP32 baseline, and the gate",
                              description="Exits 1 when mAP@0.5 (and, for an INT8 engine, the TensorRT-emulated "
                              "mAP@0.5) drops more than validate.max_map_drop.")
    add_spec_args(validate)
    validate.add_argument("-m", "--model", required=True, type=Path, help="the engine folder")
    validate.add_argument("--baseline", required=True, type=Path, help="the FP32 model's metrics.json")
    validate.add_argument("-o", "--output", type=Path, help="report folder (default ENGINE/validate)")
    validate.add_argument("--variant", default="int8", help="name in the report (e.g. qat, ptq)")
    validate.add_argument("--onnx", type=Path, help="the ONNX the engine was built from, for the TensorRT-emulated "
                          "mAP (default: the path in engine.json)")
    validate.set_defaults(func=cmd_validate, check=check_validate, writes=lambda a: a.output or a.model / "validate")


def check_ptq_partial(args) -> None:
    check_model(args.model, "onnx")
    check_model(args.fp32, "onnx", "--fp32")
    if args.sensitivity is not None:
        from qatpipe.stages.sensitivity import JSON_FILE

        check_file(args.sensitivity / JSON_FILE, "--sensitivity", "sensitivity report")


def check_validate(args) -> None:
    check_model(args.model, "engine")
    check_file(args.baseline, "--baseline", "the FP32 model's metrics file")
    from qatpipe.stages.validate import read_baseline

    read_baseline(args.baseline)  # an evaluation's metrics.json, or one line saying what it is not
    check_model(args.onnx, "onnx", "--onnx")


def cmd_export(args) -> int:
    from qatpipe.stages.export import export

    report = export(with_data(args), args.model, args.output)
    worst = max(d["max_abs"] for d in report["difference_vs_tensorflow"].values())
    print(f"{report['onnx']}  opset {report['opset']}  {report['quantization']}  {report['size_mb']:.2f} MB  "
          f"max |TF - ORT| {worst:.1e}")
    return 0


def cmd_ptq(args) -> int:
    from qatpipe.stages.ptq import ptq

    report = ptq(with_data(args), args.model, args.output)
    print(f"{report['onnx']}  PTQ {report['method']} on {report['calibration_images']} images  "
          f"{report['size_mb']:.2f} MB")
    return 0


def cmd_ptq_partial(args) -> int:
    from qatpipe.stages.ptq_partial import ptq_partial

    spec = with_data(args)
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

    spec = with_data(args)
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

    info = build_engine(with_data(args), args.model, args.output, backend=args.backend)
    print(f"{args.output}  {info['backend']} {info['runtime_version']}  {info['precision']}  {info['device']}  "
          f"{info['engine_size_mb']:.2f} MB")
    return 0


def cmd_bench_engine(args) -> int:
    from qatpipe.stages.bench_engine import bench_engine

    report = bench_engine(with_data(args), args.model, args.output)
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

    report = validate(with_data(args), args.model, args.baseline, args.output, variant=args.variant,
                      onnx_model=args.onnx)
    if not report["passed"]:
        return EXIT_GATE_FAILED  # the stage has logged the gate's message
    print(f"{report['variant']}: PASSED  mAP@0.5 {report['map50']:.4f} (baseline {report['baseline_map50']:.4f}, "
          f"drop {100 * report['map50_drop']:+.2f} points, allowed {100 * report['max_map_drop']:.2f})")
    return 0
