"""Benchmark: ONNX Runtime engines of the FP32, PTQ INT8, ptq-partial and QAT INT8 models, one harness, one run.

    python bench/engines.py --run DIR [--batch-sizes 1 8] [--iterations 50] [--min-seconds 5] [--rounds 5]
                            [--profile] [--without REWRITE ...] [--openvino]

DIR is a `qatpipe run --local` output folder (for instance bench/pipeline_local.py's WORK/run): the script takes the
newest run's ONNX models (ptq-partial's too where the run has that variant), builds each into an ONNX Runtime engine
(`qatpipe build-engine --backend onnxruntime`): the INT8 models in both CPU forms (`engine.cpu_form` fast, the
default where the CPU has VNNI or AMX, and exact, TensorRT's numbers), and with `--without` in the fast form less
each named speed rewrite (graph/cpu_qdq.OPTIONAL_REWRITES), to show what it buys. It times them with the latency
harness of `qatpipe bench-engine` on random inputs of the spec's image size, every engine in this one process, once
a round for `--rounds` rounds: a slow spell of a shared machine then hits every engine alike. Figures are the
rounds' medians, and each speed-up's range over the rounds (each round's FP32 over the engine's) is printed beside
it. With `--openvino` the same ONNX models also run in OpenVINO (if installed), the candidate CPU runtime the issue
asked to measure. Prints p50 / p99 latency and throughput per batch size, the speed-up over FP32, how many
convolutions run as integer kernels, and each engine's mAP@0.5 on the run's val set; writes DIR/bench_engines.json.

Targets: deployment issue, INT8 at least 2x FP32's throughput at batch 8 on this 2-core CPU; "Speed where the
work is", the default QAT engine at least 3x (the limit of int8 VNNI over fp32 FMA is 4x).
"""

import argparse
import json
import logging
import os
import platform
from pathlib import Path

import numpy as np

from runs import median_round, speedup_range, time_in_rounds  # bench/runs.py, beside this script

from qatpipe_pipelines.run_folder import RunFolder

