"""Benchmark: the two PTQ baselines (issue "TensorRT 11 and Jetson", item 4): ONNX Runtime's static quantization
(`ptq.tool: onnxruntime`, the pipeline's default) and NVIDIA Model Optimizer's ONNX INT8 PTQ (`ptq.tool:
modelopt`), each with its calibration methods, on finished runs' FP32 models.

    python bench/ptq_tools.py --run WORK/run [--run ...] [--work DIR] [--images 200] [--settings NAME ...]
                              [--pair NAME=FOLDER ...]

A run is a `qatpipe run --local` work folder. Its PTQ task's FP32 ONNX (the model the pipeline's PTQ baseline was
calibrated from) is quantized afresh by the PTQ stage's own code (stages/ptq.py) for each tool and method into
DIR/<run>/<tool>_<method>/, on the spec's calibration sample of `--images` training images. Each INT8 model is
scored as TensorRT computes it (validate's exact CPU form), the FP32 model by the evaluate stage; the differences
come with the paired bootstrap's 95% CI over the val images, against FP32, against the pipeline's default
baseline (onnxruntime, percentile), against the PTQ model the run itself validated (the PTQ stage at the run's
commit: what a change to that stage gains) and as the run's QAT model's lead over it; `--pair NAME=FOLDER` adds
another model's evaluation folder (detections.json, ground_truth.json on the same val images: an extra QAT retrain
of bench/qat_value.py) as NAME's lead over each. `--settings` picks some of tool_method. Model Optimizer runs in
its own environment (`make modelopt`). No TensorRT here: engine speed is not compared. Writes DIR/bench_ptq_tools.json.
"""

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger("bench")

SETTINGS = (("onnxruntime", "percentile"), ("onnxruntime", "entropy"), ("onnxruntime", "minmax"),
            ("modelopt", "entropy"), ("modelopt", "minmax"))
BASELINE = "onnxruntime_percentile"
RUN_VARIANTS = {"run_ptq": "ptq", "run_qat": "qat"}  # the run's own validations, in TensorRT's numbers


def _ptq_task(run: Path) -> tuple[Path, Path]:
    """(the FP32 ONNX the run's PTQ task calibrated, the spec.yaml of the FP32 retrain that made it)."""
    from qatpipe.export.bundle import ExportBundle
    from qatpipe_pipelines.run_folder import RunFolder

    folder = RunFolder(run)
    fp32_onnx = Path(json.loads(ExportBundle(folder.variant("ptq").onnx).ptq_report.read_text())["source"])
    return fp32_onnx, folder.stage("finetune_fp32", "retrain_fp32") / "spec.yaml"


def _run_validation(run: Path, variant: str) -> Path | None:
    """The folder of the run's own validation of `variant` as TensorRT scores it, or None."""
    from qatpipe.stages.compare import tensorrt_emulated_folders
    from qatpipe_pipelines.run_folder import RunFolder, variant_stage

    found = RunFolder(run).find(variant_stage("validate", variant))
    if found is None:
        return None
    return (tensorrt_emulated_folders({variant: found}) or {variant: found})[variant]


