"""Benchmark: training throughput with 1, 2, ... Horovod processes (`qatpipe train --gpus N`).

    python bench/horovod_scaling.py [--processes 1 2] [--spec default] [--train-images 512] [--epochs 3]
                                    [--work DIR] [--controller gloo|mpi]

Writes a synthetic KITTI training set at the spec's image size, then trains the spec's detector once per
process count, each into its own folder, through the real command line (horovodrun for N > 1), and prints
per count: images/s of the whole job over the epochs after the first (the first one traces the graph),
speed-up over 1 process, and scaling efficiency = throughput(N) / (N x throughput(1)). Writes
WORK/bench_horovod.json.

On a multi-GPU node the same command measures GPU scaling (`--processes 1 2 4 8`): each process takes one GPU
and NCCL carries the all-reduce. On a CPU-only host the processes share its cores, so one process already
uses all of them: there, efficiency near 1/N and speed-up near 1 is the ideal, and the figures show what
Horovod's gradient exchange and the split of the cores cost.
"""

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--spec", default="default")
    parser.add_argument("--train-images", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3, help="at least 2: the first epoch is not timed")
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if args.epochs < 2:
        parser.error("--epochs must be at least 2")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_horovod_"))
    work.mkdir(parents=True, exist_ok=True)

    from qatpipe.spec_sources import load_spec_uri

    spec = load_spec_uri(args.spec, [])
    size, batch_size = spec.dataset.image_size, spec.train.batch_size
    env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    cli = [sys.executable, "-m", "qatpipe.cli"]
    data = work / "data"
    if not (data / "train").is_dir():
        subprocess.run(cli + ["data", "synth", "--out", str(data), "--train", str(args.train_images), "--val", "16",
                              "--height", str(size.height), "--width", str(size.width)], env=env, check=True)

    rows = {}
    for processes in args.processes:
        results = work / f"np{processes}"
        if results.exists():
            subprocess.run(["rm", "-rf", str(results)], check=True)
        command = cli + ["train", "-e", args.spec, "--set", f"dataset.train={data / 'train'}",
                         "--set", f"dataset.val={data / 'val'}", "--set", f"train.epochs={args.epochs}",
                         "-r", str(results), "--gpus", str(processes), "--horovod-controller", args.controller]
        log.info("training with %d process(es)", processes)
        subprocess.run(command, env=env, check=True)
        summary = json.loads((results / "train_summary.json").read_text())
        timed = summary["epoch_seconds"][1:]
        images = summary["steps_per_epoch"] * batch_size * processes
        rows[processes] = {"images_per_epoch": images, "epoch_seconds": summary["epoch_seconds"],
                           "images_per_second": images * len(timed) / sum(timed)}

    base = rows[min(rows)]["images_per_second"] / min(rows)
    print(f"\nHorovod scaling: {args.spec} spec, {size.height}x{size.width}, batch "
          f"{batch_size} per process, {args.train_images} images, "
          f"{args.epochs} epochs (first not timed), {args.controller}; {os.cpu_count()} CPU cores, "
          f"{platform.processor() or platform.machine()}")
    print("| processes | images/s | speed-up | scaling efficiency |")
    print("|---|---|---|---|")
    for processes, row in rows.items():
        row["speed_up"] = row["images_per_second"] / rows[min(rows)]["images_per_second"]
        row["efficiency"] = row["images_per_second"] / (processes * base)
        print(f"| {processes} | {row['images_per_second']:.1f} | {row['speed_up']:.2f}x | {row['efficiency']:.0%} |")
    (work / "bench_horovod.json").write_text(json.dumps({"spec": args.spec, "rows": rows}, indent=2))
    log.info("wrote %s", work / "bench_horovod.json")


if __name__ == "__main__":
    main()
