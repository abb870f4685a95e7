"""One latency harness for every engine backend: warm-up, timed runs, percentiles, throughput, memory."""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np


@dataclass
class LatencyResult:
    batch_size: int
    iterations: int
    latency_ms_p50: float
    latency_ms_p95: float
    latency_ms_p99: float
    latency_ms_mean: float
    throughput: float  # images per second at this batch size

    def to_dict(self) -> dict:
        return asdict(self)


def measure_latency(run: Callable[[np.ndarray], object], batch: np.ndarray, warmup: int, iterations: int,
                    min_seconds: float = 0.0) -> LatencyResult:
    """Time `run(batch)` after `warmup` untimed calls: at least `iterations` calls and `min_seconds`."""
    for _ in range(warmup):
        run(batch)
    times = []
    started = time.perf_counter()
    while len(times) < iterations or time.perf_counter() - started < min_seconds:
        t0 = time.perf_counter()
        run(batch)
        times.append(time.perf_counter() - t0)
    ms = np.array(times) * 1000.0
    return LatencyResult(
        batch_size=len(batch), iterations=len(times),
        latency_ms_p50=round(float(np.percentile(ms, 50)), 3), latency_ms_p95=round(float(np.percentile(ms, 95)), 3),
        latency_ms_p99=round(float(np.percentile(ms, 99)), 3), latency_ms_mean=round(float(ms.mean()), 3),
        throughput=round(len(batch) * 1000.0 / float(np.median(ms)), 2),
    )


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)
