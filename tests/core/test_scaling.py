"""InputScale: the pre-hook's effect, per-sample ranges, eval gating, errors."""

import copy

import pytest
import torch

from mixhook import InputScale
from tests.helpers import gen, hook_count, mlp


def test_a_float_factor_scales_the_layers_input_in_training_only():
    model = mlp().train()
    x = torch.randn(3, 6, dtype=torch.double)
    with InputScale("2", 0.5).attach(model):
        out = model(x)
        model.eval()
        out_eval = model(x)
    expected = model[4](model[3](model[2](0.5 * model[1](model[0](x)))))
    assert torch.equal(out, expected)
    assert torch.equal(out_eval, model(x))
    assert hook_count(model) == 0


def test_a_range_gives_each_sample_its_own_factor_and_eval_uses_the_midpoint():
    model = mlp().train()
    ref = copy.deepcopy(model)  # the same weights, never hooked
    x = torch.randn(200, 6, dtype=torch.double)
    scale = InputScale("input", (0.5, 1.5), in_eval=True, generator=gen(4))
    with scale.attach(model):
        out = model(x)
        factors = scale.last
        assert factors.shape == (200,) and 0.5 <= float(factors.min()) and float(factors.max()) < 1.5
        assert float(factors.std()) > 0.2  # spread over the range, not one value
        assert torch.equal(out, ref(x * factors.to(x.dtype)[:, None]))
        model.eval()
        assert torch.equal(model(x), ref(x * 1.0))
        assert float(scale.last) == 1.0


def test_same_generator_same_factors():
    model = mlp().train()
    x = torch.randn(5, 6, dtype=torch.double)
    runs = []
    for _ in range(2):
        scale = InputScale("0", (0.9, 1.1), generator=gen(9))
        with scale.attach(model):
            model(x)
        runs.append(scale.last)
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    ("factor", "error", "match"),
    [
        ((2.0, 1.0), ValueError, "needs low <= high"),
        ("big", TypeError, "factor must be a number or a pair"),
        (float("inf"), ValueError, "factor must be finite"),
        ((1.0, 2.0, 3.0), ValueError, "a number or a pair"),
    ],
)
def test_bad_factors_are_refused(factor, error, match):
    with pytest.raises(error, match=match):
        InputScale("input", factor)
