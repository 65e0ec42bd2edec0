"""ManifoldMixup against hand-written computations: the blend, eval identity, loss, targets, pin,
gradients, sampling, and the errors users can cause."""

import copy
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from scipy import stats
from torch import nn

from mixhook import ManifoldMixup, MixState, blend, sample_lam, smooth_one_hot
from mixhook.app.models import PreActResNet18
from tests.helpers import gen, hook_count, mlp


def exact(actual, expected):
    """Equal to the hand-written formula up to float64 rounding (the blend is computed as a lerp)."""
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ the blend itself


def test_hidden_layer_output_is_blended_and_other_layers_untouched():
    model = mlp().train()
    x = torch.randn(5, 6, dtype=torch.double)
    seen = {}
    for name in ("0", "2", "3"):  # record what each layer hands on, after our hook
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, o))
    mix = ManifoldMixup("2", generator=gen())
    index = torch.tensor([4, 3, 2, 1, 0])
    with mix.attach(model):
        mix.pin(lam=0.3, index=index)
        out = model(x)
    h0 = model[0](x)
    h2 = model[2](model[1](h0))
    mixed = 0.3 * h2 + 0.7 * h2[index]
    assert torch.equal(seen["0"], h0)  # before the mix point: untouched
    exact(seen["3"], torch.tanh(mixed))  # after it: computed from the mix
    exact(out, model[4](torch.tanh(mixed)))
    assert mix.last.layer == "2" and float(mix.last.lam) == pytest.approx(0.3)
    assert torch.equal(mix.last.index, index)


def test_input_mixup_mixes_the_models_first_argument():
    model = mlp().train()
    x = torch.randn(6, 6, dtype=torch.double)
    mix = ManifoldMixup("input", generator=gen(1))
    with mix.attach(model):
        out = model(x)
    lam, index = mix.last.lam.double(), mix.last.index
    assert sorted(index.tolist()) == list(range(6))
    exact(out, model(lam * x + (1 - lam) * x[index]))


def test_eval_mode_is_bit_identical_to_unhooked_model_and_keeps_last():
    model = torchvision.models.resnet18(num_classes=7)
    x = torch.randn(4, 3, 32, 32)
    mix = ManifoldMixup(["input", "layer1", "layer3.1.conv2"], generator=gen())
    with mix.attach(model):
        model.train()
        model(x)  # (updates the batch-norm statistics, so compare after it)
        last = mix.last
        model.eval()
        hooked = model(x)
        assert mix.last is last  # .last describes the last *training* forward
    assert hook_count(model) == 0
    assert torch.equal(hooked, model(x))


