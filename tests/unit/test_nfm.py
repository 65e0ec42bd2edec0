"""NoisyFeatureMixup: Manifold Mixup exactly when the noise is off, and noise within its levels."""

import torch
from scipy import stats
from torch import nn

from mixhook import ManifoldMixup, NoisyFeatureMixup
from tests.helpers import mlp


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_noisy_feature_mixup_without_noise_equals_manifold_mixup_bit_for_bit():
    model = mlp().train()
    x = torch.randn(5, 6, dtype=torch.double)
    outs = []
    for cls, kwargs in ((ManifoldMixup, {}), (NoisyFeatureMixup, {"add_noise": 0.0, "mult_noise": 0.0})):
        mix = cls(["input", "2"], alpha=1.0, generator=gen(8), **kwargs)
        with mix.attach(model):
            outs.append([(model(x), mix.last.layer, mix.last.lam, mix.last.index) for _ in range(5)])
    for (o1, l1, lam1, i1), (o2, l2, lam2, i2) in zip(*outs, strict=True):
        assert torch.equal(o1, o2) and l1 == l2 and torch.equal(lam1, lam2) and torch.equal(i1, i2)


def test_noisy_feature_mixup_noise_levels_bound_the_perturbation():
    h = nn.Identity()
    model = nn.Sequential(h).train()
    x = torch.rand(4000, 1, dtype=torch.double) + 1.0
    mult = NoisyFeatureMixup("0", add_noise=0.0, mult_noise=0.2, generator=gen(1))
    with mult.attach(model):
        mult.pin(lam=1.0, index=torch.arange(4000))
        ratio = model(x) / x  # 1 + 0.2 * b * U(-1, 1), b ~ Beta(2, 5) in (0, 1)
    level = float(mult.last.info["mult_level"])  # 0.2 * b, recorded
    assert 0 < level < 0.2 and "add_level" not in mult.last.info
    assert 1 - level <= float(ratio.min()) < 1 < float(ratio.max()) <= 1 + level
    assert float(ratio.max()) > 1 + 0.99 * level  # 4000 uniforms reach the bound
    add = NoisyFeatureMixup("0", add_noise=0.4, mult_noise=0.0, generator=gen(1))
    with add.attach(model):
        add.pin(lam=1.0, index=torch.arange(4000))
        noise = model(x) - x  # 0.4 * b * N(0, 1)
    assert abs(float(noise.mean())) < 0.05 and 0.0 < float(noise.std()) < 0.4
    assert stats.normaltest(noise.flatten().numpy()).pvalue > 1e-3
