"""Region methods on 1-D (B, C, L) and 3-D (B, C, D, H, W) maps: CutMix, FMix, GridMix, SmoothMix and
PatchUp against a hand paste (or blend) of the same draw in float64, logits and gradients; lam as the kept
fraction; dense targets mixed with the same weights; layouts read or declared, never guessed; the one-line
refusals (a box larger than the map, a layout nothing states, a grid or block that does not fit)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import CutMix, FMix, GridMix, PatchUp, ResizeMix, SmoothMix
from mixhook.geometry import (
    fmix_frequencies,
    gaussian_mask,
    gaussian_volume,
    grid_mask,
    grid_volume,
    low_freq_image,
    low_freq_volume,
    rand_region,
    rand_regions,
    side_ratio,
    side_ratios,
)
from mixhook.layouts import AmbiguousLayoutError
from mixhook.mixers.patchup import block_mask
from tests.helpers import gen, grads

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # (tests/conftest.py)


def signal_net(seed=0) -> nn.Sequential:
    """A 1-D CNN on (B, 2, 16) signals: its '0' states (B, C, L)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 4, 3, padding=1),
        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 3),
    ).double().train()  # fmt: skip


def volume_net(seed=0) -> nn.Sequential:
    """A 3-D CNN on (B, 2, 6, 8, 8) volumes: its '0' states (B, C, D, H, W)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 3),
    ).double().train()  # fmt: skip


NETS = {1: (signal_net, (6, 2, 16)), 3: (volume_net, (6, 2, 6, 8, 8))}
METHODS = {
    "CutMix": lambda layer, **kw: CutMix(layer, **kw),
    "CutMix-elem": lambda layer, **kw: CutMix(layer, mode="elem", **kw),
    "FMix": lambda layer, **kw: FMix(layer, **kw),
    "GridMix": lambda layer, **kw: GridMix(layer, grid=3, **kw),
    "SmoothMix": lambda layer, **kw: SmoothMix(layer, **kw),
    "PatchUp-hard": lambda layer, **kw: PatchUp(layer, block_size=3, gamma=0.5, mode="hard", **kw),
    "PatchUp-soft": lambda layer, **kw: PatchUp(layer, block_size=3, gamma=0.5, mode="soft", **kw),
}


def hand_mix(name: str, h: torch.Tensor, last) -> torch.Tensor:
    """What the method's recorded draw does to the map ``h``, written out by hand."""
    partner = h[last.index]
    if name == "CutMix":
        box = last.info["box"]
        region = (slice(None), slice(None), *(slice(a, b) for a, b in zip(box[0::2], box[1::2], strict=True)))
        out = h.clone()
        out[region] = partner[region]
        return out
    if name == "CutMix-elem":
        out = h.clone()
        for i, box in enumerate(last.info["box"].tolist()):
            region = (i, slice(None), *(slice(a, b) for a, b in zip(box[0::2], box[1::2], strict=True)))
            out[region] = partner[region]
        return out
    mask = last.info["mask"]
    if name.startswith("PatchUp"):
        lam = float(last.lam)  # the own label's weight; the blend inside the blocks uses the drawn lam
        inner = partner if name == "PatchUp-hard" else None
        if inner is None:
            drawn = 1 - (1 - lam) / float(mask.mean())  # 1 - altered * (1 - drawn) = lam
            inner = drawn * h + (1 - drawn) * partner
        return (1 - mask) * h + mask * inner
    return mask * h + (1 - mask) * partner


