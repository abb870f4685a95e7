"""What the bench scripts share: what they read from a finished `qatpipe run --local` folder (through
qatpipe_pipelines.run_folder, the reader the local run's summary uses), timing in rounds, and figures as printed."""

import json
from pathlib import Path

from qatpipe_pipelines.run_folder import RunFolder

EVALUATED = ("unpruned", "fp32")  # the models a run's evaluate tasks score (the INT8 variants: validate's)


def evaluation_folders(run: Path) -> dict[str, Path]:
    """model -> the evaluation folder of the unpruned model ("unpruned") and of the FP32 baseline ("fp32") of a
    `qatpipe run --local` folder, whichever it has (their evaluate stages' records)."""
    folder = RunFolder(run)
    found = {model: folder.find(f"evaluate_{model}") for model in EVALUATED}
    return {model: path for model, path in found.items() if path}


def read_json(path: Path) -> dict:
    """A JSON file's object, or {} where there is no such file (a part of a run that has not run)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def num_text(value, fmt: str = "{:.4f}") -> str:
    """A figure as printed: "n/a" where there is none."""
    return "n/a" if value is None else fmt.format(value)


def synthetic_classes(kind: str) -> str:
    """The --set value of dataset.classes for the generated data set `kind` (dataset.synthetic.kind)."""
    from qatpipe.data.synth import KINDS

    return "[" + ", ".join(KINDS[kind].classes) + "]"


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
