"""The benchmarks' clocks and verdicts: the median's interval (its binomial coverage), the device-time
accounting's CPU twin (kernels counted and timed from torch.profiler), and goals judged on intervals."""

import math

import pytest
import torch
from scipy import stats

from benchmarks.report import goals
from benchmarks.timing import Timer, device_records, median_interval, ratio


@pytest.mark.parametrize("n", [6, 7, 9, 11, 15, 21, 40])
def test_the_medians_interval_has_the_binomial_coverage_it_claims(n):
    low, high = median_interval(list(range(n)))  # the order statistics x_(k), x_(n-k+1) (0-based: k-1, n-k)
    k = low + 1
    assert high == n - k
    coverage = 1 - 2 * stats.binom.cdf(k - 1, n, 0.5)
    assert coverage >= 0.95  # and one step narrower would not have it
    assert k == n // 2 or 1 - 2 * stats.binom.cdf(k, n, 0.5) < 0.95


def test_five_repetitions_give_their_whole_range():
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)


def test_the_cpu_twin_counts_and_times_each_kernel_of_a_call():
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def step():
        (a @ b).add_(1.0).relu()

    seconds, kernels = Timer(torch.device("cpu")).kernels(step, calls=3)
    assert kernels["aten::mm"] == 1 and kernels["aten::add_"] == 1 and kernels["aten::relu"] == 1
    assert 0 < seconds < 1 and all(name.startswith("aten::") for name in kernels)


def test_the_raw_records_give_what_the_profilers_event_list_gives():
    # the twin reads kineto's records (prof.events() took 25-40x longer to build): the same ops, counted as
    # the event list counts them (an op whose only child has its name once: aten::sum here), the same
    # self times, on a mixed training step with batch norm
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from mixhook import ManifoldMixup

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
    )
    mix = ManifoldMixup("1")
    mix.attach(net)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))

    def step():
        mix.loss(torch.nn.functional.cross_entropy, net(x), y).backward()

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        step()
    micros, names = device_records(prof.profiler.kineto_results.events(), cuda=False)
    expected, expected_micros = Counter(), 0.0
    for event in prof.events():
        if event.name.startswith("aten::"):
            expected[event.name] += 1
            expected_micros += event.self_cpu_time_total
    assert names == expected and names["aten::sum"] >= 2
    assert micros == pytest.approx(expected_micros, rel=1e-9)


def test_device_side_by_side_alternates_and_keeps_each_variants_kernels():
    x = torch.randn(256, 256)
    variants = {"one": lambda: x @ x, "two": lambda: (x @ x, x @ x)}
    times, kernels = Timer(torch.device("cpu")).device_side_by_side(variants, reps=5, inner=2)
    assert [len(t) for t in times.values()] == [5, 5]
    assert kernels["one"]["aten::mm"] == 1 and kernels["two"]["aten::mm"] == 2
    r = ratio(times, "two", "one")
    assert r["low"] <= r["median"] <= r["high"] and 1.2 < r["median"]  # (two products: about 2, noisy)


def _run(low, median, high):
    r = {"median": median, "min": low, "max": high, "low": low, "high": high, "n": 9}
    return {"model": "m", "batch": 8, "vs_none": {"mixup_random": r}, "compiled": False}


@pytest.mark.parametrize(
    ("interval", "verdict"),
    [((0.99, 1.0, 1.015), "yes"), ((1.001, 1.01, 1.04), "not resolved"), ((1.03, 1.05, 1.09), "NO")],
)
def test_a_goal_is_met_only_where_its_whole_interval_is(interval, verdict):
    (row,) = goals({"training_step": [_run(*interval)]}, torch.device("cpu"))
    limit = row["limit"]
    assert row["goal"] == "mixup_vs_none" and limit == 1.02 and math.isclose(row["measured"], interval[1])
    assert row["verdict"] == verdict and row["met"] == (verdict == "yes")