def test_gradients_equal_hand_split_resnet18_forward_mixed_at_layer2():
    torch.manual_seed(0)
    hooked = torchvision.models.resnet18(num_classes=5).double().train()
    by_hand = copy.deepcopy(hooked)
    x = torch.randn(6, 3, 32, 32, dtype=torch.double)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    lam, index = 0.37, torch.tensor([2, 0, 1, 5, 3, 4])

    mix = ManifoldMixup("layer2", generator=gen())
    with mix.attach(hooked):
        mix.pin(lam=lam, index=index)
        logits = hooked(x)
        mix.loss(F.cross_entropy, logits, y).backward()

    m = by_hand
    h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))
    h = lam * h + (1 - lam) * h[index]
    expected = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(h))), 1))
    loss = lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])
    loss.backward()

    exact(logits, expected)
    for (name, p), q in zip(hooked.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert hook_count(hooked) == 0


def test_gradient_flows_through_both_mixed_terms():
    x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    model = nn.Sequential(nn.Identity(), nn.Identity())
    mix = ManifoldMixup("0", generator=gen())
    with mix.attach(model.train()):
        mix.pin(lam=0.25, index=[1, 0, 3, 2])
        model(x).sum().backward()
    # d/dx_i of sum_j (0.25 x_j + 0.75 x_{index[j]}) = 0.25 + 0.75 (each i appears once in index)
    torch.testing.assert_close(x.grad, torch.ones_like(x))


def test_a_layer_called_twice_in_one_forward_is_mixed_once():
    shared = nn.Linear(3, 3).double()

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = shared

        def forward(self, x):
            return self.block(self.block(x))

    model = Twice().train()
    x = torch.randn(4, 3, dtype=torch.double)
    mix = ManifoldMixup("block", generator=gen())
    with mix.attach(model):
        mix.pin(lam=0.5, index=[3, 2, 1, 0])
        out = model(x)
    h = shared(x)
    exact(out, shared(0.5 * h + 0.5 * h[[3, 2, 1, 0]]))


def test_batch_of_one_mixes_to_identity():
    model = mlp().train()
    x = torch.randn(1, 6, dtype=torch.double)
    with ManifoldMixup(["input", "2"], generator=gen()).attach(model):
        out = model(x)
    torch.testing.assert_close(out, model(x))


def test_mixing_follows_the_activation_dtype():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(torch.bfloat16).train()
    mix = ManifoldMixup("0", generator=gen())
    with mix.attach(model):
        out = model(torch.randn(3, 4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ loss and targets


def test_loss_is_lam_weighted_criterion_and_plain_when_not_mixing():
    model = mlp().train()
    x, y = torch.randn(8, 6, dtype=torch.double), torch.randint(0, 4, (8,))
    mix = ManifoldMixup("input", generator=gen())
    with mix.attach(model):
        logits = model(x)
        lam, index = float(mix.last.lam), mix.last.index
        expected = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])
        torch.testing.assert_close(mix.loss(F.cross_entropy, logits, y), expected)
        # a custom criterion is called with exactly (logits, target) and (logits, target[index])
        calls = []
        mix.loss(lambda out, t: calls.append(t) or out.sum(), logits, y)
        assert torch.equal(calls[0], y) and torch.equal(calls[1], y[index])
    plain = ManifoldMixup("input", prob=0.0, generator=gen())
    with plain.attach(model):
        logits = model(x)
        assert plain.last is None
        assert torch.equal(plain.loss(F.cross_entropy, logits, y), F.cross_entropy(logits, y))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_targets_are_mixed_smoothed_one_hots(smoothing):
    model = mlp().train()
    x, y = torch.randn(5, 6, dtype=torch.double), torch.tensor([0, 3, 1, 1, 2])
    mix = ManifoldMixup("2", generator=gen())
    with mix.attach(model):
        mix.pin(lam=0.8, index=[4, 0, 1, 2, 3])
        logits = model(x)
    soft = mix.targets(y, num_classes=4, smoothing=smoothing)
    on, off = 1 - smoothing + smoothing / 4, smoothing / 4
    s = torch.full((5, 4), off)
    s[torch.arange(5), y] = on
    lam = mix.last.lam
    torch.testing.assert_close(soft, lam * s + (1 - lam) * s[[4, 0, 1, 2, 3]])
    torch.testing.assert_close(soft.sum(1), torch.ones(5))
    if smoothing == 0:  # CE with mixed soft targets == the lam-weighted CE of .loss
        torch.testing.assert_close(
            nn.CrossEntropyLoss()(logits.float(), soft),
            mix.loss(F.cross_entropy, logits.float(), y),
        )


def test_targets_without_mix_and_bad_arguments():
    mix = ManifoldMixup("input")
    y = torch.tensor([2, 0])
    torch.testing.assert_close(mix.targets(y, 3, smoothing=0.3), smooth_one_hot(y, 3, 0.3))
    with pytest.raises(ValueError, match="class indices must lie in \\[0, 3\\)"):
        mix.targets(torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="smoothing"):
        mix.targets(y, 3, smoothing=1.0)
    with pytest.raises(ValueError, match="do not have num_classes=3 classes along dimension 1"):
        mix.targets(torch.tensor([0.0, 1.0]), 3)  # floating targets are taken as given: (B, K)
    with pytest.raises(ValueError, match="class indices need num_classes"):
        mix.targets(y)
    with pytest.raises(ValueError, match="integer class indices or floating targets, got torch.bool"):
        mix.targets(torch.tensor([True, False]), 2)


def test_loss_refuses_targets_of_another_batch():
    model = mlp().train()
    mix = ManifoldMixup("input", generator=gen())
    with mix.attach(model):
        logits = model(torch.randn(4, 6, dtype=torch.double))
    with pytest.raises(ValueError, match="3 rows but the forward that produced the logits mixed a batch"):
        mix.loss(F.cross_entropy, logits[:3], torch.tensor([0, 1, 2]))


# ----------------------------------------------------------------------------------- pin and draws


def test_pin_applies_once_then_sampling_resumes_from_the_generator():
    model = mlp().train()
    x = torch.randn(4, 6, dtype=torch.double)
    mix = ManifoldMixup(["input", "0", "2"], generator=gen(5))
    twin = ManifoldMixup(["input", "0", "2"], generator=gen(5))
    with mix.attach(model):
        mix.pin(layer="0", lam=1.0, index=[0, 1, 2, 3])
        model(x)
        assert mix.last.layer == "0" and float(mix.last.lam) == 1.0
        model(x)
        after_pin = mix.last
    with twin.attach(model):  # a pinned forward draws nothing: the stream is where it was
        model(x)
        first_draw = twin.last
    assert after_pin.layer == first_draw.layer
    assert torch.equal(after_pin.lam, first_draw.lam) and torch.equal(after_pin.index, first_draw.index)


def test_pin_validates_its_values():
    mix = ManifoldMixup(["input", "layer1"])
    with pytest.raises(ValueError, match="'layer9'.*not one of this regularizer's layers"):
        mix.pin(layer="layer9")
    with pytest.raises(ValueError, match="lam must be a number \\(or 1-D values\\) in \\[0, 1\\]"):
        mix.pin(lam=1.5)
    with pytest.raises(ValueError, match="1-D integer index"):
        mix.pin(index=[0.5, 1.0])
    model = mlp().train()
    with mix_attach(ManifoldMixup("0"), model) as m:
        m.pin(index=[0, 1])
        with pytest.raises(ValueError, match="does not index the batch of 3"):
            model(torch.randn(3, 6, dtype=torch.double))


class mix_attach:
    def __init__(self, mix, model):
        self.mix, self.handle = mix, mix.attach(model)

    def __enter__(self):
        return self.mix

    def __exit__(self, *exc):
        self.handle.remove()


def test_same_generator_seed_gives_same_draws_and_global_rng_is_untouched():
    model = mlp().train()
    x = torch.randn(8, 6, dtype=torch.double)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    runs = []
    for _ in range(2):
        mix = ManifoldMixup(["input", "0", "2"], prob=0.7, generator=gen(123))
        draws = []
        with mix.attach(model):
            for _ in range(20):
                model(x)
                last = mix.last
                draws.append(None if last is None else (last.layer, float(last.lam), last.index.tolist()))
        runs.append(draws)
    assert runs[0] == runs[1]
    assert len({d[0] for d in runs[0] if d}) == 3  # every layer got drawn
    assert torch.equal(torch.get_rng_state(), states[0])
    assert random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])