@pytest.mark.parametrize("dims", [1, 3])
@pytest.mark.parametrize("name", list(METHODS))
def test_every_region_method_equals_a_hand_mix_of_its_draw_on_1d_and_3d_maps(name, dims):
    """At the hidden layer '0' (a Conv1d / Conv3d: the layout is stated), three steps: the hooked forward
    equals the model run by hand on the recorded draw (logits and every gradient, float64), and lam is
    the fraction of the map each sample keeps."""
    make_net, shape = NETS[dims]
    x = torch.randn(*shape, dtype=torch.float64, generator=gen(dims))
    y = torch.randint(0, 3, (shape[0],), generator=gen(7))
    model, twin = make_net(), make_net()
    mix = METHODS[name]("0", generator=gen(11))
    with mix.attach(model):
        for _ in range(3):
            model.zero_grad()
            logits = model(x)
            mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y).sum().backward()
            last = mix.last
            twin.zero_grad()
            h = twin[0](x)
            expected = twin[1:](hand_mix(name, h, last))
            lam = last.lam
            own = F.cross_entropy(expected, y, reduction="none")
            other = F.cross_entropy(expected, y[last.index], reduction="none")
            (lam * own + (1 - lam) * other).sum().backward()
            torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
            for key, grad in grads(model).items():
                torch.testing.assert_close(grad, grads(twin)[key], rtol=0, atol=1e-12)
            kept = last.weights.double().expand(shape[0], *shape[2:]).flatten(1).mean(1)
            torch.testing.assert_close(torch.as_tensor(lam).expand(shape[0]), kept, rtol=0, atol=1e-12)
            assert last.weights.shape[1:] == x.shape[2:]
    assert mix.last.info and not torch.equal(logits, twin(x))  # something was mixed


