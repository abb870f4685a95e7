"""Benchmark: the README main job (`qatpipe run --local` on the default spec), timed per stage and in total.

    python bench/pipeline_local.py [--work DIR] [--spec default] [--set KEY=VALUE ...]
    python bench/pipeline_local.py --report --work DIR

Runs the whole pipeline through kfp.local into a fresh folder (cold: no stage cache), then once more into
the same folder (warm: every stage reused from the cache), and prints: seconds inside each stage (what the
stage itself did), the cold and warm wall times (which add each stage process's start-up and Python
imports), and the variant table from summary.json. Writes WORK/bench_pipeline_local.json. `--report` prints a
finished WORK's figures again, read from that file and the run folder WORK/run.
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
RESULT_FILE = "bench_pipeline_local.json"
RUN_FOLDER = "run"  # WORK/run: the pipeline's output folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="working folder, must not exist (default: a fresh temp one)")
    parser.add_argument("--spec", default="default")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--report", action="store_true", help="run nothing: print WORK's figures again")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from qatpipe_pipelines.local_run import run_local

    if args.report:
        if args.work is None:
            parser.error("--report reads a finished WORK: name it with --work")
        print_report(args.work, json.loads((args.work / RESULT_FILE).read_text()))
        return
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
    (work / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    print_report(work, result)


def print_report(work: Path, result: dict) -> None:
    """The figures of `result` (WORK/bench_pipeline_local.json's) and what the run folder's summary says."""
    from qatpipe.metrics.comparison_report import format_table
    from qatpipe_pipelines.run_folder import RunFolder

    stage_rows = list(result["stage_seconds"].items())
    print(f"\n{result['machine']}; spec {result['spec']} {' '.join(result['overrides'])}")
    print("\nstage                 seconds (inside the stage)")
    for name, seconds in stage_rows:
        print(f"{name:<22}{seconds:>8.1f}")
    print(f"{'sum of stages':<22}{sum(seconds for _, seconds in stage_rows):>8.1f}")
    print(f"{'cold run, wall':<22}{result['cold_wall_seconds']:>8.1f}   (+ process start-up and imports of each task)")
    print(f"{'warm re-run, wall':<22}{result['warm_wall_seconds']:>8.1f}   "
          f"(executed: {', '.join(result['warm_stages_executed'])})")
    print("\n" + format_table(result["variants"]))  # the cold run's
    last = RunFolder(work / RUN_FOLDER).summary()  # the run folder's last run: the warm re-run
    print(f"\nresults: {work / RUN_FOLDER} (its last run: {last.get('wall_seconds')} s, gate "
          f"{'passed' if last.get('gate_passed') else 'FAILED'}); figures: {work / RESULT_FILE}")


if __name__ == "__main__":
    main()
