"""Benchmark helper: the paired mAP difference between two evaluations of the same val set.

    python bench/paired.py EVAL_A EVAL_B [--names A B]

EVAL_A and EVAL_B are evaluation folders (`qatpipe evaluate -o DIR`, or an evaluate task's output) holding
`ground_truth.json` and `detections.json`. Prints each one's mAP@0.5 and mAP@[.5:.95] and the difference B - A
with its 95% CI from the paired bootstrap over the val images (1,000 resamples, seed 0), the one `compare` uses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def paired_difference(first: Path, second: Path, names: tuple[str, str] = ("a", "b")) -> dict:
    """{metric: {names[0]: value, names[1]: value, "diff": second - first, "ci95": [lo, hi]}, "images": n}."""
    from qatpipe.metrics.bootstrap import match_detections, paired_bootstrap
    from qatpipe.stages.evaluate import DETECTIONS_FILE, GROUND_TRUTH_FILE

    truths = [json.loads((folder / GROUND_TRUTH_FILE).read_text()) for folder in (first, second)]
    if truths[0] != truths[1]:
        raise SystemExit(f"{first} and {second} were scored on different val sets")
    matched = {name: match_detections(truths[0], json.loads((folder / DETECTIONS_FILE).read_text()))
               for name, folder in zip(names, (first, second))}
    pair = f"{names[1]}-{names[0]}"
    boot = paired_bootstrap(matched, [(names[1], names[0])])
    return {"images": boot["images"], **{
        metric: {**{name: boot["variants"][name][metric]["value"] for name in names},
                 "diff": boot["pairs"][pair][metric]["diff"], "ci95": boot["pairs"][pair][metric]["ci95"]}
        for metric in ("map50", "map")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--names", nargs=2, default=["a", "b"])
    args = parser.parse_args()
    result = paired_difference(args.first, args.second, tuple(args.names))
    a, b = args.names
    print(f"paired bootstrap over {result['images']} val images (1000 resamples, seed 0)")
    print(f"metric        {a:>10} {b:>10}  {b} - {a} (points)  95% CI (points)")
    for metric, label in (("map50", "mAP@0.5"), ("map", "mAP@[.5:.95]")):
        r = result[metric]
        print(f"{label:<13} {r[a]:10.4f} {r[b]:10.4f}  {100 * r['diff']:+8.2f}            "
              f"[{100 * r['ci95'][0]:+.2f}, {100 * r['ci95'][1]:+.2f}]")


if __name__ == "__main__":
    main()