def test_a_box_covers_the_fraction_one_minus_lam_along_one_or_three_dimensions():
    """Side ratio 1 - lam on a 1-D map, cbrt(1 - lam) on a 3-D map (exact for cubes: 1/8 -> half), the
    centre drawn along each dimension in order, clipped; the vectorised boxes are the scalar ones."""
    assert side_ratio(0.36, 2) == 0.6 and side_ratio(0.3, 1) == 0.3
    assert [side_ratio(c, 3) for c in (0.125, 0.015625, 0.421875, 0.0, 1.0)] == [0.5, 0.25, 0.75, 0.0, 1.0]
    cuts = torch.rand(2000, dtype=torch.float64, generator=gen(1))
    roots = side_ratios(cuts, 3)
    assert roots.tolist() == [side_ratio(c, 3) for c in cuts.tolist()]
    for step in (-math.inf, math.inf):  # the closest double: no neighbour's cube is nearer
        assert bool(
            (
                (torch.nextafter(roots, torch.tensor(step)) ** 3 - cuts).abs()
                >= (roots * roots * roots - cuts).abs()
            ).all()
        )
    box = rand_region((8, 8, 8), 0.875, gen(3))  # cut side 4 around the drawn centre
    twin = gen(3)
    centre = [int(torch.randint(8, (), generator=twin)) for _ in range(3)]
    assert box == tuple(v for c in centre for v in (max(c - 2, 0), min(c + 2, 8)))
    segment = rand_region((20,), 0.7, gen(4))  # a segment of 2 * (int(20 * 0.3) // 2) = 6
    c = int(torch.randint(20, (), generator=gen(4)))
    assert segment == (max(c - 3, 0), min(c + 3, 20))
    for shape in ((20,), (6, 8, 8)):
        lam = torch.rand(7, dtype=torch.float64, generator=gen(5))
        boxes = rand_regions(shape, lam, gen(6), "timm")
        twin = gen(6)
        centres = [torch.randint(size, (7,), generator=twin) for size in shape]
        for i in range(7):
            ratio = side_ratio(1 - float(lam[i]), len(shape))
            expected = []
            for size, cs in zip(shape, centres, strict=True):
                cut, ci = int(size * ratio), int(cs[i])
                expected += [max(ci - cut // 2, 0), min(ci + (cut + 1) // 2, size)]
            assert boxes[i].tolist() == expected


def test_the_nd_masks_reduce_to_the_2d_ones_and_keep_their_shape():
    """FMix's spectrum over every dimension is its 2-D 'complex' image on a 2-D map; GridMix's and
    SmoothMix's N-D masks are their 2-D ones there; PatchUp's block mask grows cubes of block_size."""
    param = torch.randn(*fmix_frequencies(12, 10).shape, 2, dtype=torch.float64, generator=gen(2))
    torch.testing.assert_close(
        low_freq_volume(param, 3.0, (12, 10)), low_freq_image(param, 3.0, 12, 10, "complex"), rtol=0, atol=0
    )
    assert fmix_frequencies(9).shape == (6,) and fmix_frequencies(4, 6, 8).shape == (4, 6, 5)
    image = low_freq_volume(torch.randn(4, 6, 5, 2, dtype=torch.float64, generator=gen(3)), 3.0, (4, 6, 8))
    assert image.shape == (4, 6, 8) and float(image.min()) == 0.0 and float(image.max()) == 1.0
    cells = torch.rand(3, 4, generator=gen(4)) > 0.5
    assert torch.equal(grid_volume(cells, (7, 9)), grid_mask(cells, 7, 9))
    cube = torch.rand(2, 3, 2, generator=gen(5)) > 0.5
    volume = grid_volume(cube, (4, 7, 5))
    assert (
        volume[0, 0, 0] == cube[0, 0, 0]
        and volume[3, 6, 4] == cube[1, 2, 1]
        and volume[1, 2, 2] == cube[0, 1, 1]
    )
    assert torch.equal(gaussian_volume((7, 9), (2, 5), (1.5, 2.5)), gaussian_mask(7, 9, 2, 5, 1.5, 2.5))
    g1 = gaussian_volume((11,), (4,), (2.0,))
    torch.testing.assert_close(g1, torch.exp(-((torch.arange(11.0, dtype=torch.float64) - 4) ** 2) / 8))
    g3 = gaussian_volume((3, 4, 5), (1, 2, 3), (1.0, 2.0, 3.0))
    assert g3[1, 2, 3] == 1.0 and g3[0, 2, 3] == pytest.approx(math.exp(-0.5))
    blocks = block_mask(2, 0, 0, 3, 0.02, gen(6), shape=(9, 9, 9))
    assert blocks.shape == (2, 9, 9, 9) and set(blocks.unique().tolist()) <= {0.0, 1.0}
    centres = torch.bernoulli(
        torch.full((1, 2, 9, 9, 9), 0.02 * 729 / (27 * 343), dtype=torch.float64), generator=gen(6)
    )
    assert torch.equal(blocks, F.max_pool3d(centres, 3, 1, 1)[0])


# ------------------------------------------------------------------------------------------ layouts


def test_the_input_and_channels_last_maps_cut_their_positions_once_declared():
    """A model's 3-D input is refused until declared; declared (B, C, L) the box spans every channel; a
    (B, L, C) sequence (declared NLC) is cut along L, channels whole, and given back in its layout."""
    x = torch.randn(4, 2, 16, dtype=torch.float64, generator=gen(1))
    model = signal_net()
    with CutMix("input").attach(model):
        with pytest.raises(
            AmbiguousLayoutError,
            match=r"CutMix at 'input': the model's input is a 3-D map whose layout nothing states; declare "
            r"layout='NCL' \(\(B, C, L\)\) or layout='NLC' \(\(B, L, C\)\)",
        ):
            model(x)
    seen = {}
    model[0].register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
    mix = CutMix("input", layout="NCL")
    with mix.attach(model):
        mix.pin(lam=0.5, box=(3, 9), index=torch.tensor([1, 0, 3, 2]))
        model(x)
    expected = x.clone()
    expected[:, :, 3:9] = x[[1, 0, 3, 2], :, 3:9]
    assert torch.equal(seen["x"], expected) and float(mix.last.lam) == 1 - 6 / 16

    torch.manual_seed(0)
    sequence = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double().train()
    tokens = torch.randn(4, 10, 5, dtype=torch.float64, generator=gen(2))  # (B, L, C)
    with CutMix("0").attach(sequence):
        with pytest.raises(
            AmbiguousLayoutError,
            match=r"Linear '0' gives a \(B, L, C\) sequence; a region method would cut its L positions: "
            r"declare layout='NLC' to do so",
        ):
            sequence(tokens)
    out = {}
    sequence[1].register_forward_pre_hook(lambda m, args: out.update(h=args[0]))
    mix = CutMix("0", layout="NLC")
    with mix.attach(sequence):
        mix.pin(lam=0.5, box=(2, 7), index=torch.tensor([2, 3, 0, 1]))
        sequence(tokens)
    h = sequence[0](tokens)
    expected = h.clone()
    expected[:, 2:7, :] = h[[2, 3, 0, 1], 2:7, :]
    assert out["h"].shape == (4, 10, 6) and torch.equal(out["h"], expected)


def test_a_5d_map_a_linear_states_channels_last_is_cut_along_depth_height_and_width():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 4 * 4, 2)).double()
    x = torch.randn(2, 2, 4, 4, 3, dtype=torch.float64, generator=gen(3))  # (B, D, H, W, C)
    out = {}
    model[1].register_forward_pre_hook(lambda m, args: out.update(h=args[0]))
    mix = FMix("0", generator=gen(4))
    with mix.attach(model.train()):
        model(x)
    mask = mix.last.info["mask"]
    assert mask.shape == (2, 4, 4)  # depth, height, width: the channels kept whole
    h = model[0](x)
    expected = mask[..., None] * h + (1 - mask[..., None]) * h[mix.last.index]
    torch.testing.assert_close(out["h"], expected, rtol=0, atol=1e-12)


