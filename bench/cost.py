"""Benchmark: how the main job's cost grows with its work (issue 55): the whole pipeline on the default spec at
several training-set sizes and image sizes, one cold run each.

    python bench/cost.py [--work DIR] [--spec default] [--train-images 500 1000 2000 4000]
                         [--image-sizes 192x320 ...] [--set KEY=VALUE ...]

Each point is `qatpipe run --local` into WORK/<train images>_<height>x<width> (a folder that already holds a
finished run is read, not run again). Prints per point: training image passes, the cold wall time, the training
stages' seconds, the rest, and mAP@0.5 of the unpruned, FP32 and QAT models with FP32's bootstrap CI, beside
the CPU (name and flags). Writes WORK/bench_cost.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

log = logging.getLogger("bench")
TRAINING = ("train", "retrain-fp32", "finetune-fp32", "retrain-qat")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("results/bench_cost"))
    parser.add_argument("--spec", default="default")
    parser.add_argument("--train-images", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    parser.add_argument("--image-sizes", nargs="+", default=["192x320"], help="HEIGHTxWIDTH, multiples of 64 (SSD)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from train_speed import cpu  # bench/train_speed.py, beside this script

    from qatpipe.spec_sources import load_spec_uri
    from qatpipe.stages.retrain_plan import training_epochs
    from qatpipe_pipelines.local_run import SUMMARY_FILE, run_local

    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the local SQLite store, as in the README main job
    rows = []
    for size in args.image_sizes:
        height, width = (int(side) for side in size.split("x"))
        for images in args.train_images:
            sets = [*args.overrides, f"dataset.synthetic.train_images={images}",
                    f"dataset.image_size.height={height}", f"dataset.image_size.width={width}"]
            spec = load_spec_uri(args.spec, sets)
            out = args.work / f"{images}_{size}" / "run"
            if (out / SUMMARY_FILE).is_file():  # a finished run of this point (a link to one, too)
                summary = json.loads((out / SUMMARY_FILE).read_text())
            else:
                summary = run_local(out, args.spec, sets)
            wall = summary["wall_seconds"]
            stages = {name: outcome["seconds"] for name, outcome in summary["stages"].items()}
            epochs = training_epochs(spec)
            variants = summary["variants"]
            rows.append({
                "train_images": images, "image_size": size, "passes": images * epochs, "wall_seconds": wall,
                "training_seconds": round(sum(stages.get(name, 0) for name in TRAINING), 1),
                "other_seconds": round(sum(stages.values()) - sum(stages.get(name, 0) for name in TRAINING), 1),
                "map50_unpruned": summary.get("pruning", {}).get("unpruned_map50"),
                "map50_fp32": variants["fp32"]["map50"],
                "map50_fp32_ci95": [variants["fp32"]["map50_ci95_lo"], variants["fp32"]["map50_ci95_hi"]],
                "map50_qat": variants["qat"]["map50"], "gate_passed": summary.get("gate_passed"),
            })
    machine = cpu()
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "bench_cost.json").write_text(json.dumps({"cpu": machine, "spec": args.spec,
                                                           "overrides": args.overrides, "rows": rows}, indent=2) + "\n")
    print(f"\nCPU: {machine['name']}, {machine['cores']} cores, {' '.join(machine['flags'])}; spec {args.spec}")
    print("| train images | image size | passes | wall min | training s | other s | unpruned | FP32 [95% CI] | QAT | gate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        unpruned = f"{r['map50_unpruned']:.4f}" if r["map50_unpruned"] is not None else "n/a"
        print(f"| {r['train_images']:,} | {r['image_size']} | {r['passes']:,} | {r['wall_seconds'] / 60:.1f} | "
              f"{r['training_seconds']:.0f} | {r['other_seconds']:.0f} | {unpruned} | {r['map50_fp32']:.4f} "
              f"[{r['map50_fp32_ci95'][0]:.4f}, {r['map50_fp32_ci95'][1]:.4f}] | {r['map50_qat']:.4f} | "
              f"{'passed' if r['gate_passed'] else 'failed'} |")


if __name__ == "__main__":
    main()
