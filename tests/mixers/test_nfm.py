"""NoisyFeatureMixup: Manifold Mixup exactly when the noise is off, and noise within its levels."""

import pytest
import torch
from scipy import stats
from torch import nn

from mixhook import ManifoldMixup, NoisyFeatureMixup
from mixhook.engine.contract import Draw
from mixhook.engine.traced import FLAG, Shape, pack
from mixhook.functional import sample_beta
from mixhook.sites import Leaf
from tests.helpers import gen, mlp


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


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]


def _hand_noisy(x, lam, index, state, device):
    """The paper's noisy mixup of ``x`` with the draws replayed from the mixer's generator state: the two
    levels (mult first), then the noise from a generator on ``device`` seeded by one draw (uniforms, then
    normals: :class:`mixhook.functional.DeviceNoise`)."""
    replay = torch.Generator().set_state(state)
    b2, b1 = float(sample_beta(2.0, 5.0, replay)), float(sample_beta(2.0, 5.0, replay))
    noise = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (), generator=replay)))
    uniform = torch.rand(x.shape, generator=noise, device=device, dtype=torch.float64)
    normal = torch.randn(x.shape, generator=noise, device=device, dtype=torch.float64)
    mixed = lam * x + (1 - lam) * x[index]
    return (1 + 0.2 * b2 * (2 * uniform - 1)) * mixed + 0.4 * b1 * normal, (0.2 * b2, 0.4 * b1)


@pytest.mark.parametrize("device", DEVICES)
def test_the_noise_is_drawn_on_the_maps_device_from_one_draw_of_the_mixers_generator(device):
    """One code path on every device: the levels from the mixer's generator, the map-sized noise from a
    generator on the map's device seeded by its next draw (a CPU map runs the path a CUDA map runs)."""
    model = nn.Sequential(nn.Identity()).train().to(device)
    x = torch.randn(6, 4, 5, 5, dtype=torch.float64, device=device)
    mix = NoisyFeatureMixup("0", add_noise=0.4, mult_noise=0.2, generator=gen(4))
    index = torch.tensor([2, 0, 1, 5, 3, 4])
    with mix.attach(model):
        mix.pin(lam=0.3, index=index)
        state = mix.generator.get_state()
        got = model(x)
    expected, (mult, add) = _hand_noisy(x, 0.3, index.to(device), state, device)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-13)
    assert float(mix.last.info["mult_level"]) == pytest.approx(mult)
    assert float(mix.last.info["add_level"]) == pytest.approx(add)


def test_pin_last_and_a_copy_repeat_the_noise_and_the_next_mix_draws_new_noise():
    model = nn.Sequential(nn.Identity()).train()
    x = torch.randn(6, 3, 4, 4, dtype=torch.float64)
    mix = NoisyFeatureMixup("0", generator=gen(2))
    with mix.attach(model):
        first = model(x)
        mix.pin_last()
        again = model(x)
        other = model(x)
    assert torch.equal(first, again) and not torch.allclose(first, other)


def test_no_map_sized_tensor_is_drawn_on_the_host_or_copied_to_the_device():
    """The CPU twin of a GPU run: a map on the meta device (values that do not exist on the host) gets its
    noise drawn there; nothing of the map's size is made on the CPU or copied across."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    seen.append((func.__name__, t.device.type, t.numel()))
            return out

    model = nn.Sequential(nn.Identity()).train().to("meta")
    x = torch.randn(8, 16, 6, 6, device="meta")
    for traced in (False, True):  # an eager mix; the host part of a compiled one (what mixhook::draw packs)
        mix = NoisyFeatureMixup("0", generator=gen(1))
        seen.clear()
        with Record():
            if traced:
                leaf = Leaf("", Shape(tuple(x.shape), x.dtype), 0)
                draw = Draw(
                    "0", torch.tensor(0.3, dtype=torch.float64), torch.arange(8), mix.generator, {}, True, 0.3
                )
                values, _ = mix.draw_traced([leaf], draw)
                packed = pack(
                    [torch.ones((), dtype=torch.bool), *values],
                    [FLAG, *mix.traced_params(8, [leaf])],
                    x.device,
                )
                assert packed.device.type == "meta" and packed.numel() > 2 * 8 * x.numel()
            else:
                with mix.attach(model):
                    model(x)
        draws = [(f, d) for f, d, n in seen if f.startswith(("uniform_", "normal_"))]
        assert len(draws) == 2 and all(d == "meta" for _, d in draws), draws
        assert not [s for s in seen if s[1] == "cpu" and s[2] >= x.numel()], seen
