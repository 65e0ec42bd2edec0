"""FMix: the mask generator against the authors' code on the same draws, the mix against a hand-split
forward in float64 (logits and gradients), lam as the mask's mean, replay, and the refusals."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch.utils.checkpoint import checkpoint

from mixhook import FMix
from mixhook.geometry import binarise, fmix_frequencies, fmix_mask, low_freq_image
from tests.helpers import SmallCNN, gen, grads

# --- The authors' mask generator: github.com/ecs-vlc/FMix, fmix.py (fftfreqnd, get_spectrum,
# --- make_low_freq_image, binarise_mask), the 2-D lines, with the draws passed in instead of taken from
# --- np.random.randn and random.random. ref_make_low_freq_image takes the reshape line that their
# --- make_low_freq_image carries commented out (spectrum="reference"); ref_live_low_freq_image the line it
# --- runs at e5991dc (spectrum="authors").


def ref_fftfreqnd(h, w):
    fy = np.fft.fftfreq(h)
    fy = np.expand_dims(fy, -1)
    if w % 2 == 1:
        fx = np.fft.fftfreq(w)[: w // 2 + 2]
    else:
        fx = np.fft.fftfreq(w)[: w // 2 + 1]
    return np.sqrt(fx * fx + fy * fy)


def ref_make_low_freq_image(decay_power, shape, param):
    h, w = shape
    freqs = ref_fftfreqnd(h, w)
    scale = np.ones(1) / (np.maximum(freqs, np.array([1.0 / max(w, h, 0)])) ** decay_power)
    scale = np.expand_dims(scale, -1)[None, :]
    spectrum = scale * param[None]  # get_spectrum: param = np.random.randn(1, *freqs.shape, 2)
    mask = np.fft.irfftn(spectrum.reshape(1, *shape[:-1], -1), shape, axes=(1, 2))  # axes: NumPy 2 asks
    mask = mask[:1, : shape[0], : shape[1]]
    mask = mask - mask.min()
    return mask / mask.max()


def ref_live_low_freq_image(decay_power, shape, param):
    h, w = shape
    freqs = ref_fftfreqnd(h, w)
    scale = np.ones(1) / (np.maximum(freqs, np.array([1.0 / max(w, h, 0)])) ** decay_power)
    scale = np.expand_dims(scale, -1)[None, :]
    spectrum = scale * param[None]  # get_spectrum: (1, h, F, 2)
    spectrum = spectrum[:, 0] + 1j * spectrum[:, 1]
    mask = np.real(np.fft.irfftn(spectrum, shape, axes=(1, 2)))  # axes: NumPy 2 asks
    mask = mask[:1, : shape[0], : shape[1]]
    mask = mask - mask.min()
    return mask / mask.max()


def ref_binarise_mask(mask, lam, in_shape, max_soft, coin):
    idx = mask.reshape(-1).argsort()[::-1]
    mask = mask.reshape(-1)
    num = math.ceil(lam * mask.size) if coin > 0.5 else math.floor(lam * mask.size)
    eff_soft = max_soft
    if max_soft > lam or max_soft > (1 - lam):
        eff_soft = min(lam, 1 - lam)
    soft = int(mask.size * eff_soft)
    num_low = num - soft
    num_high = num + soft
    mask[idx[:num_high]] = 1
    mask[idx[num_low:]] = 0
    mask[idx[num_low:num_high]] = np.linspace(1, 0, (num_high - num_low))
    return mask.reshape((1, *in_shape))


# --- end of the authors' lines


@pytest.mark.parametrize(("height", "width"), [(32, 32), (8, 8), (7, 10), (16, 9)])
def test_the_low_frequency_image_equals_the_authors_on_the_same_draw(height, width):
    assert fmix_frequencies(height, width).numpy() == pytest.approx(ref_fftfreqnd(height, width), abs=1e-15)
    g = gen(height * width)
    for decay in (1.0, 3.0, 5.5):
        param = torch.randn(
            height, fmix_frequencies(height, width).shape[1], 2, dtype=torch.float64, generator=g
        )
        ours = low_freq_image(param, decay, height, width, "reference")
        theirs = ref_make_low_freq_image(decay, (height, width), param.numpy())[0]
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=1e-12)
        assert float(ours.min()) == 0.0 and float(ours.max()) == 1.0


@pytest.mark.parametrize(("height", "width"), [(32, 32), (8, 8), (7, 10), (16, 9)])
def test_the_authors_spectrum_equals_the_line_their_code_runs_and_makes_bands(height, width):
    g = gen(height + width)
    for decay in (1.0, 3.0):
        param = torch.randn(
            height, fmix_frequencies(height, width).shape[1], 2, dtype=torch.float64, generator=g
        )
        ours = low_freq_image(param, decay, height, width, "authors")
        theirs = ref_live_low_freq_image(decay, (height, width), param.numpy())[0]
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=0, atol=1e-12)
    # only the horizontal frequencies 0 and 1: each row is a + b cos(2 pi x / W) + c sin(2 pi x / W)
    spectrum = torch.fft.rfft(ours, dim=1)
    assert float(spectrum[:, 2:].abs().max()) < 1e-9 * float(spectrum.abs().max())


@pytest.mark.parametrize("max_soft", [0.0, 0.1, 0.3, 0.5])
def test_binarise_equals_the_authors_on_the_same_image_lam_and_coin(max_soft):
    g = gen(7)
    for lam in (0.0, 0.03, 0.37, 0.5, 0.81, 1.0):
        for coin in (0.2, 0.9):
            image = torch.rand(12, 10, dtype=torch.float64, generator=g)  # no ties: a unique order
            ours = binarise(image, lam, max_soft, round_up=coin > 0.5)
            theirs = ref_binarise_mask(image.numpy().copy(), lam, (12, 10), max_soft, coin)[0]
            np.testing.assert_array_equal(ours.numpy(), theirs)
            num = math.ceil(lam * 120) if coin > 0.5 else math.floor(lam * 120)
            assert float(ours.mean()) == pytest.approx(num / 120, abs=1e-12)


def test_a_whole_mask_equals_the_authors_on_the_same_draws():
    """fmix_mask draws the spectrum, then the rounding coin, from its generator; fed the same draws, the
    authors' code gives the same mask (its images are point-symmetric, so pixels tie in pairs: at the
    threshold the two sorts may pick different twins, which the mean and the untied pixels must not
    notice)."""
    for seed in range(20):
        g, twin = gen(seed), gen(seed)
        lam = float(torch.rand((), dtype=torch.float64, generator=gen(100 + seed)))
        ours = fmix_mask(16, 16, lam, 3.0, 0.0, "reference", g)
        param = torch.randn(16, 9, 2, dtype=torch.float64, generator=twin)
        coin = float(torch.rand((), dtype=torch.float64, generator=twin))
        image = ref_make_low_freq_image(3.0, (16, 16), param.numpy())[0]
        theirs = ref_binarise_mask(image.copy(), lam, (16, 16), 0.0, coin)[0]
        assert float(ours.mean()) == pytest.approx(theirs.mean(), abs=1e-12)
        threshold = np.sort(image.reshape(-1))[::-1][int(round(theirs.sum())) - 1] if theirs.sum() else 2.0
        untied = np.abs(image - threshold) > 1e-9
        np.testing.assert_array_equal(ours.numpy()[untied], theirs[untied])


def test_the_reference_spectrum_is_point_symmetric_and_the_complex_one_is_not():
    g = gen(3)
    param = torch.randn(16, 9, 2, dtype=torch.float64, generator=g)
    turn = (-torch.arange(16)) % 16  # y -> -y, x -> -x on the torus
    ref = low_freq_image(param, 3.0, 16, 16, "reference")
    assert torch.allclose(ref, ref[turn][:, turn], atol=1e-12)
    assert not torch.allclose(ref, ref[:, turn], atol=1e-3) and not torch.allclose(ref, ref[turn], atol=1e-3)
    complex_ = low_freq_image(param, 3.0, 16, 16, "complex")
    assert not torch.allclose(complex_, complex_[turn][:, turn], atol=1e-3)
    mask = fmix_mask(16, 16, 0.4, 3.0, 0.0, "complex", gen(4))
    assert set(mask.unique().tolist()) == {0.0, 1.0} and float(mask.mean()) in (102 / 256, 103 / 256)


@pytest.mark.slow
def test_fmix_at_layer2_of_resnet18_equals_a_hand_split_forward_with_gradients():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=3).double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    mix = FMix("layer2", alpha=1.0, generator=gen(5))
    with mix.attach(model):
        loss = mix.loss(F.cross_entropy, model(x), y)
        loss.backward()
    mask, index, lam = mix.last.info["mask"], mix.last.index, mix.last.lam
    assert mask.shape == (4, 4) and float(lam) == pytest.approx(float(mask.mean()), abs=0)
    m = by_hand
    h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))
    h = mask * h + (1 - mask) * h[index]
    logits = m.fc(torch.flatten(m.avgpool(m.layer4(m.layer3(h))), 1))
    expected = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])
    expected.backward()
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    for name, g in grads(by_hand).items():
        assert torch.allclose(grads(model)[name], g, rtol=0, atol=1e-10), name


def test_fmix_at_the_input_keeps_the_masked_pixels_and_never_modifies_the_callers_tensor():
    model = SmallCNN(channels=1).train()
    x = torch.randn(6, 1, 8, 8)
    before = x.clone()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda mod, a: seen.__setitem__("x", a[0]))
    mix = FMix("input", generator=gen(2), max_soft=0.2)
    lams = []
    with mix.attach(model):
        for _ in range(30):
            model(x)
            m = mix.last.info["mask"].float()
            assert torch.allclose(seen["x"], m * x + (1 - m) * x[mix.last.index], atol=1e-6)
            targets = mix.targets(torch.arange(6) % 3, 3)
            lam = float(mix.last.lam)
            lams.append(lam)
            assert torch.allclose(targets.sum(1), torch.ones(6, dtype=targets.dtype))
            assert float(targets[0, 0]) >= lam - 1e-6
    assert torch.equal(x, before)
    assert min(lams) < 0.3 and max(lams) > 0.7


def test_pin_mask_pin_last_and_checkpoint_replay_repeat_the_mix_exactly():
    model = SmallCNN().train()
    x = torch.randn(4, 3, 8, 8)
    mix = FMix(["input", "conv1"], generator=gen(9))
    with mix.attach(model):
        first = model(x)
        state = mix.last
        mix.pin_last()
        assert torch.equal(model(x), first) and torch.equal(mix.last.info["mask"], state.info["mask"])
        mask = torch.zeros(8, 8, dtype=torch.float64)
        mask[:, :3] = 1.0
        mix.pin(layer="conv1", lam=0.5, index=torch.tensor([1, 0, 3, 2]), mask=mask)
        model(x)
        assert float(mix.last.lam) == 3 / 8 and torch.equal(mix.last.info["mask"], mask)
        with pytest.raises(ValueError, match="pinned mask of shape \\(4, 4\\) does not fit the 8x8 map"):
            mix.pin(layer="conv1", mask=torch.ones(4, 4))
            model(x)

    class Checkpointed(torch.nn.Module):  # the mixed layer recomputed in backward: the same mask again
        def __init__(self):
            super().__init__()
            self.inner = SmallCNN()

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    plain, checkpointed = SmallCNN().double().train(), Checkpointed().double().train()
    checkpointed.inner.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    for net, layer in ((plain, "conv1"), (checkpointed, "inner.conv1")):
        hook = FMix(layer, generator=gen(4))
        with hook.attach(net):
            hook.loss(F.cross_entropy, net(x), torch.tensor([0, 1, 2, 3])).backward()
    for (name, a), b in zip(grads(plain).items(), grads(checkpointed).values(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay_power": 0}, "decay_power must be a finite number > 0, got 0"),
        ({"max_soft": 0.6}, r"max_soft must be in \[0, 0.5\], got 0.6"),
        ({"max_soft": -0.1}, "max_soft must be a finite number >= 0, got -0.1"),
        ({"spectrum": "paper"}, "spectrum must be one of reference, authors, complex, got 'paper'"),
        ({"alpha": 0}, "alpha must be a finite number > 0, got 0"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FMix("input", **kwargs)


def test_layers_fmix_cannot_cut_are_refused_before_mixing():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 8), torch.nn.Flatten(), torch.nn.Linear(4, 2)).train()
    with pytest.raises(ValueError, match="FMix at '0': its 1x1 map has a single pixel"):
        with FMix("0").attach(model):
            model(torch.randn(2, 3, 8, 8))
    with pytest.raises(
        TypeError, match=r"FMix at .2. needs a \(B, C, L\), \(B, C, H, W\) or \(B, C, D, H, W\) map"
    ):
        with FMix("2").attach(model):
            model(torch.randn(2, 3, 8, 8))
    mix, cnn = FMix("conv1"), SmallCNN().train()
    with pytest.raises(ValueError, match="FMix cuts one mask per batch: pin one lam, not 2"):
        with mix.attach(cnn):
            mix.pin(lam=torch.tensor([0.2, 0.8]))
            cnn(torch.randn(2, 3, 8, 8))