log = logging.getLogger("bench")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a `qatpipe run --local` output folder")
    parser.add_argument("--spec", default=None, help="default: the run's own (its train task's spec.yaml), so a run "
                        "of either arch is decoded as it was trained")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--min-seconds", type=float, default=5.0, help="per engine and batch size, over all rounds")
    parser.add_argument("--rounds", type=int, default=5,
                        help="time every engine once a round, this many rounds; figures are the rounds' medians")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: all cores)")
    parser.add_argument("--profile", action="store_true",
                        help="also print where each engine spends its time at the largest batch (ORT profiler)")
    parser.add_argument("--without", nargs="+", default=[], metavar="REWRITE",
                        help="also time each INT8 model's fast form without these speed rewrites (what each "
                             "buys; graph/cpu_qdq.OPTIONAL_REWRITES, e.g. residual_conv_outputs_quantized)")
    parser.add_argument("--openvino", action="store_true",
                        help="also time the ONNX models in OpenVINO (a candidate CPU runtime; pip install openvino)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: at least 1, got {args.rounds}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    import onnxruntime as ort

    from qatpipe.engines import load_engine
    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.spec_sources import load_spec_uri
    from qatpipe.stages.build_engine import build_engine

    sources = _onnx_models(args.run)
    spec = load_spec_uri(args.spec or str(RunFolder(args.run).stage("train") / "spec.yaml"), [])
    size = spec.dataset.image_size
    rng = np.random.default_rng(0)
    results: dict[str, dict] = {}
    # each INT8 model in both CPU forms: exact (TensorRT's numbers) and fast (BN folded, ReLU absorbed)
    engines = [("fp32", "fp32", "fast"), ("ptq exact", "ptq", "exact"), ("ptq fast", "ptq", "fast"),
               *((f"ptq fast without {w}", "ptq", "fast") for w in args.without),
               *((("ptq-partial exact", "ptq-partial", "exact"), ("ptq-partial fast", "ptq-partial", "fast"))
                 if "ptq-partial" in sources else ()),
               ("qat exact", "qat", "exact"), ("qat fast", "qat", "fast"),
               *((f"qat fast without {w}", "qat", "fast") for w in args.without)]
    runners = {}
    for variant, source, form in engines:
        engine_dir = args.run / "bench_engines" / variant.replace(" ", "_")
        spec.engine.cpu_form = form
        info = build_engine(spec, sources[source], engine_dir, backend="onnxruntime",
                            stage_name=f"bench_{source}")
        if " without " in variant:
            _rebuild_without(sources[source], engine_dir, variant.split(" without ")[1])
        runners[variant] = load_engine(engine_dir)
        if args.threads:
            from qatpipe.engines.onnxruntime_backend import OnnxRuntimeRunner

            runners[variant] = OnnxRuntimeRunner(engine_dir / "model.onnx", runners[variant].metadata,
                                                 threads=args.threads)
        dataset = sources["qat"].parents[2] / "prepare-data" / "dataset"
        scored = evaluate(spec_with_prepared_dataset(spec, dataset), engine_dir, engine_dir / "evaluate")
        results[variant] = {"label": info["label"], "precision": info["precision"],
                            "engine_size_mb": info["engine_size_mb"],
                            "fused_ops": _fused_ops(engine_dir / "model.onnx"), "map50": scored["map50"]}
        if args.profile:
            batch = rng.uniform(size=(max(args.batch_sizes), size.height, size.width, 3)).astype(np.float32)
            results[variant]["profile"] = _profile(engine_dir / "model.onnx", batch, args.threads)
    batches = {b: rng.uniform(size=(b, size.height, size.width, 3)).astype(np.float32) for b in args.batch_sizes}
    rounds = time_in_rounds({v: runner.run for v, runner in runners.items()}, batches, args.rounds,
                            args.iterations, args.min_seconds, log)
    for variant, per_batch in rounds.items():
        results[variant]["batches"] = {b: median_round(timings) for b, timings in per_batch.items()}
        results[variant]["rounds"] = per_batch
    largest = max(args.batch_sizes)
    if args.openvino:
        results.update(_openvino(sources, size, largest, args.min_seconds, rng))
    fp32 = results["fp32"]["batches"][largest]["latency_ms_p50"]
    report = {
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
                   f"onnxruntime {ort.__version__}",
        "models": {name: str(path) for name, path in sources.items()}, "rounds": args.rounds, "results": results,
        "speedup_vs_fp32_at_largest_batch": {v: round(fp32 / r["batches"][largest]["latency_ms_p50"], 2)
                                             for v, r in results.items()},
        "speedup_range_over_rounds": {v: speedup_range(rounds["fp32"][largest], per_batch[largest])
                                      for v, per_batch in rounds.items()},
    }
    (args.run / "bench_engines.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{report['machine']}; models of {sources['qat'].parents[2]}\n")
    header = " | ".join(f"p50 / p99 ms @{b}" for b in args.batch_sizes)
    print(f"| variant | engine | {header} | img/s @{largest} | speed-up @{largest} (range over rounds) | "
          "integer convs | engine MB | mAP@0.5 |")
    print("|---|" + "---|" * (len(args.batch_sizes) + 6))
    for variant, r in results.items():
        cells = " | ".join(f"{r['batches'][b]['latency_ms_p50']:.1f} / {r['batches'][b]['latency_ms_p99']:.1f}"
                           if b in r["batches"] else "n/a" for b in args.batch_sizes)
        print(f"| {variant} | {r['label']} | {cells} | {r['batches'][largest]['throughput']:.1f} | "
              f"{report['speedup_vs_fp32_at_largest_batch'][variant]:.2f}x{_range(report, variant)} | "
              f"{r.get('fused_ops', 'n/a')} | "
              f"{_fmt(r.get('engine_size_mb'), '{:.2f}')} | {_fmt(r.get('map50'), '{:.4f}')} |")
    if args.profile:
        results = {variant: r for variant, r in results.items() if "profile" in r}
        print(f"\nwhere the time goes at batch {largest} (ORT profiler, kernel time per node, top 4):")
        for variant, r in results.items():
            total = r["profile"]["total_ms"]
            top = "; ".join(f"{n['op']} {n['shape']} {n['ms']:.2f} ms ({n['ms'] / total:.0%})"
                            for n in r["profile"]["nodes"][:4])
            print(f"- {variant} ({total:.1f} ms in kernels): {top}")
    print(f"\nfigures: {args.run / 'bench_engines.json'}")


def _rebuild_without(source: Path, engine_dir: Path, rewrite: str) -> None:
    """Replace a built fast-form engine's ONNX with the fast form less one speed rewrite; engine.json's
    rewrite counts follow."""
    import onnx

    from qatpipe.engines.base import EngineMetadata
    from qatpipe.graph.cpu_qdq import to_cpu_form
    from qatpipe.export.onnx_export import save_onnx

    model = onnx.load(source)
    counts = to_cpu_form(model, "fast", without=frozenset({rewrite}))
    save_onnx(model, engine_dir / "model.onnx")
    metadata = EngineMetadata.read(engine_dir)
    metadata.extra = counts
    metadata.write(engine_dir)


def _range(report: dict, variant: str) -> str:
    low_high = report["speedup_range_over_rounds"].get(variant)
    return f" ({low_high[0]:.2f}-{low_high[1]:.2f})" if low_high else ""


def _fmt(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _openvino(sources: dict[str, Path], size, batch_size: int, min_seconds: float, rng) -> dict[str, dict]:
    """The same ONNX models (as exported, Q/DQ as TensorRT wants it) in OpenVINO's CPU plugin, a candidate CPU
    runtime (`pip install openvino`; not a qatpipe dependency): f32 inference precision, and bf16 for the FP32
    model; timed at one batch size with the same harness; mAP not scored."""
    try:
        import openvino as ov
    except ImportError:
        raise SystemExit("--openvino: pip install openvino first (it is not a qatpipe dependency)") from None
    from qatpipe.engines.latency import measure_latency

    core = ov.Core()
    batch = rng.uniform(size=(batch_size, size.height, size.width, 3)).astype(np.float32)
    results = {}
    for source, hints in (("fp32", ("f32", "bf16")), ("ptq", ("f32",)), ("qat", ("f32",))):
        for hint in hints:
            model = core.read_model(str(sources[source]))
            model.reshape({model.inputs[0].get_any_name(): list(batch.shape)})
            compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": hint,
                                                         "PERFORMANCE_HINT": "LATENCY"})
            request = compiled.create_infer_request()
            timing = measure_latency(lambda x: request.infer({0: x}), batch, warmup=5, iterations=50,
                                     min_seconds=min_seconds).to_dict()
            name = f"{source} openvino {hint}"
            results[name] = {"label": f"openvino {ov.__version__.split('-')[0]} cpu "
                                      f"{'int8' if source != 'fp32' else hint}", "batches": {batch_size: timing}}
            log.info("%s batch %d: p50 %.2f ms", name, batch_size, timing["latency_ms_p50"])
    return results


