"""SpecMix: the masks against the authors' ``masking`` on the same draws; the draw; a hand-edited forward
with gradients at a hidden map; checkpoint replay, pin_last, state_dict, the one-graph path; the refusals."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import SpecMix
from mixhook.mixers.specmix import band_mask
from tests.helpers import gen


# The reference: GT-KIM/specmix (1f8fae4), acoustic_scene_classification/utils.py, masking(), and the lines
# of SpecmixGenerator.__data_generation that call it (one mask per sample, ratio 0.7, lam = mask mean).
def ref_masking(spec, ratio=0.3, t_times=None, f_times=None):  # (their defaults: np.random.randint(3))
    mask = np.ones(spec.shape)
    for _ in range(t_times):
        t = np.random.randint(0, int((1 - ratio) * mask.shape[0] + 1))  # numpy truncated the float bound
        mask[:, t : t + int(mask.shape[0] * ratio)] = 0
    for _ in range(f_times):
        f = np.random.randint(0, int((1 - ratio) * mask.shape[1] + 1))
        mask[f : f + int(mask.shape[1] * ratio), :] = 0
    inv_mask = -1 * (mask - 1)
    return mask, inv_mask


def ref_specmix(x1, x2):
    """The authors' loop over a batch of (B, F, T, C) maps (their Keras layout)."""
    x = np.zeros(x1.shape)
    lam = []
    for i in range(x1.shape[0]):
        mask, inv_mask = ref_masking(
            x1[0, :, :, 0], ratio=0.7, t_times=np.random.randint(3), f_times=np.random.randint(3)
        )
        lam.append(mask.sum() / (x.shape[1] * x.shape[2]))
        for j in range(x1.shape[3]):
            x[i, :, :, j] = mask * x1[i, :, :, j] + inv_mask * x2[i, :, :, j]
    return x, np.array(lam)


def replayed_bands(seed, batch, size, ratio=0.7):
    """The same numpy draws as ref_specmix's, as SpecMix's pinned band starts."""
    rng = np.random.RandomState(seed)
    bands = torch.full((batch, 2, 2), -1, dtype=torch.int64)
    for i in range(batch):
        t_times, f_times = rng.randint(3), rng.randint(3)
        for k in range(t_times):
            bands[i, 0, k] = rng.randint(0, int((1 - ratio) * size + 1))
        for k in range(f_times):
            bands[i, 1, k] = rng.randint(0, int((1 - ratio) * size + 1))
    return bands


class SpecNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.conv2(torch.relu(self.conv1(x))).mean((2, 3)))


def test_the_masks_and_lams_equal_the_authors_on_the_same_draws():
    size, batch = 20, 6  # square, as the authors' crops: their band widths are then the same
    x = torch.randn(batch, 2, size, size, dtype=torch.float64)
    index = torch.tensor([3, 4, 5, 0, 1, 2])
    model = SpecNet().double().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    for seed in range(20):
        np.random.seed(seed)
        x1 = x.permute(0, 2, 3, 1).numpy()  # their (B, F, T, C)
        expected, lam = ref_specmix(x1, x1[index.numpy()])
        mix = SpecMix("input", ratio=0.7)
        with mix.attach(model):
            mix.pin(bands=replayed_bands(seed, batch, size), index=index)
            model(x)
        got = seen["x"].permute(0, 2, 3, 1).numpy()
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(mix.last.lam.numpy(), lam)


def test_bands_are_measured_along_their_own_axis_on_a_non_square_map():
    # the authors' code would take the time band's width from F: here a time band spans int(T * ratio)
    bands = torch.tensor([[[2, -1], [-1, -1]], [[-1, -1], [1, -1]]])  # 0: a time band, 1: a frequency one
    own = band_mask(bands, 8, 20, 0.5)
    assert (~own[0]).sum(1).tolist() == [10] * 8 and bool((~own[0][:, 2:12]).all())
    assert (~own[1]).sum(0).tolist() == [4] * 20 and bool((~own[1][1:5]).all())


def test_the_draw_is_zero_to_bands_bands_per_axis_uniformly_placed():
    model, x = SpecNet().train(), torch.randn(64, 2, 16, 40)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mix = SpecMix("input", ratio=0.25, bands=3, generator=gen(1))
    counts, starts = set(), set()
    with mix.attach(model):
        for _ in range(20):
            model(x)
            bands, index = mix.last.info["bands"], mix.last.index
            own = band_mask(bands, 16, 40, 0.25)
            assert torch.equal(mix.last.weights, own)
            torch.testing.assert_close(mix.last.lam, own.double().mean((1, 2)), rtol=0, atol=0)
            expected = torch.where(own[:, None], x, x[index])
            assert torch.equal(seen["x"], expected)
            counts |= {tuple(c) for c in (bands >= 0).sum(2).tolist()}
            starts |= set(bands[:, 0][bands[:, 0] >= 0].tolist())
            assert int(bands[:, 1].max()) <= 16 - 4 and int(bands[:, 0].max()) <= 40 - 10
    assert counts == {(a, b) for a in range(4) for b in range(4)}
    assert starts == set(range(31))