def test_default_generator_follows_torch_manual_seed():
    model = mlp().train()
    x = torch.randn(8, 6, dtype=torch.double)
    lams = []
    for _ in range(2):
        torch.manual_seed(42)
        mix = ManifoldMixup("input")
        with mix.attach(model):
            model(x)
        lams.append(float(mix.last.lam))
    assert lams[0] == lams[1]


@pytest.mark.parametrize("alpha", [0.2, 1.0, 2.0])
def test_lam_follows_beta_alpha_alpha(alpha):
    g = gen(7)
    samples = torch.stack([sample_lam(alpha, g) for _ in range(3000)]).numpy()
    assert samples.dtype == np.float64
    assert stats.kstest(samples, stats.beta(alpha, alpha).cdf).pvalue > 1e-3
    assert stats.kstest(samples, stats.beta(alpha + 1.0, alpha).cdf).pvalue < 1e-3


def test_layer_drawn_uniformly_and_prob_respected():
    model = mlp().train()
    x = torch.randn(3, 6, dtype=torch.double)
    mix = ManifoldMixup(["input", "0", "2", "4"], prob=0.5, generator=gen(3))
    counts = {"input": 0, "0": 0, "2": 0, "4": 0, None: 0}
    with mix.attach(model):
        for _ in range(2000):
            model(x)
            counts[mix.last.layer if mix.last else None] += 1
    assert stats.binomtest(counts[None], 2000, 0.5).pvalue > 1e-3
    mixed = [counts[k] for k in ("input", "0", "2", "4")]
    assert stats.chisquare(mixed).pvalue > 1e-3