def bench_run(run: Path, work: Path, images: int, settings=SETTINGS, others: dict | None = None) -> list[dict]:
    import onnx

    from qatpipe.spec import load_spec
    from qatpipe.stages.compare import uncertainty
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.ptq import ptq
    from qatpipe.stages.validate import exact_form_map50

    fp32_onnx, spec_path = _ptq_task(run)
    spec = load_spec(spec_path)
    spec.ptq.calibration_images, spec.ptq.report_images = images, 0
    root = work / run.name
    shutil.rmtree(root, ignore_errors=True)
    scores = {"fp32": evaluate(spec, fp32_onnx, root / "fp32")["map50"]}
    rows = []
    for tool, method in settings:
        name = f"{tool}_{method}"
        spec.ptq.tool, spec.ptq.method = tool, method
        started = time.monotonic()
        report = ptq(spec, fp32_onnx, root / name / "model.onnx")
        seconds = time.monotonic() - started
        scores[name] = exact_form_map50(spec, root / name / "model.onnx", root / name, name)
        check = report["qdq_check"]  # the PTQ stage's TensorRT rule check (it fails the stage on a problem)
        nodes = onnx.load(root / name / "model.onnx").graph.node
        rows.append({"run": str(run), "backbone": spec.model.backbone.name, "tool": tool, "method": method,
                     "calibration_images": report["calibration_images"], "seconds": round(seconds, 1),
                     "map50": scores[name], "quantized_layers": len(check["quantized"]),
                     "float_layers": len(check["float"]), "quantize_nodes": sum(n.op_type == "QuantizeLinear"
                                                                                for n in nodes),
                     "versions": report["versions"]})
        log.info("%s %s/%s: mAP@0.5 %.4f (FP32 %.4f), %.0f s", run.name, tool, method, scores[name],
                 scores["fp32"], seconds)
    folders = {"fp32": root / "fp32", **{f"{r['tool']}_{r['method']}": root / f"{r['tool']}_{r['method']}"
                                         for r in rows}}
    names = [name for name in folders if name != "fp32"]
    for label, variant in RUN_VARIANTS.items():
        if (found := _run_validation(run, variant)) is not None:
            folders[label] = found
    others = others or {}
    folders.update(others)
    pairs = uncertainty(folders, pairs=[(name, "fp32") for name in [*names, *RUN_VARIANTS, *others]]
                        + [(name, BASELINE) for name in names if name != BASELINE]
                        + [(name, "run_ptq") for name in names]
                        + [(lead, name) for lead in ("run_qat", *others) for name in names])["pairs"]
    for row in rows:
        name = f"{row['tool']}_{row['method']}"
        row["fp32_map50"] = scores["fp32"]
        row["vs_fp32"] = {key: pairs[f"{name}-fp32"]["map50"][key] for key in ("diff", "ci95")}
        for label, pair in (("vs_baseline", f"{name}-{BASELINE}"), ("vs_run_ptq", f"{name}-run_ptq"),
                            ("run_qat_vs", f"run_qat-{name}"), ("run_ptq_vs_fp32", "run_ptq-fp32"),
                            ("run_qat_vs_fp32", "run_qat-fp32")):
            if pair in pairs:
                row[label] = {key: pairs[pair]["map50"][key] for key in ("diff", "ci95")}
        row["pairs"] = {other: {"vs": {key: pairs[f"{other}-{name}"]["map50"][key] for key in ("diff", "ci95")},
                                "vs_fp32": {key: pairs[f"{other}-fp32"]["map50"][key] for key in ("diff", "ci95")}}
                        for other in others}
    return rows


def _points(pair: dict | None) -> str:
    if pair is None:
        return "—"
    lo, hi = (100 * v for v in pair["ci95"])
    return f"{100 * pair['diff']:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def print_rows(rows: list[dict]) -> None:
    print("\nPTQ tools (INT8 mAP@0.5 as TensorRT computes it, validate's exact CPU form; differences in points with "
          "the paired bootstrap's 95% CI; every model passed the PTQ stage's TensorRT rule check)\n")
    print("| run | backbone | tool | method | mAP@0.5 (FP32) | INT8 − FP32 | − onnxruntime percentile | "
          "− the run's PTQ (its − FP32) | the run's QAT − this (its − FP32) | Conv/Gemm INT8 / float | "
          "QuantizeLinear nodes | calibration s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['run']).name} | {r['backbone']} | {r['tool']} | {r['method']} | {r['map50']:.4f} "
              f"({r['fp32_map50']:.4f}) | {_points(r['vs_fp32'])} | {_points(r.get('vs_baseline'))} | "
              f"{_points(r.get('vs_run_ptq'))} ({_points(r.get('run_ptq_vs_fp32'))}) | "
              f"{_points(r.get('run_qat_vs'))} ({_points(r.get('run_qat_vs_fp32'))}) | "
              f"{r['quantized_layers']} / {r['float_layers']} | {r['quantize_nodes']} | {r['seconds']:.0f} |")
    for r in rows:
        for other, pair in r.get("pairs", {}).items():
            print(f"- {Path(r['run']).name}: {other} − {r['tool']} {r['method']}: {_points(pair['vs'])} "
                  f"({other} − FP32: {_points(pair['vs_fp32'])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, action="append", required=True, help="a finished run's work folder")
    parser.add_argument("--work", type=Path, default=Path("results/bench_ptq_tools"))
    parser.add_argument("--images", type=int, default=200, help="calibration images (the default spec's)")
    names = [f"{tool}_{method}" for tool, method in SETTINGS]
    parser.add_argument("--settings", nargs="+", choices=names, default=names, help="tool_method, default all")
    parser.add_argument("--pair", action="append", default=[], metavar="NAME=FOLDER",
                        help="another model's evaluation folder, paired as NAME's lead over each model")
    args = parser.parse_args()
    others = {name: Path(folder) for name, _, folder in (pair.partition("=") for pair in args.pair)}
    settings = [setting for setting in SETTINGS if f"{setting[0]}_{setting[1]}" in args.settings]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rows = [row for run in args.run for row in bench_run(run, args.work, args.images, settings, others)]
    args.work.mkdir(parents=True, exist_ok=True)
    (args.work / "bench_ptq_tools.json").write_text(json.dumps(rows, indent=2) + "\n")
    print_rows(rows)


if __name__ == "__main__":
    main()
