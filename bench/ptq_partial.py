"""Benchmark: the ptq-partial variant again on a finished pipeline run, with this checkout's library (issue 37).

    python bench/ptq_partial.py RUN [--set KEY=VALUE ...]

RUN is a `qatpipe run --local` folder (bench/qat_value.py's WORK/<backbone>); --set gives the overrides the run
was made with (its spec is the default one with them). The run's PTQ model goes through the sensitivity stage and
the ptq-partial stage again (`ptq.keep_float: auto`), then is built into an engine and validated against the
run's FP32 evaluation, as the pipeline does, into RUN_ptq_partial/. Prints the search (layers kept float, the
scores on the sensitivity sample and, for the models it passed, on every val image) and mAP@0.5 on the whole val
set in TensorRT's numbers with 95% bootstrap CIs, paired with the run's own fp32, ptq and ptq-partial validations.
Writes RUN_ptq_partial/bench_ptq_partial.json.

Target (issue 37): ptq-partial reaches the budget (validate.max_map_drop) with the fewest float layers the
sensitivity ranking allows.
"""

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

from runs import ci_text  # bench/runs.py, beside this script

from qatpipe_pipelines.run_folder import RunFolder, variant_stage

log = logging.getLogger("bench")
RUN_VARIANTS = ("fp32", "ptq", "ptq-partial")  # the run's validations this one is paired with


def partial_again(run: Path, sets: list[str], out: Path) -> dict:
    """The run's PTQ model through the sensitivity and ptq-partial stages, built and validated, into `out` (made
    anew): the ptq-partial report, the gate's verdict, the stage seconds and the engine's compute layers."""
    from qatpipe.data.prepare import spec_with_prepared_dataset
    from qatpipe.spec import bundled_spec_path, load_spec
    from qatpipe.stages.build_engine import build_engine
    from qatpipe.stages.ptq_partial import ptq_partial
    from qatpipe.stages.sensitivity import sensitivity
    from qatpipe.stages.validate import validate

    dataset = RunFolder(run).stage("prepare_data")
    spec = spec_with_prepared_dataset(load_spec(bundled_spec_path("full"), sets), dataset)
    fp32_onnx = RunFolder(run).stage("export_fp32") / "model.onnx"
    ptq_onnx = RunFolder(run).stage("ptq") / "model.onnx"
    if out.exists():
        shutil.rmtree(out)
    seconds = {}
    started = time.perf_counter()
    sensitivity(spec, ptq_onnx, out / "sensitivity", fp32_onnx)
    seconds["sensitivity"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    report = ptq_partial(spec, fp32_onnx, ptq_onnx, out / "onnx_model" / "model.onnx", out / "sensitivity")
    seconds["ptq_partial"] = round(time.perf_counter() - started, 1)
    engine = build_engine(spec, out / "onnx_model" / "model.onnx", out / "engine", backend="onnxruntime")
    started = time.perf_counter()
    verdict = validate(spec, out / "engine", RunFolder(run).stage("evaluate_fp32") / "metrics.json", out / "validation",
                       variant="ptq-partial", onnx_model=out / "onnx_model" / "model.onnx")
    seconds["validate"] = round(time.perf_counter() - started, 1)
    layers = engine["layer_precision"]
    return {"report": report, "passed": verdict["passed"], "seconds": seconds,
            "layers": f"{layers['int8']} / {layers['fp16']} / {layers['fp32']}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    from qatpipe.stages.compare import uncertainty

    run = args.run.resolve()
    out = run.parent / f"{run.name}_ptq_partial"
    found = partial_again(run, args.overrides, out)
    evaluations = {name: RunFolder(run).stage(variant_stage("validate", name)) for name in RUN_VARIANTS}
    evaluations["ptq-partial (now)"] = out / "validation"
    pairs = [("ptq-partial (now)", name) for name in RUN_VARIANTS] + [("ptq", "fp32"), ("ptq-partial", "fp32")]
    scored = uncertainty(evaluations, pairs=pairs)
    report = found["report"]
    row = {"run": str(run), "overrides": args.overrides, "float_layers": report["float_layers"],
           "layers_total": report["layers_total"], "budget": report["budget"], "budget_met": report["budget_met"],
           "map50_subset": report["map50"], "map50_subset_fp32": report["map50_fp32"],
           "map50_subset_int8": report["map50_int8"], "val_images_subset": report["val_images"],
           "steps": [(len(step["float_layers"]), step["map50"], step.get("map50_all")) for step in report["steps"]],
           "map50_all": report.get("map50_all"), "map50_all_fp32": report.get("map50_fp32_all"),
           "val_images_all": report.get("val_images_all"),
           "gate_passed": found["passed"], "seconds": found["seconds"], "layers": found["layers"],
           "variants": {name: v["map50"] for name, v in scored["variants"].items()},
           "pairs": {key: pair["map50"] for key, pair in scored["pairs"].items()}, "val_images": scored["images"]}
    (out / "bench_ptq_partial.json").write_text(json.dumps(row, indent=2))

    confirmed = sum(step[2] is not None for step in row["steps"])
    on_all = (f" and on all {row['val_images_all']} ({row['map50_all']:.4f} against FP32 {row['map50_all_fp32']:.4f}; "
              f"{confirmed} model(s) scored there)" if row["map50_all"] is not None else "")
    print(f"\n{run.name}: ptq-partial again kept {len(row['float_layers'])} of {row['layers_total']} layers float, "
          f"budget {row['budget']} {'met' if row['budget_met'] else 'NOT met'} on its {row['val_images_subset']} "
          f"val images ({row['map50_subset']:.4f} against FP32 {row['map50_subset_fp32']:.4f}, all INT8 "
          f"{row['map50_subset_int8']:.4f}){on_all}; {len(row['steps'])} models scored; seconds {row['seconds']}")
    print(f"float: {', '.join(row['float_layers']) or 'none'}; compute layers INT8 / FP16 / FP32: {row['layers']}; "
          f"gate {'passed' if row['gate_passed'] else 'FAILED'}")
    print(f"mAP@0.5 on {row['val_images']} val images, TensorRT's numbers (paired bootstrap, 95% CI):")
    for name, v in row["variants"].items():
        print(f"  {name:<18} {v['value']:.4f} {ci_text(v['ci95'])}")
    for key, pair in row["pairs"].items():
        print(f"  {key:<30} {100 * pair['diff']:+.2f} {ci_text(pair['ci95'], 100, '+')} points")


if __name__ == "__main__":
    main()