def test_index_is_a_uniform_permutation():
    model = nn.Sequential(nn.Identity()).train()
    mix = ManifoldMixup("0", generator=gen(11))
    firsts = []
    with mix.attach(model):
        for _ in range(1500):
            model(torch.zeros(5, 1))
            assert sorted(mix.last.index.tolist()) == [0, 1, 2, 3, 4]
            firsts.append(int(mix.last.index[0]))
    assert stats.chisquare(np.bincount(firsts, minlength=5)).pvalue > 1e-3


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("alpha", [0, -1.0, float("nan"), float("inf")])
def test_bad_alpha_is_refused_at_construction(alpha):
    with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
        ManifoldMixup("input", alpha=alpha)


@pytest.mark.parametrize("prob", [-0.1, 1.01])
def test_bad_prob_is_refused_at_construction(prob):
    with pytest.raises(ValueError, match=f"prob must be in \\[0, 1\\], got {prob}"):
        ManifoldMixup("input", prob=prob)


def test_output_without_the_batch_dimension_raises():
    class Pool(nn.Module):
        def forward(self, x):
            return x.mean(0)  # reduces over the batch

    model = nn.Sequential(Pool(), nn.Linear(6, 2)).train()
    with ManifoldMixup("0").attach(model):
        with pytest.raises(
            TypeError, match=r"'0': it returned a tensor of shape \(6,\).*model's input has a batch of 4"
        ):
            model(torch.randn(4, 6))


def test_a_layer_that_never_runs_is_reported():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    model = Skips().train()
    with ManifoldMixup("unused").attach(model):
        with pytest.raises(RuntimeError, match="'unused' did not run during Skips.forward"):
            model(torch.randn(3, 2))


def test_preact_resnet_trains_with_every_named_block():
    model = PreActResNet18(in_channels=1, num_classes=10).train()
    x, y = torch.randn(4, 1, 8, 8), torch.tensor([1, 2, 3, 4])
    names = ["input", "conv1", "layer1", "layer2", "layer3", "layer4", "layer2.1.conv2"]
    mix = ManifoldMixup(names, generator=gen())
    with mix.attach(model):
        for name in names:
            mix.pin(layer=name)
            loss = mix.loss(F.cross_entropy, model(x), y)
            loss.backward()
            assert isinstance(mix.last, MixState) and mix.last.layer == name
            assert torch.isfinite(loss)
    assert hook_count(model) == 0


# ---------------------------------------------------------------------------- elem mode and NFM


def test_elem_mode_draws_one_lam_per_sample_and_weights_per_sample():
    model = mlp().train()
    x, y = torch.randn(6, 6, dtype=torch.double), torch.tensor([0, 1, 2, 3, 0, 1])
    mix = ManifoldMixup("2", mode="elem", generator=gen(2))
    seen = {}
    model[3].register_forward_pre_hook(lambda m, a: seen.setdefault("h", a[0]))
    with mix.attach(model):
        logits = model(x)
    lam, index = mix.last.lam, mix.last.index
    assert lam.shape == (6,) and len(set(lam.tolist())) == 6
    h = model[2](model[1](model[0](x)))
    exact(seen["h"], lam[:, None] * h + (1 - lam[:, None]) * h[index])
    per_sample = mix.loss(lambda a, b: F.cross_entropy(a, b, reduction="none"), logits, y)
    expected = lam * F.cross_entropy(logits, y, reduction="none") + (1 - lam) * F.cross_entropy(
        logits, y[index], reduction="none"
    )
    torch.testing.assert_close(per_sample, expected)
    soft = mix.targets(y, 4)
    onehot = F.one_hot(y, 4).double()
    torch.testing.assert_close(soft.double(), lam[:, None] * onehot + (1 - lam[:, None]) * onehot[index])
    with pytest.raises(ValueError, match="one loss per sample \\(reduction='none'\\)"):
        mix.loss(F.cross_entropy, logits, y)