def test_maps_whose_layout_nothing_states_or_contradicts_are_refused_in_one_line():
    class Block(nn.Module):  # states nothing about its (B, C, D, H, W) output
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv3d(2, 2, 1)

        def forward(self, x):
            return self.conv(x) + x

    model = nn.Sequential(Block(), nn.Flatten(), nn.LazyLinear(2)).double().train()
    x = torch.randn(2, 2, 3, 4, 4, dtype=torch.float64)
    with SmoothMix("0").attach(model):
        with pytest.raises(
            AmbiguousLayoutError,
            match=r"SmoothMix at '0': Block states no layout for its 5-D map \(1-D and 3-D maps have no "
            r"convention to fall back on\); declare layout='NCDHW' \(\(B, C, D, H, W\)\) or layout='NDHWC'",
        ):
            model(x)
    with SmoothMix("0", layout="NCDHW", generator=gen()).attach(model):
        model(x)  # declared: mixed
    with GridMix("0.conv", layout="NDHWC").attach(model):
        with pytest.raises(
            AmbiguousLayoutError, match="layout='NDHWC' was declared, but Conv3d '0.conv' gives NCDHW maps"
        ):
            model(x)
    net = signal_net()
    with PatchUp("0", layout="NCHW").attach(net):
        with pytest.raises(
            AmbiguousLayoutError,
            match=r"PatchUp at '0': layout='NCHW' was declared for \(B, C, H, W\) maps, but the map is 3-D; "
            r"declare layout='NCL' \(\(B, C, L\)\) or layout='NLC' \(\(B, L, C\)\) for it",
        ):
            net(torch.randn(2, 2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="layout must be 'NCHW'.*'NCL' or 'NLC' for 1-D maps"):
        CutMix("0", layout="NTC")


# ------------------------------------------------------------------------------------------ refusals


def test_boxes_grids_blocks_and_spectra_that_do_not_fit_are_refused_in_one_line():
    x1 = torch.randn(2, 2, 16, dtype=torch.float64)
    x3 = torch.randn(2, 2, 6, 8, 8, dtype=torch.float64)
    cases = [
        (signal_net, x1, lambda m: m.pin(box=(0, 20)), CutMix, {}, ValueError,
         r"pinned box \(0, 20\) does not fit the 16 map of layer '0' \(a box is 2 bounds"),
        (volume_net, x3, lambda m: m.pin(box=(0, 4, 0, 4)), CutMix, {}, ValueError,
         r"pinned box \(0, 4, 0, 4\) does not fit the 6x8x8 map of layer '0' \(a box is 6 bounds"),
        (volume_net, x3, lambda m: m.pin(box=torch.tensor([[0, 7, 0, 1, 0, 1]] * 2)), CutMix,
         {"mode": "elem"}, ValueError, "a pinned box does not fit the 6x8x8 map of layer '0'"),
        (signal_net, x1, None, PatchUp, {"block_size": 17}, ValueError,
         "PatchUp block_size=17 is larger than the 16 feature map of layer '0'"),
        (signal_net, x1, None, GridMix, {"grid": (2, 2)}, ValueError,
         r"GridMix at '0': grid=\(2, 2\) gives 2 cell counts, but the map is 1-D \(16\)"),
        (volume_net, x3, None, GridMix, {"grid": 7}, ValueError,
         "GridMix at '0': its 6x8x8 map has fewer positions than the 7x7x7 grid has cells along a side"),
        (signal_net, x1, None, FMix, {"spectrum": "reference"}, ValueError,
         "FMix at '0': spectrum='reference' reproduces the authors' 2-D masks, but the map is 1-D"),
        (volume_net, x3, lambda m: m.pin(mask=torch.ones(8, 8)), SmoothMix, {}, ValueError,
         r"pinned mask of shape \(8, 8\) does not fit the 6x8x8 map"),
        (signal_net, x1, None, ResizeMix, {}, TypeError,
         r"ResizeMix at '0' needs a \(B, C, H, W\) map with the batch first, but has shape \(2, 4, 16\)"),
    ]  # fmt: skip
    for make_net, x, pin, cls, kwargs, error, message in cases:
        model, mix = make_net(), cls("0", **kwargs)
        with mix.attach(model):
            if pin is not None:
                pin(mix)
            with pytest.raises(error, match=message):
                model(x)
    flat = nn.Sequential(nn.Conv3d(2, 2, 1), nn.Flatten(), nn.LazyLinear(2)).double().train()
    with CutMix("0").attach(flat):
        with pytest.raises(ValueError, match="CutMix at '0': its 1x8x8 map is too small to ever paste a box"):
            flat(torch.randn(2, 2, 1, 8, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="grid must be an int >= 2 or one to three ints >= 1"):
        GridMix("0", grid=(1,))


# ------------------------------------------------------------------------------------------ targets


def test_dense_1d_and_3d_targets_are_mixed_with_the_mask_of_the_map():
    """Per-position labels (B, L) under a 1-D cut at the input take the partner's label inside the segment;
    (B, D, H, W) labels under a 3-D mask at a half-resolution layer take its area-resized weights."""
    x = torch.randn(4, 2, 16, dtype=torch.float64, generator=gen(1))
    labels = torch.randint(0, 3, (4, 16), generator=gen(2))
    index = torch.tensor([1, 0, 3, 2])
    model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1)).double().train()  # per-position logits (B, 3, L)
    mix = CutMix("input", layout="NCL")
    with mix.attach(model):
        mix.pin(lam=0.5, box=(4, 12), index=index)
        logits = model(x)
        soft = mix.targets(labels, 3, dtype=torch.float64, logits=logits)
        per_position = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, labels)
    expected = labels.clone()
    expected[:, 4:12] = labels[index, 4:12]
    assert torch.equal(soft, F.one_hot(expected, 3).movedim(-1, 1).double())
    torch.testing.assert_close(per_position, F.cross_entropy(logits, expected, reduction="none"))

    volumes = torch.randn(2, 2, 4, 8, 8, dtype=torch.float64, generator=gen(3))
    labels3 = torch.randint(0, 2, (2, 4, 8, 8), generator=gen(4))
    net = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Upsample(scale_factor=2)).double().train()
    mask = torch.zeros(4, 8, 8, dtype=torch.float64)
    mask[:2] = 1.0  # at the layer '0' of the same resolution as the labels
    mix = FMix("0", generator=gen())
    with mix.attach(net):
        mix.pin(mask=mask, index=torch.tensor([1, 0]))
        soft = mix.targets(labels3, 2, dtype=torch.float64, logits=net(volumes))
    own, partner = F.one_hot(labels3, 2).movedim(-1, 1).double(), F.one_hot(labels3[[1, 0]], 2).movedim(-1, 1)
    torch.testing.assert_close(soft, mask * own + (1 - mask) * partner, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"FMix mixes regions of a 3-D map, so its dense targets must be "):
        mix.targets(torch.randint(0, 2, (2, 8, 8)), 2)