def test_specmix_at_a_hidden_map_equals_a_hand_edited_forward_with_gradients():
    torch.manual_seed(0)
    model = SpecNet().double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(5, 2, 12, 18, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    mix = SpecMix("conv1", ratio=0.3, generator=gen(3))
    with mix.attach(model):
        logits = model(x)
        loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y).mean()
        loss.backward()
    own, index, lam = mix.last.weights, mix.last.index, mix.last.lam
    assert lam.shape == (5,) and bool((lam < 1).any())
    m = by_hand
    h = m.conv1(x)
    h = torch.where(own[:, None], h, h[index])
    expected = m.head(m.conv2(torch.relu(h)).mean((2, 3)))
    ce = lambda t: F.cross_entropy(expected, t, reduction="none")  # noqa: E731
    (lam * ce(y) + (1 - lam) * ce(y[index])).mean().backward()
    assert torch.equal(logits, expected)
    for p, q in zip(model.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_checkpoint_replay_pin_last_and_state_dict_repeat_the_bands():
    torch.manual_seed(0)
    model = SpecNet().double().train()
    x = torch.randn(4, 2, 10, 12, dtype=torch.float64)
    mix = SpecMix("conv1", ratio=0.4, generator=gen(5))

    plain = copy.deepcopy(model)
    with mix.attach(model):
        checkpoint(model, x, use_reentrant=False).sum().backward()
        bands, index = mix.last.info["bands"], mix.last.index
        mix.pin_last()
        again = model(x)
        assert torch.equal(mix.last.info["bands"], bands)
    pinned = SpecMix("conv1", ratio=0.4)
    with pinned.attach(plain):
        pinned.pin(bands=bands, index=index)
        expected = plain(x)
        expected.sum().backward()
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    # the generator's state travels with state_dict: a restored mixer draws the next bands the same
    restored = SpecMix("conv1", ratio=0.4, generator=gen(0))
    restored.load_state_dict(mix.state_dict())
    first, second = SpecNet().double().train(), SpecNet().double().train()
    with mix.attach(first):
        first(x)
    with restored.attach(second):
        second(x)
    assert torch.equal(mix.last.info["bands"], restored.last.info["bands"])
    assert torch.equal(mix.last.index, restored.last.index)


def test_the_compiled_forward_mixes_as_the_eager_one_in_one_graph():
    torch.manual_seed(0)
    model = SpecNet().train()
    x = torch.randn(4, 2, 10, 12)
    eager, traced = SpecMix("conv1", generator=gen(7)), SpecMix("conv1", generator=gen(7))
    with eager.attach(model):
        expected = model(x)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with traced.attach(model):
        got = compiled(x)
    assert torch.equal(eager.last.info["bands"], traced.last.info["bands"])
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SpecMix("conv1", ratio=1.0), "ratio must be in \\(0, 1\\)"),
        (lambda: SpecMix("conv1", ratio=0.0), "ratio must be in \\(0, 1\\)"),
        (lambda: SpecMix("conv1", bands=0), "bands must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_map_that_is_not_b_c_f_t_is_refused_naming_the_layout():
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x).mean(1)

    model = Tokens().train()
    with SpecMix("proj").attach(model), pytest.raises(TypeError) as e:
        model(torch.randn(2, 5, 8))
    assert "(B, C, F, T) spectrogram" in str(e.value) and "layout='NHWC'" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_map_too_small_for_the_bands_and_bad_pinned_bands_are_refused():
    model = SpecNet().train()
    with SpecMix("conv1", ratio=0.1).attach(model), pytest.raises(ValueError, match="too small for bands"):
        model(torch.randn(2, 2, 4, 30))
    mix = SpecMix("input")
    with mix.attach(model):
        mix.pin(bands=torch.full((2, 2, 3), -1))
        with pytest.raises(ValueError, match="K <= 2"):
            model(torch.randn(2, 2, 8, 8))
        mix.pin(bands=torch.tensor([[[7, -1], [-1, -1]]] * 2))
        with pytest.raises(ValueError, match="does not fit the 8x8"):
            model(torch.randn(2, 2, 8, 8))
        mix.pin(lam=0.5)
        with pytest.raises(ValueError, match="pin bands=... instead"):
            model(torch.randn(2, 2, 8, 8))