@pytest.mark.parametrize("lam", [torch.tensor(0.3, dtype=torch.float64), torch.rand(5, dtype=torch.float64)])
def test_blend_backward_through_the_inverse_permutation_is_the_exact_gradient(lam):
    from mixhook.mixers import inverse_permutation

    h = torch.randn(5, 3, 2, dtype=torch.double, requires_grad=True)
    index = torch.tensor([3, 0, 4, 1, 2])
    inverse = inverse_permutation(index)
    assert torch.equal(index[inverse], torch.arange(5))
    assert torch.autograd.gradcheck(lambda t: blend(t, lam, index, inverse), (h,))
    lam_b = lam.view(-1, 1, 1) if lam.ndim else lam
    exact(blend(h, lam, index, inverse), lam_b * h + (1 - lam_b) * h[index])
    # an index that is not a permutation has no inverse and takes indexing's own backward
    repeated = torch.tensor([0, 0, 1, 2, 2])
    assert inverse_permutation(repeated) is None
    assert torch.autograd.gradcheck(lambda t: blend(t, lam, repeated), (h,))


def test_global_partners_need_a_process_group_and_partners_is_checked():
    """partners="global" is tested under torchrun in tests/e2e/test_distributed.py; in one process it is
    refused at the first training forward, in one line."""
    with pytest.raises(ValueError, match="partners must be one of local, global, got 'world'"):
        ManifoldMixup("0", partners="world")
    model = torch.nn.Sequential(torch.nn.Linear(3, 3)).train()
    mix = ManifoldMixup("0", partners="global")
    assert repr(mix) == "ManifoldMixup(layer='0', alpha=2.0, prob=1.0, partners='global')"
    with (
        mix.attach(model),
        pytest.raises(
            RuntimeError, match=r"ManifoldMixup\(partners='global'\) needs torch.distributed initialised"
        ),
    ):
        model(torch.randn(2, 3))


def test_targets_come_in_the_dtype_asked_for_computed_from_the_float64_lam():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3)).double().train()
    y = torch.tensor([0, 2, 1, 2])
    mix = ManifoldMixup("0")
    with mix.attach(model):
        mix.pin(lam=1 / 3, index=[3, 2, 1, 0])
        model(torch.randn(4, 3, dtype=torch.double))
    soft = mix.targets(y, 3, smoothing=0.1, dtype=torch.double)
    expected = (1 / 3) * smooth_one_hot(y, 3, 0.1, torch.double) + (2 / 3) * smooth_one_hot(
        y[[3, 2, 1, 0]], 3, 0.1, torch.double
    )
    assert soft.dtype == torch.double
    torch.testing.assert_close(soft, expected, rtol=0, atol=1e-15)
    assert mix.targets(y, 3).dtype == torch.get_default_dtype()
    assert mix.targets(y, 3, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="targets\\(dtype=...\\) must be a floating dtype, got torch.int64"):
        mix.targets(y, 3, dtype=torch.int64)


