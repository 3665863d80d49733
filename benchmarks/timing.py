"""Clocks for the benchmark: warmup, median of repeats, per-step timing, memory readings.

Why this exists: on a shared, noisy CPU a single timing is worthless and a mean is dragged by the slowest
outlier, so every reported number is a median over repeats taken after a warmup, with ``time.perf_counter``.
On CUDA the device is synchronized before each clock reading, so a step's time includes its kernels.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = [
    "Stopwatch",
    "StepStats",
    "summarize",
    "median_of_repeats",
    "device_sync",
    "rss_bytes",
    "peak_rss_bytes",
    "fresh_memory_baseline",
]


def device_sync(device: Any) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on CPU)."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return _noop


def _noop() -> None:
    return None


@dataclass
class Stopwatch:
    """Accumulates per-step durations (seconds) measured with ``perf_counter`` around a synchronized region."""

    sync: Callable[[], None] = _noop
    times: list[float] = field(default_factory=list)
    _t0: float = 0.0

    def start(self) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self.sync()
        dt = time.perf_counter() - self._t0
        self.times.append(dt)
        return dt


@dataclass(frozen=True)
class StepStats:
    """Summary of per-step times of one measurement (seconds).

    Attributes:
        value: median over repeats of each repeat's mean step time: the headline number.
        step_median: median over all measured steps (depth-independent typical step).
        step_p90: 90th percentile over all measured steps.
        repeats: number of repeats that went into ``value``.
        steps: number of measured steps in total.
    """

    value: float
    step_median: float
    step_p90: float
    repeats: int
    steps: int

    def as_dict(self, prefix: str = "step") -> dict[str, float | int]:
        """``{prefix}_ms`` (the headline), ``{prefix}_median_ms``, ``{prefix}_p90_ms``, ``repeats``, ``steps``."""
        return {
            f"{prefix}_ms": self.value * 1e3,
            f"{prefix}_median_ms": self.step_median * 1e3,
            f"{prefix}_p90_ms": self.step_p90 * 1e3,
            "repeats": self.repeats,
            "steps": self.steps,
        }


def summarize(repeats: list[list[float]]) -> StepStats:
    """Summarize per-step times grouped by repeat (empty repeats are ignored)."""
    groups = [r for r in repeats if r]
    if not groups:
        return StepStats(float("nan"), float("nan"), float("nan"), 0, 0)
    means = [sum(r) / len(r) for r in groups]
    flat = sorted(t for r in groups for t in r)
    p90 = flat[min(len(flat) - 1, int(0.9 * len(flat)))]
    return StepStats(statistics.median(means), statistics.median(flat), p90, len(groups), len(flat))


def median_of_repeats(
    fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1, budget_s: float = float("inf")
) -> tuple[float, list[float]]:
    """Run ``fn`` ``warmup`` times untimed, then up to ``repeats`` times timed; return (median, all times).

    Stops early (after at least one timed run) once ``budget_s`` seconds have been spent in timed runs.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        if spent > budget_s:
            break
    return statistics.median(times), times


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return 0


def fresh_memory_baseline() -> int:
    """Collect garbage, then read RSS: the baseline for an RSS-delta memory measurement."""
    gc.collect()
    return rss_bytes()
