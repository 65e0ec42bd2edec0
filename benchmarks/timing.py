"""Timing side by side: the variants of a case alternate, repetition after repetition, after a warm-up;
a ratio is the median (and spread) of the per-repetition ratios, so drift hits every variant alike, with
a distribution-free 95% interval of that median (:func:`median_interval`): a goal is met only where the
whole interval is.

Two clocks: **host time** (wall clock around the calls, the device synchronised) and **device time**
(:meth:`Timer.device_side_by_side`): the sum of the kernels' durations that ``torch.profiler`` records
while the calls run, the host's noise left out. On CUDA these are the GPU's kernels, copies and memsets
(CUPTI's records); on the CPU, its twin, the self time of every aten op (the host's compute, without the
Python around it), which makes the same kernel list and op count of a step testable without a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


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

    def kernels(self, fn, calls: int = 1) -> tuple[float, Counter]:
        """Device seconds per call of ``fn`` (the sum of its kernels' durations) and its kernels per call:
        a ``Counter`` of kernel names (CUDA: the GPU's kernels, copies and memsets; CPU: the aten ops,
        each counted once however deep it was called, timed by its self time).

        Read from the profiler's raw records (:func:`device_records`), not from ``prof.events()``:
        building those Python objects took about 1 s a profile of a few thousand ops (25-40x the raw
        read), 85 s of an eager case's 7 repetitions of 11 variants on an H200 (2026-11-28). On CUDA only
        the device's activity is recorded, the host's ops are not needed."""
        cuda = self.device.type == "cuda"
        self.sync()
        with (
            _kineto_quiet(),
            profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof,
        ):
            for _ in range(calls):
                fn()
            self.sync()
        micros, names = device_records(prof.profiler.kineto_results.events(), cuda)
        per_call = Counter({name: count / calls for name, count in names.items()})
        return micros * 1e-6 / calls, per_call

    def device_side_by_side(
        self, variants: dict, reps: int, inner: int
    ) -> tuple[dict[str, list[float]], dict[str, Counter]]:
        """Device seconds per call of each variant, per repetition (alternating as :meth:`side_by_side`;
        the variants are warm), and each variant's kernels per call in the last repetition."""
        times: dict[str, list[float]] = {name: [] for name in variants}
        kernels: dict[str, Counter] = {}
        items = list(variants.items())
        for rep in range(reps):
            for name, fn in items if rep % 2 == 0 else reversed(items):
                seconds, kernels[name] = self.kernels(fn, inner)
                times[name].append(seconds)
        return times, kernels


def per_step(times: dict[str, list[float]], kernels: dict[str, Counter]) -> dict:
    """What :meth:`Timer.device_side_by_side` measured, as the results keep it: each variant's device
    seconds per step (the median over repetitions) and its kernels per step."""
    return {
        "device_seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "kernels_per_step": {k: sum(c.values()) for k, c in kernels.items()},
    }


def kernels_apart(kernels: dict[str, Counter], a: str, b: str) -> tuple[dict, dict]:
    """The kernels per step variant ``a`` runs beyond ``b``'s, and ``b`` beyond ``a``'s."""
    mine, other = kernels[a], kernels[b]
    return {k: v for k, v in (mine - other).items() if v}, {k: v for k, v in (other - mine).items() if v}


# what torch.profiler leaves out of its own event list (torch.autograd.profiler_util._filter_name)
_PROFILER_OWN = {
    "[memory]", "[OutOfMemory]", "profiler::_record_function_enter", "profiler::_record_function_enter_new",
    "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version",
}  # fmt: skip


def device_records(records, cuda: bool) -> tuple[float, Counter]:
    """Microseconds and a ``Counter`` of names from kineto's raw records: on CUDA the device's records
    (kernels, copies, memsets) and their durations; on the CPU the aten ops and their self times (an
    op's duration less its direct children's on the same thread, as ``FunctionEvent.self_cpu_time_total``
    computes it; the profiler's own records left out as ``prof.events()`` leaves them)."""
    names: Counter = Counter()
    if cuda:
        micros = 0.0
        for record in records:
            if record.device_type() == DeviceType.CUDA:
                micros += record.duration_ns() / 1e3
                names[torch._C._demangle(record.name())] += 1  # (as prof.events() names them)
        return micros, names
    by_thread: dict[int, list] = {}
    for record in records:
        if record.device_type() != DeviceType.CPU or record.is_async() or record.name() in _PROFILER_OWN:
            continue
        by_thread.setdefault(record.start_thread_id(), []).append(
            (record.start_ns(), -record.end_ns(), record.name())
        )
    total_ns = 0
    for spans in by_thread.values():
        spans.sort()  # by start, the outer of two spans that start together first
        stack: list[list] = []  # [end, name, duration, children's time, children, the last child's name]
        for start, neg_end, name in spans:
            while stack and stack[-1][0] <= start:
                total_ns += _closed(stack.pop(), stack, names)
            stack.append([-neg_end, name, -neg_end - start, 0, 0, None])
        while stack:
            total_ns += _closed(stack.pop(), stack, names)
    return total_ns / 1e3, names


def _closed(span: list, stack: list, names: Counter) -> int:
    """A span's self time if it is an aten op (counted in ``names``), else 0. Its duration goes to its
    parent's children; an op whose only child has its name counts once (``prof.events()`` merges the
    two: ``EventList._remove_dup_nodes``), the self times summing to the same."""
    _, name, duration, children, count, only = span
    if stack:
        parent = stack[-1]
        parent[3] += duration
        parent[4] += 1
        parent[5] = name
    if not name.startswith("aten::"):
        return 0
    names[name] += 1 if not (count == 1 and only == name) else 0
    return duration - children


@contextlib.contextmanager
def _kineto_quiet():
    """The profiler's library (kineto) writes two lines per profile to the process's stderr (``USDT: ...
    profiler_start``), whatever its log level: that file descriptor goes to /dev/null meanwhile (Python's
    own warnings go where the runner sends them, not through it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics ``(x_(k), x_(n-k+1))``
    with the largest ``k`` whose binomial coverage ``1 - 2 P(Bin(n, 1/2) < k)`` is at least
    ``confidence`` (n >= 6 for 95%; fewer values give their whole range)."""
    ordered, n = sorted(values), len(values)
    k, below = 0, 0.0  # below: P(Bin(n, 1/2) <= k - 1), the mass outside on one side
    while k < n // 2:
        mass = below + math.comb(n, k) / 2**n
        if 1 - 2 * mass < confidence:
            break
        below, k = mass, k + 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def ratio(times: dict[str, list[float]], a: str, b: str) -> dict:
    """Median and spread of ``a / b`` over repetitions (each pair timed in the same repetition), and the
    95% interval of the median (``low``, ``high``: :func:`median_interval`)."""
    per_rep = [x / y for x, y in zip(times[a], times[b], strict=True)]
    low, high = median_interval(per_rep)
    return {
        "median": statistics.median(per_rep),
        "min": min(per_rep),
        "max": max(per_rep),
        "low": low,
        "high": high,
        "n": len(per_rep),
    }


def fmt_added(r: dict) -> str:
    """A ratio of two added times (benchmarks/cases/host.py's ``ratio_of_medians``): ``ratio (difference
    +d µs [low, high])``, the difference per call and its median's 95% interval standing for the spread."""
    d = r["difference_us"]
    return f"{r['median']:.3f} ({d['median']:+.1f} µs [{d['low']:+.1f}, {d['high']:+.1f}])"


def fmt(r: dict) -> str:
    """``median (min..max)``, and the median's 95% interval where recorded: ``[low, high]``."""
    interval = f" [{r['low']:.3f}, {r['high']:.3f}]" if "low" in r else ""
    return f"{r['median']:.3f} ({r['min']:.3f}..{r['max']:.3f}){interval}"
