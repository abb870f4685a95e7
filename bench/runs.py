"""What the bench scripts read from a finished `qatpipe run --local` folder."""

import json
from pathlib import Path


def evaluation_folders(kfp_root: Path) -> dict[str, Path]:
    """The evaluation folders of the unpruned model ("unpruned") and of the retrained FP32 model ("fp32") under
    a run's kfp/ folder, whichever are there. kfp.local names task folders by task id, so an evaluation is told
    apart by the task that made the model it scored: train, or the export whose report says no QAT."""
    from qatpipe.export.bundle import ExportBundle

    found = {}
    for metrics_path in kfp_root.rglob("metrics.json"):
        model = json.loads(metrics_path.read_text()).get("model")
        if not model:
            continue
        task = Path(model).parent.parent
        if task.name == "train":
            found["unpruned"] = metrics_path.parent
        elif task.name.startswith("export") and "QAT" not in ExportBundle(Path(model)).report.read_text():
            found["fp32"] = metrics_path.parent
    return found


def stage_folders(kfp_root: Path, *stages: str) -> list[Path]:
    """The task folders under a run's kfp/ whose tracking record is one of `stages`' (evaluate_fp32,
    retrain_qat, ...), in path order."""
    return [p.parent for p in sorted(kfp_root.rglob("tracking.json")) if json.loads(p.read_text())["stage"] in stages]


def stage_folder(run: Path, *stages: str) -> Path:
    """The first task folder of a `qatpipe run --local` folder whose record is one of `stages`'; exits naming the
    run when there is none."""
    found = stage_folders(run / "kfp", *stages)
    if not found:
        raise SystemExit(f"{run}: no finished {' or '.join(stages)}")
    return found[0]


def engine_folders(run: Path) -> dict[str, Path]:
    """variant -> the engine folder the run's validate task of that variant scored (where the run folder holds
    several pipeline runs, the newest one's)."""
    verdicts = sorted((run / "kfp").glob("*/validate*/results/validation.json"), key=lambda p: p.stat().st_mtime)
    return {verdict["variant"]: Path(verdict["engine"]) for verdict in map(_read, verdicts)}


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def time_in_rounds(runners: dict, batches: dict, rounds: int, iterations: int, min_seconds: float,
                   log=None) -> dict[str, dict[int, list[dict]]]:
    """Every engine (name -> its run(batch) callable) timed once a round at every batch size (size -> batch), for
    `rounds` rounds, with qatpipe's latency harness: a slow spell of a shared machine hits all engines alike and
    shows as the spread of the per-round speed-ups, not as one engine's figure. name -> size -> the rounds'
    figures (latency_ms_p50, ..., throughput)."""
    from qatpipe.engines.latency import measure_latency

    timed: dict[str, dict[int, list[dict]]] = {name: {size: [] for size in batches} for name in runners}
    for round_ in range(rounds):
        for name, run in runners.items():
            for size, batch in batches.items():
                timed[name][size].append(measure_latency(run, batch, warmup=5, iterations=max(1, iterations // rounds),
                                                         min_seconds=min_seconds / rounds).to_dict())
        if log:
            largest = max(batches)
            log.info("round %d/%d: %s", round_ + 1, rounds, ", ".join(
                f"{name} {per[largest][-1]['latency_ms_p50']:.1f} ms" for name, per in timed.items()))
    return timed


def median_round(timings: list[dict]) -> dict:
    """One engine's figures at one batch size over the rounds: each latency the median of the rounds'."""
    import numpy as np

    merged = {key: round(float(np.median([t[key] for t in timings])), 3)
              for key in timings[0] if key.startswith("latency_ms_")}
    return {**merged, "batch_size": timings[0]["batch_size"], "iterations": sum(t["iterations"] for t in timings),
            "throughput": round(timings[0]["batch_size"] * 1000.0 / merged["latency_ms_p50"], 2)}


def ci_text(ci, scale: float = 1.0, sign: str = "") -> str:
    """A CI as printed: "[lo, hi]", 3 decimals, or 2 where `scale` makes it points (100; `sign` "+" signs them)."""
    return f"[{scale * ci[0]:{sign}.{2 if scale > 1 else 3}f}, {scale * ci[1]:{sign}.{2 if scale > 1 else 3}f}]" \
        if ci else "n/a"


def speedup_range(fp32_rounds: list[dict], engine_rounds: list[dict]) -> list[float]:
    """[lowest, highest] over the rounds of that round's FP32 p50 over the engine's: the spread the machine
    gives a speed-up."""
    ratios = [f["latency_ms_p50"] / e["latency_ms_p50"] for f, e in zip(fp32_rounds, engine_rounds)]
    return [round(min(ratios), 2), round(max(ratios), 2)]
