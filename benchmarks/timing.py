"""Timing side by side: the variants of a case alternate, repetition after repetition, after a warm-up;
a ratio is the median (and spread) of the per-repetition ratios, so drift hits every variant alike."""

from __future__ import annotations

import statistics
import time

import torch


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def side_by_side(self, variants: dict, reps: int, inner: int, warmup: int) -> dict[str, list[float]]:
        """Seconds per call of each variant, per repetition; the order alternates every repetition."""
        for fn in variants.values():
            for _ in range(warmup):
                fn()
        self.sync()
        times: dict[str, list[float]] = {name: [] for name in variants}
        items = list(variants.items())
        for rep in range(reps):
            for name, fn in items if rep % 2 == 0 else reversed(items):
                self.sync()
                start = time.perf_counter()
                for _ in range(inner):
                    fn()
                self.sync()
                times[name].append((time.perf_counter() - start) / inner)
        return times


def ratio(times: dict[str, list[float]], a: str, b: str) -> dict:
    """Median and spread of ``a / b`` over repetitions (each pair timed in the same repetition)."""
    per_rep = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return {"median": statistics.median(per_rep), "min": min(per_rep), "max": max(per_rep), "n": len(per_rep)}


def fmt(r: dict) -> str:
    return f"{r['median']:.3f} ({r['min']:.3f}..{r['max']:.3f})"
