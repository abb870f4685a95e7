"""Benchmark: the model optimisation recipe on the default spec, end to end, and its targets.

    python bench/optimize.py [--run DIR] [--spec default] [--set KEY=VALUE ...]

Runs the pipeline locally (train → prune → retrain FP32 and QAT → export → PTQ → evaluate all three INT8/FP32
ONNX models in ONNX Runtime, the unpruned Keras model in TensorFlow) into DIR; a DIR holding an earlier run of
the same spec and code reuses its finished stages (kfp.local's cache). Prints the variant table (mAP@0.5,
mAP@[.5:.95], params, FLOPs, size) and each target with the measured figure; writes DIR/bench_optimize.json.

Targets (model optimisation issue): pruned FLOPs <= 0.5 x unpruned with the retrained FP32 mAP@0.5 within
1 point of unpruned; QAT INT8 mAP@0.5 within 1 point of FP32; PTQ shown as measured.
"""

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

log = logging.getLogger("bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="pipeline output folder (default: a fresh temp one)")
    parser.add_argument("--spec", default="default")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from qatpipe_pipelines.local_run import run_local

    run_dir = args.run or Path(tempfile.mkdtemp(prefix="qatpipe-bench-optimize-"))
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the local SQLite store, as in the README main job
    started = time.perf_counter()
    summary = run_local(run_dir, args.spec, args.overrides)
    wall = time.perf_counter() - started
    pruning, variants = summary["pruning"], summary["variants"]

    rows = [("unpruned (TF, FP32)", pruning["unpruned_map50"], pruning["unpruned_map"], pruning["params_before"],
             pruning["flops_before"], pruning["unpruned_size_mb"])]
    labels = {"fp32": "pruned FP32 (ORT)", "ptq": "pruned PTQ INT8 (ORT)", "qat": "pruned QAT INT8 (ORT)"}
    rows += [(labels[name], row["map50"], row["map"], pruning["params_after"], pruning["flops_after"],
              row["size_mb"]) for name, row in variants.items()]
    fp32 = variants["fp32"]["map50"]
    targets = [
        ("pruned FLOPs <= 0.5 x unpruned", f"x{pruning['flops_ratio']:.3f}", pruning["flops_ratio"] <= 0.5),
        ("retrained FP32 mAP@0.5 within 1 point of unpruned", f"{100 * pruning['fp32_map50_change']:+.2f} points",
         pruning["fp32_map50_change"] >= -0.01),
        ("QAT INT8 mAP@0.5 within 1 point of FP32", f"{100 * (variants['qat']['map50'] - fp32):+.2f} points",
         variants["qat"]["map50"] >= fp32 - 0.01),
        ("PTQ INT8 mAP@0.5 vs FP32 (shown as measured)", f"{100 * (variants['ptq']['map50'] - fp32):+.2f} points",
         None),
    ]
    result = {
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}",
        "spec": args.spec, "overrides": args.overrides, "wall_seconds": round(wall, 1),
        "stages_executed": sorted(summary["stages"]),
        "table": [dict(zip(("variant", "map50", "map", "params", "flops", "size_mb"), row)) for row in rows],
        "targets": [{"target": t, "measured": m, "met": ok} for t, m, ok in targets],
    }
    (run_dir / "bench_optimize.json").write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{result['machine']}; spec {args.spec} {' '.join(args.overrides)}; wall {wall:.1f} s "
          f"(stages executed: {len(summary['stages'])})\n")
    print("| variant | mAP@0.5 | mAP@[.5:.95] | params | GFLOPs | size (MB) |")
    print("|---|---|---|---|---|---|")
    for name, map50, map_, params, flops, size in rows:
        print(f"| {name} | {map50:.4f} | {map_:.4f} | {params:,} | {flops / 1e9:.3f} | {size:.2f} |")
    print("\n| target | measured | met |\n|---|---|---|")
    for target, measured, ok in targets:
        print(f"| {target} | {measured} | {'n/a' if ok is None else ('yes' if ok else 'NO')} |")
    print(f"\nresults: {run_dir}; figures: {run_dir / 'bench_optimize.json'}")


if __name__ == "__main__":
    main()