def test_dominant_lam_is_fastais_max_of_lam_and_one_minus_lam_on_the_same_draws():
    """fastai's MixUp / ManifoldMixup callbacks draw one lam per sample and keep the larger of lam and
    1 - lam, so each sample's own input and label dominate; mode="elem", dominant=True is that."""
    from mixhook.functional import sample_beta

    model = torch.nn.Sequential(torch.nn.Identity()).train()
    x = torch.randn(6, 4)
    mix = ManifoldMixup(
        "input", alpha=0.4, mode="elem", dominant=True, generator=torch.Generator().manual_seed(3)
    )
    assert repr(mix) == "ManifoldMixup(layer='input', alpha=0.4, prob=1.0, mode='elem', dominant=True)"
    twin = torch.Generator().manual_seed(3)
    with mix.attach(model):
        for _ in range(10):
            out = model(x)
            lam = sample_beta(0.4, 0.4, twin, size=6)
            # From fastai/fastai, fastai/callback/mixup.py (MixUp.before_batch):
            lam = torch.stack([lam, 1 - lam], 1)
            lam = lam.max(1)[0]
            shuffle = torch.randperm(6, generator=twin)
            assert torch.equal(mix.last.lam, lam) and torch.equal(mix.last.index, shuffle)
            torch.testing.assert_close(out, torch.lerp(x[shuffle], x, lam.float().unsqueeze(1)))
            assert bool((mix.last.lam >= 0.5).all())
    with pytest.raises(TypeError, match="dominant must be True or False, got 1"):
        ManifoldMixup("input", dominant=1)


@pytest.mark.parametrize("batch", [6, 5])
def test_pair_mode_equals_timms_pair_mode_on_the_same_draw(batch):
    """mode="pair": sample i and B-1-i mix with each other under one lam per pair, as timm's Mixup(
    mode="pair") (timm.data.mixup: _mix_pair, mixup_target), run on the same lam; an odd batch's middle
    sample is its own partner and keeps its input and label."""
    from timm.data import Mixup

    x = torch.randn(batch, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(batch))
    y = torch.tensor([0, 3, 1, 4, 2, 3][:batch])
    np.random.seed(7)
    half = np.random.beta(0.8, 0.8, size=(batch + 1) // 2).astype(np.float32)  # timm's _params_per_elem
    lam = torch.tensor(np.concatenate([half, half[: batch // 2][::-1]]), dtype=torch.float64)
    model = nn.Identity()
    mix = ManifoldMixup("input", alpha=0.8, mode="pair")
    with mix.attach(model):
        mix.pin(lam=lam)
        ours = model(x.clone())
    assert torch.equal(mix.last.index, torch.arange(batch - 1, -1, -1))
    if batch % 2 == 0:  # timm asserts an even batch
        np.random.seed(7)
        theirs, target = Mixup(mixup_alpha=0.8, mode="pair", label_smoothing=0.0, num_classes=5)(x.clone(), y)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)  # timm computes 1 - lam in float32
        torch.testing.assert_close(mix.targets(y, 5, dtype=torch.float64), target, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(ours[batch // 2], x[batch // 2])
        assert torch.equal(mix.targets(y, 5)[batch // 2], F.one_hot(y[batch // 2], 5).float())
    drawn = ManifoldMixup("input", alpha=0.8, mode="pair", generator=torch.Generator().manual_seed(0))
    with drawn.attach(model):
        model(x)
    assert torch.equal(drawn.last.lam, drawn.last.lam.flip(0)) and len(set(drawn.last.lam.tolist())) > 1
    with pytest.raises(ValueError, match="mode='pair' pairs samples within this process's batch"):
        ManifoldMixup("input", mode="pair", partners="global")


def test_a_batch_of_one_sample_is_mixed_with_itself_an_identity_in_logits_loss_and_gradients():
    # what the README promises for trainer.batch_size=1: the mix is an identity and training proceeds
    model = mlp().train()
    x, y = torch.randn(1, 6, dtype=torch.double), torch.tensor([1])
    plain = copy.deepcopy(model)
    expected = F.cross_entropy(plain(x), y)
    expected.backward()
    mix = ManifoldMixup(["input", "2"], generator=gen(3))
    with mix.attach(model):
        for _ in range(4):  # each layer, several lams
            model.zero_grad()
            out = model(x)
            assert mix.last.index.tolist() == [0]
            loss = mix.loss(F.cross_entropy, out, y)
            loss.backward()
            exact(out, plain(x))
            exact(loss, expected)
            for p, q in zip(model.parameters(), plain.parameters(), strict=True):
                exact(p.grad, q.grad)