def _onnx_models(run_dir: Path) -> dict[str, Path]:
    """The FP32, PTQ, QAT and (where the run has one) ptq-partial ONNX of the run in `run_dir`, each its stage's
    newest."""
    found = {name: variant.onnx for name, variant in RunFolder(run_dir).variants().items() if variant.onnx}
    if "ptq" not in found:
        raise SystemExit(f"{run_dir}: no finished PTQ model")
    return found


def _profile(model_path: Path, batch: np.ndarray, threads: int, warmup: int = 3, runs: int = 20) -> dict:
    """Mean kernel time per node over `runs` runs after `warmup`, from ONNX Runtime's own profiler."""
    import collections
    import tempfile

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    if threads:
        options.intra_op_num_threads = threads
    with tempfile.TemporaryDirectory() as folder:
        options.profile_file_prefix = str(Path(folder) / "profile")
        session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        for _ in range(warmup + runs):
            session.run(None, {name: batch})
        events = json.loads(Path(session.end_profiling()).read_text())
    durations: dict[tuple, list[float]] = collections.defaultdict(list)  # one entry per run, in run order
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            shape = next(iter(event["args"].get("output_type_shape", [{}])[0].values()), [])
            key = (event["name"], event["args"]["op_name"], "x".join(map(str, shape)))
            durations[key].append(event["dur"] / 1000)
    per_node = {key: float(np.mean(times[warmup:])) for key, times in durations.items()}
    nodes = [{"op": op, "shape": shape, "ms": round(ms, 3)}
             for (_, op, shape), ms in sorted(per_node.items(), key=lambda item: -item[1])]
    return {"total_ms": round(sum(per_node.values()), 3), "nodes": nodes}


def _fused_ops(model_path: Path) -> str:
    """How many convolutions ONNX Runtime's CPU graph runs as integer kernels (QLinearConv) vs float."""
    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    optimized = model_path.with_name("optimized_for_count.onnx")
    options.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    ops = [node.op_type for node in onnx.load(optimized).graph.node]
    optimized.unlink()
    integer = ops.count("QLinearConv")
    return f"{integer}/{integer + ops.count('Conv') + ops.count('FusedConv')}"


if __name__ == "__main__":
    main()
