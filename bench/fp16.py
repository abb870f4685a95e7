"""Benchmark: the FP16 forms (issue "TensorRT 11 and Jetson", item 1): mAP@0.5 of each finished run's FP32 and QAT
ONNX in ONNX Runtime, float32 form against FP16 form (export/fp16.py: float regions in FP16 through casts, the
tensors the FP16 guard flags kept FP32), with the paired bootstrap's 95% CI over the val images.

    python bench/fp16.py --run WORK/resnet [--run ...] [--work DIR]

A run is a `qatpipe run --local` work folder (bench/backbones.py's WORK/<backbone>, or make main's results). Each
variant's FP16 form is written afresh from its export's model.onnx (`stages.export.write_fp16_form`, the
export stage's own step) into DIR, then both forms are evaluated by the evaluate stage on the run's val set, the FP16
form as `export.fp16.rounded_form` (every value an FP16 node reads or writes rounded to FP16, arithmetic inside a
node float32, as TensorRT's FP16 kernels accumulate): ONNX Runtime's x86 build has no FP16 kernels for most ops
and would compute the FP16 form itself in float32 between its casts.
Target: the FP16 form within 0.2 points of its float32 form (mAP@0.5; mAP@[.5:.95] printed beside it, where the
ordering of near-certain detections counts). Writes DIR/bench_fp16.json.
"""

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger("bench")
TARGET_POINTS = 0.2


def _run_parts(run: Path) -> tuple[Path, dict[str, Path]]:
    """(the FP32 retrain's spec, {variant: its exported model.onnx}) of a finished run."""
    from qatpipe_pipelines.run_folder import RunFolder

    folder = RunFolder(run)
    variants = folder.variants()
    onnx = {}
    for variant in ("fp32", "qat"):
        if variant in variants and variants[variant].onnx:
            onnx[variant] = variants[variant].onnx
        else:  # an export's record is written once its checks pass
            log.warning("%s: no finished export of %s (refused by its checks?); not benchmarked", run.name, variant)
    return folder.stage("retrain_fp32") / "spec.yaml", onnx


def bench_run(run: Path, work: Path) -> list[dict]:
    from qatpipe.fileio import read_json
    from qatpipe.metrics.bootstrap import match_detections, paired_bootstrap
    from qatpipe.spec import load_spec
    from qatpipe.stages.evaluate import DETECTIONS_FILE, GROUND_TRUTH_FILE, evaluate
    from qatpipe.stages.export import write_fp16_form

    spec_path, onnx = _run_parts(run)
    spec = load_spec(spec_path)
    rows = []
    for variant, source in sorted(onnx.items()):
        folder = work / run.name / variant
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        model = folder / "model.onnx"
        shutil.copyfile(source, model)
        started = time.perf_counter()
        form = write_fp16_form(spec, model, qat=variant == "qat")
        seconds = time.perf_counter() - started
        results, matched = {}, {}
        # the FP16 form as ONNX Runtime's CPU build scores it faithfully (export/fp16.rounded_form)
        import onnx

        from qatpipe.export.fp16 import rounded_form
        from qatpipe.export.onnx_export import save_onnx

        rounded = save_onnx(rounded_form(onnx.load(model), onnx.load(form["onnx"])), folder / "model_fp16_rounded.onnx")
        for name, path in (("float32", model), ("fp16", rounded)):
            results[name] = evaluate(spec, path, folder / f"evaluation_{name}")
            truth = read_json(folder / f"evaluation_{name}" / GROUND_TRUTH_FILE, "ground truth")
            detections = read_json(folder / f"evaluation_{name}" / DETECTIONS_FILE, "detections")
            matched[name] = match_detections(truth, detections)
        pairs = paired_bootstrap(matched, [("fp16", "float32")])["pairs"]["fp16-float32"]
        pair, strict = pairs["map50"], pairs["map"]
        rows.append({"run": str(run), "variant": variant, "map50_float32": results["float32"]["map50"],
                     "map50_fp16": results["fp16"]["map50"], "diff": pair["diff"], "ci95": pair["ci95"],
                     "map_float32": results["float32"]["map"], "map_fp16": results["fp16"]["map"],
                     "map_diff": strict["diff"], "map_ci95": strict["ci95"],
                     "fp16_nodes": form["fp16_nodes"], "fp32_nodes": form["fp32_nodes"],
                     "guard_flags": form["guard_flags"], "layer_max_error": form["layer_max_error"],
                     "conversion_seconds": round(seconds, 1)})
        log.info("%s %s: float32 %.4f, FP16 form %.4f (%+.2f points)", run.name, variant,
                 results["float32"]["map50"], results["fp16"]["map50"], 100 * pair["diff"])
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"\nFP16 forms in ONNX Runtime (mAP@0.5, and mAP@[.5:.95]; FP16 - float32 in points with the paired "
          f"bootstrap's 95% CI; target within {TARGET_POINTS} points at mAP@0.5)\n")
    print("| run | variant | float32 | FP16 form | FP16 - float32 | nodes FP16 / FP32 | guard flags | worst tensor "
          "error | within target | mAP@[.5:.95] float32 / FP16 form | FP16 - float32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lo, hi = (100 * v for v in r["ci95"])
        within = abs(100 * r["diff"]) <= TARGET_POINTS
        strict = (f"{r['map_float32']:.4f} / {r['map_fp16']:.4f} | {100 * r['map_diff']:+.2f} "
                  f"[{100 * r['map_ci95'][0]:+.2f}, {100 * r['map_ci95'][1]:+.2f}]")
        print(f"| {Path(r['run']).name} | {r['variant']} | {r['map50_float32']:.4f} | {r['map50_fp16']:.4f} | "
              f"{100 * r['diff']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {r['fp16_nodes']} / {r['fp32_nodes']} | "
              f"{r['guard_flags']} | {r['layer_max_error']:.2g} | {'yes' if within else 'NO'} | {strict} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, action="append", required=True, help="a finished run's work folder")
    parser.add_argument("--work", type=Path, default=Path("results/bench_fp16"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = [row for run in args.run for row in bench_run(run, args.work)]
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "bench_fp16.json").write_text(json.dumps(rows, indent=2) + "\n")
    print_rows(rows)


if __name__ == "__main__":
    main()