# ------------------------------------------------------------------------------------ copies, compile


def test_a_copied_mixer_on_a_copied_model_mixes_the_1d_map_as_the_original_does():
    """The layouts a mixer read are per attachment: a deepcopy of the model (hook-free) with a deepcopy of
    the mixer attached mixes the next step exactly as the original pair."""
    model = signal_net()
    mix = GridMix("0", grid=4, generator=gen(3))
    mix.attach(model)
    x = torch.randn(4, 2, 16, dtype=torch.float64, generator=gen(4))
    model(x)
    twin, twin_mix = copy.deepcopy(model), copy.deepcopy(mix)
    twin_mix.attach(twin)  # (the hooks the model copy carries remove themselves at its first call)
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    assert torch.equal(twin_mix.last.info["cells"], mix.last.info["cells"])
    mix.remove()
    twin_mix.remove()


@pytest.mark.parametrize("dims", [1, 3])
def test_region_methods_on_nd_maps_compute_the_same_compiled(dims):
    """Attach, then compile: two steps of CutMix (per-sample boxes) and GridMix give the eager run's
    losses and gradients."""
    make_net, shape = NETS[dims]
    x = torch.randn(*shape, dtype=torch.float64, generator=gen(1))
    y = torch.randint(0, 3, (shape[0],), generator=gen(2))
    for make in (lambda: CutMix("0", mode="elem", generator=gen(3)), lambda: GridMix("0", generator=gen(3))):
        results = []
        for compiled in (False, True):
            torch._dynamo.reset()
            model, hook = make_net(), make()
            hook.attach(model)
            net = torch.compile(model, backend="eager") if compiled else model
            losses, gradients = [], []
            for _ in range(2):
                model.zero_grad()
                loss = hook.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), net(x), y).mean()
                loss.backward()
                losses.append(loss.detach())
                gradients.append([p.grad.clone() for p in model.parameters()])
            hook.remove()
            results.append((losses, gradients))
        torch.testing.assert_close(results[1], results[0])


def test_a_sequence_cut_along_its_positions_is_refused_where_padding_masks_would_be_unioned():
    """The union of the partners' padding masks fits a blend, not a paste: a (B, L, C) cut in a model that
    takes key_padding_mask is refused with padding='union' (the default) and runs with padding='keep'."""

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 8)
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

        def forward(self, x, src_key_padding_mask=None):
            return self.layer(self.embed(x), src_key_padding_mask=src_key_padding_mask).mean(1)

    torch.manual_seed(0)
    model = Encoder().train()
    x, pad = torch.randn(4, 6, 3), torch.zeros(4, 6, dtype=torch.bool)
    pad[0, 4:] = True
    with CutMix("embed", layout="NLC").attach(model):
        with pytest.raises(
            ValueError, match=r"CutMix at 'embed' cuts the positions of a \(B, L, C\) sequence, and"
        ):
            model(x, src_key_padding_mask=pad)
    mix = CutMix("embed", layout="NLC", padding="keep", generator=gen())
    with mix.attach(model):
        assert model(x, src_key_padding_mask=pad).shape == (4, 8) and mix.last.info["box"]
