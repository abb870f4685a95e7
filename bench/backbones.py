"""Benchmark: the backbones on the whole pipeline, FP32 / PTQ / QAT each (issue "Backbones where PTQ breaks").

    python bench/backbones.py [--work DIR] [--backbones resnet mobilenet_v2 efficientnet_b0] [--set KEY=VALUE ...]

For each backbone it runs `qatpipe run --local` on the default spec with only `model.backbone.name` (and the
`--set` overrides, the same for every backbone) changed, and prints per backbone: the deployed (pruned)
model's params and GFLOPs, FP32 / PTQ / QAT mAP@0.5 with their 95% bootstrap CIs over the val images, the
paired differences QAT - FP32, PTQ - FP32 and QAT - PTQ with their CIs, each variant's CPU engine latency
(p50, batch 1), pruning's FLOPs ratio, the unpruned model's mAP@0.5, and the wall time.
Writes WORK/bench_backbones.json.

Target: QAT within 0.5 points of FP32 on every backbone. Where PTQ loses nothing, the figures say so.
"""

import argparse
import json
import logging
import os
import time
from pathlib import Path

from recipe import PAIRS, _ci, _json, _num, collect  # bench/recipe.py, beside this script

log = logging.getLogger("bench")
BACKBONES = ("resnet", "mobilenet_v2", "efficientnet_b0")


def run_backbone(backbone: str, work: Path, overrides: list[str]) -> dict:
    from qatpipe_pipelines.local_run import run_local

    sets = [f"model.backbone.name={backbone}", *overrides]
    started = time.perf_counter()
    run_local(work / backbone, "default", sets)
    return describe(backbone, work, sets, time.perf_counter() - started)


def describe(backbone: str, work: Path, sets: list[str], wall: float | None) -> dict:
    row = collect(backbone, work, sets, wall)
    variants = _json(work / backbone / "summary.json").get("variants", {})
    for name, figures in row["variants"].items():
        source = variants.get(name, {})
        figures.update({key: source.get(key) for key in ("params", "gflops", "latency_ms_p50", "engine")})
    return {"backbone": backbone, **row}


def print_report(rows: list[dict]) -> None:
    print("\nbackbone         variant  params     GFLOPs  mAP@0.5  95% CI            latency p50 (ms)  engine")
    for row in rows:
        for name, v in row["variants"].items():
            print(f"{row['backbone']:<16} {name:<8} {v.get('params') or 0:<10} {_num(v.get('gflops'), '{:.3f}'):<7} "
                  f"{v['map50']:.4f}   {_ci(v['map50_ci95']):<17} {_num(v.get('latency_ms_p50'), '{:.3f}'):<17} "
                  f"{v.get('engine') or 'n/a'}")
    print("\nbackbone         pair       mAP@0.5 diff (points)  95% CI (points)")
    for row in rows:
        for pair in PAIRS:
            c = row["comparisons"].get(pair, {}).get("map50")
            if c:
                print(f"{row['backbone']:<16} {pair:<10} {100 * c['diff']:+8.2f}            "
                      f"[{100 * c['ci95'][0]:+.2f}, {100 * c['ci95'][1]:+.2f}]")
    print("\nbackbone         pruning FLOPs ratio  unpruned mAP@0.5  best epoch  train img/s  wall (s)")
    for row in rows:
        print(f"{row['backbone']:<16} {_num(row['pruning'].get('flops_ratio'), '{:.3f}'):<20} "
              f"{_num(row['unpruned_map50']):<17} {row['best_epoch'] or 'n/a'}/{row['epochs'] or '?':<8} "
              f"{_num(row['train_images_per_second'], '{:.1f}'):<12} {_num(row['wall_seconds'], '{:.0f}')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("results/bench_backbones"))
    parser.add_argument("--backbones", nargs="+", default=list(BACKBONES))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--report", action="store_true", help="only re-read finished runs in WORK and print")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each run's local SQLite store
    saved = args.work / "bench_backbones.json"
    if args.report:
        previous = {row["backbone"]: row for row in (json.loads(saved.read_text()) if saved.is_file() else [])}
        rows = [describe(b, args.work, previous.get(b, {}).get("overrides", []),
                         previous.get(b, {}).get("wall_seconds"))
                for b in args.backbones if (args.work / b).is_dir()]
        print_report(rows)
        return
    rows = []
    for backbone in args.backbones:
        if (args.work / backbone).exists():
            raise SystemExit(f"{args.work / backbone} exists: a cold run needs a fresh folder (this script never "
                             "deletes)")
        rows.append(run_backbone(backbone, args.work, args.overrides))
        saved.write_text(json.dumps(rows, indent=2) + "\n")
        print_report(rows)
    print(f"\nfigures: {saved}")


if __name__ == "__main__":
    main()
