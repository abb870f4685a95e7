"""Benchmark: the README main job (`qatpipe run --local` on the default spec), timed per stage and in total.

    python bench/pipeline_local.py [--work DIR] [--spec default] [--set KEY=VALUE ...]

Runs the whole pipeline through kfp.local into a fresh folder (cold: no stage cache), then once more into
the same folder (warm: every stage reused from the cache), and prints: seconds inside each stage (what the
stage itself did), the cold and warm wall times (which add each stage process's start-up and Python
imports), and the variant table from summary.json. Writes WORK/bench_pipeline_local.json.
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
    parser.add_argument("--work", type=Path, help="working folder, must not exist (default: a fresh temp one)")
    parser.add_argument("--spec", default="default")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from qatpipe.metrics.comparison_report import format_table
    from qatpipe_pipelines.local_run import run_local

    work = args.work or Path(tempfile.mkdtemp(prefix="qatpipe-bench-pipeline-"))
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"{work} is not empty: a cold run needs a fresh folder (this script never deletes)")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the local SQLite store, as in the README main job

    started = time.perf_counter()
    cold = run_local(work / "run", args.spec, args.overrides)
    cold_wall = time.perf_counter() - started
    started = time.perf_counter()
    warm = run_local(work / "run", args.spec, args.overrides)
    warm_wall = time.perf_counter() - started

    stage_rows = [(name, outcome["seconds"]) for name, outcome in cold["stages"].items()]
    in_stages = sum(seconds for _, seconds in stage_rows)
    result = {
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}",
        "spec": args.spec, "overrides": args.overrides,
        "stage_seconds": dict(stage_rows),
        "cold_wall_seconds": round(cold_wall, 1),
        "warm_wall_seconds": round(warm_wall, 1),
        "warm_stages_executed": sorted(warm["stages"]),
        "variants": cold["variants"],
        "mlflow": cold.get("mlflow"),
    }
    (work / "bench_pipeline_local.json").write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{result['machine']}; spec {args.spec} {' '.join(args.overrides)}")
    print("\nstage                 seconds (inside the stage)")
    for name, seconds in stage_rows:
        print(f"{name:<22}{seconds:>8.1f}")
    print(f"{'sum of stages':<22}{in_stages:>8.1f}")
    print(f"{'cold run, wall':<22}{cold_wall:>8.1f}   (+ process start-up and imports of each task)")
    print(f"{'warm re-run, wall':<22}{warm_wall:>8.1f}   (executed: {', '.join(result['warm_stages_executed'])})")
    print("\n" + format_table(cold["variants"]))
    print(f"\nresults: {work / 'run'}; figures: {work / 'bench_pipeline_local.json'}")


if __name__ == "__main__":
    main()
