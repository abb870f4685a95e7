"""Benchmark: the full spec's main job (synth data -> train -> evaluate), figures measured on this machine.

    python bench/train_eval.py [--work DIR] [--set KEY=VALUE ...]

Prints FP32 mAP@0.5, mAP@[.5:.95], training throughput (images/s) and wall time per stage and in total,
and writes them to WORK/bench_train_eval.json. Targets (issue: foundation): mAP@0.5 >= 0.85 on val and the
whole run under 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from pathlib import Path

import qatpipe  # noqa: F401 - sets TF_USE_LEGACY_KERAS
from qatpipe.spec import bundled_spec_path, load_spec

log = logging.getLogger("bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="working folder (default: a fresh temporary one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    # the full spec's synthetic set sizes (2000 / 2000)
    synthetic = load_spec(bundled_spec_path("full")).dataset.synthetic
    parser.add_argument("--train-images", type=int, default=synthetic.train_images)
    parser.add_argument("--val-images", type=int, default=synthetic.val_images)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")

    from qatpipe.data.synth import write_synthetic_dataset
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.train import train

    work = args.work or Path(tempfile.mkdtemp(prefix="qatpipe-bench-"))
    if (work / "train").exists() or (work / "evaluate").exists():
        # a benchmark measures a run from scratch, and never deletes results it did not make
        parser.error(f"{work} already holds train/ or evaluate/ results: pass an empty or new --work folder")
    data = work / "data"
    times: dict[str, float] = {}
    total = time.perf_counter()

    t = time.perf_counter()
    if not (data / "train").exists():
        write_synthetic_dataset(data, args.train_images, args.val_images, seed=0)
    times["synth_data"] = time.perf_counter() - t

    spec = load_spec(bundled_spec_path("full"),
                     [f"dataset.train={data / 'train'}", f"dataset.val={data / 'val'}", *args.overrides])
    t = time.perf_counter()
    summary = train(spec, work / "train")
    times["train"] = time.perf_counter() - t

    t = time.perf_counter()
    metrics = evaluate(spec, work / "train" / "model.keras", work / "evaluate")
    times["evaluate"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - total

    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "spec_overrides": args.overrides,
        "train_images": summary["train_images"], "epochs": summary["epochs"], "params": summary["params"],
        "map50": round(metrics["map50"], 4), "map": round(metrics["map"], 4),
        "per_class_ap50": {k: v["ap50"] and round(v["ap50"], 4) for k, v in metrics["per_class"].items()},
        "train_images_per_second": summary["images_per_second"],
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }
    (work / "bench_train_eval.json").write_text(json.dumps(result, indent=2))
    lines = [
        "", "| metric | value |", "|---|---|",
        f"| FP32 mAP@0.5 (val, {metrics['num_images']} images) | {result['map50']:.4f} |",
        f"| FP32 mAP@[.5:.95] | {result['map']:.4f} |",
        *(f"| AP@0.5 {k} | {v:.4f} |" for k, v in result["per_class_ap50"].items() if v is not None),
        f"| training throughput | {result['train_images_per_second']:.1f} images/s |",
        *(f"| wall time: {k} | {v:.1f} s |" for k, v in result["seconds"].items()),
        f"| machine | {result['machine']} |", "",
    ]
    log.info("results in %s\n%s", work, "\n".join(lines))


if __name__ == "__main__":
    main()
