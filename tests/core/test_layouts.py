"""Layouts: region methods cut the height and width of every 4-D map, (B, C, H, W) or (B, H, W, C), or refuse.

Torchvision's Swin keeps (B, H, W, C) maps in ``features``, ConvNeXt blocks (torchvision's and timm's with
``conv_mlp=False``) permute to (B, H, W, C) around their LayerNorm and MLP. Each is checked against a
hand-edited model (the layer wrapped in a module that pastes the box over H and W by hand) in float64,
logits and every gradient; every layout-aware method on an NHWC map against the same method on the NCHW
map it is a permutation of; and what cannot be told is refused in one line.
"""

import copy
from collections import OrderedDict
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops.misc import Permute

from mixhook import (
    CutMix,
    FMix,
    ManifoldMixup,
    PatchUp,
    PuzzleMix,
    ResizeMix,
    SaliencyMix,
    SnapMix,
)
from mixhook.engine.card import methods_with, traits_of
from mixhook.layouts import AmbiguousLayoutError
from mixhook.mixers import METHODS
from tests.helpers import gen, set_module


class Pasted(nn.Module):
    """A hand edit: ``layer``'s output with ``box`` (rows y1:y2, columns x1:x2 at dims ``hw``) taken from
    the partner ``index[i]``."""

    def __init__(self, layer, box, index, hw):
        super().__init__()
        self.layer, self.box, self.index, self.hw = layer, box, index, hw

    def forward(self, *args, **kwargs):
        out = self.layer(*args, **kwargs)
        y1, y2, x1, x2 = self.box
        where = [slice(None)] * out.ndim
        where[self.hw[0]], where[self.hw[1]] = slice(y1, y2), slice(x1, x2)
        pasted = out.clone()
        pasted[tuple(where)] = out[self.index][tuple(where)]
        return pasted


def swin():
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(
        patch_size=[2, 2],
        embed_dim=8,
        depths=[1, 1],
        num_heads=[1, 1],
        window_size=[4, 4],
        num_classes=3,
        stochastic_depth_prob=0.0,
    )


def convnext_torchvision():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], num_classes=3)


def convnext_timm():
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 8, 16, 16), num_classes=3, conv_mlp=False)


def swin_timm():
    import timm

    return timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=32, embed_dim=8,
        depths=(1, 1), num_heads=(1, 1), window_size=4, drop_path_rate=0.0,
    )  # fmt: skip


def timm_model(name, **kwargs):
    def build():
        import timm

        return timm.create_model(name, pretrained=False, num_classes=3, **kwargs)

    return build


maxvit_timm = timm_model("maxvit_pico_rw_256", img_size=64)
gcvit_timm = timm_model("gcvit_xxtiny", img_size=64)
nest_timm = timm_model("nest_tiny", img_size=64, drop_path_rate=0.0)


# (model, layer, the dims of H and W in its output, input side)
CASES = {
    "swin_t-features.1": (swin, "features.1", (1, 2), 16),
    "swin_t-features.0": (swin, "features.0", (1, 2), 16),
    "convnext-block.LayerNorm": (convnext_torchvision, "features.1.0.block.2", (1, 2), 32),
    "convnext-block.GELU": (convnext_torchvision, "features.1.0.block.4", (1, 2), 32),
    "convnext-CNBlock": (convnext_torchvision, "features.1.0", (2, 3), 32),
    "timm-convnext-norm": (convnext_timm, "stages.1.blocks.0.norm", (1, 2), 32),
    "timm-convnext-mlp": (convnext_timm, "stages.1.blocks.0.mlp", (1, 2), 32),
    "timm-convnext-conv_dw": (convnext_timm, "stages.1.blocks.0.conv_dw", (2, 3), 32),
    "timm-swin-stage": (swin_timm, "layers.0", (1, 2), 32),
    # issue 44: channels-last blocks that permute in forward() code (these were cut over W x C)
    "timm-maxvit-attn_block": (maxvit_timm, "stages.0.blocks.0.attn_block", (1, 2), 64),
    "timm-maxvit-attn_block.drop_path1": (maxvit_timm, "stages.0.blocks.0.attn_block.drop_path1", (1, 2), 64),
    "timm-maxvit-block": (maxvit_timm, "stages.0.blocks.0", (2, 3), 64),
    "timm-gcvit-block": (gcvit_timm, "stages.0.blocks.0", (1, 2), 64),
    "timm-gcvit-block.ls2": (gcvit_timm, "stages.0.blocks.0.ls2", (1, 2), 64),
    "timm-gcvit-stage": (gcvit_timm, "stages.0", (2, 3), 64),
    "timm-nest-level": (nest_timm, "levels.0", (2, 3), 64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cutmix_pastes_over_height_and_width_as_a_hand_edited_model(case):
    build, layer, hw, side = CASES[case]
    torch.manual_seed(0)
    model = build().double().train()
    x = torch.randn(4, 3, side, side, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0])
    index, box = torch.tensor([2, 3, 0, 1]), (1, 3, 0, 2)
    reference = copy.deepcopy(model)
    set_module(reference, layer, Pasted(reference.get_submodule(layer), box, index, hw))
    mix = CutMix(layer, generator=gen())
    with mix.attach(model):
        mix.pin(lam=0.5, index=index, box=box)
        out = model(x)
        state = mix.state_for(out)
        mix.loss(F.cross_entropy, out, y).backward()
    ref = reference(x)
    sizes = state.shapes[0]
    lam = 1 - 4 / (sizes[hw[0]] * sizes[hw[1]])  # the 2x2 box over the map's H x W
    assert float(state.lam) == pytest.approx(lam)
    assert tuple(state.weights.shape) == (1, sizes[hw[0]], sizes[hw[1]])
    (lam * F.cross_entropy(ref, y) + (1 - lam) * F.cross_entropy(ref, y[index])).backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


class Maps(nn.Module):
    """conv -> (Permute to NHWC | Identity) -> GELU -> back: ``features.2``'s map is (B, H, W, C) or
    (B, C, H, W) with the same values."""

    def __init__(self, nhwc: bool):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), Permute([0, 2, 3, 1]) if nhwc else nn.Identity(), nn.GELU()
        )
        self.back = Permute([0, 3, 1, 2]) if nhwc else nn.Identity()
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        return self.head(self.back(self.features(x)).mean((2, 3)))


BY_HAND = {  # (the methods that take more than a layer here)
    "PuzzleMix": lambda: PuzzleMix("features.2", grids=(2, 4), saliency="activation", generator=gen(5)),
    "SnapMix": lambda: SnapMix("features.2", features="back", classifier="head", generator=gen(5)),
}
LAYOUT_AWARE = {
    name: (lambda cls=cls: cls("features.2", generator=gen(5)))
    for name, cls in METHODS.items()
    if getattr(cls, "layout_aware", False)
    and cls.card.family not in ("composition", "learned")  # (the learned ones read features: below)
    and not traits_of(cls) & {"attention", "pixels"}  # (a ViT's: test_transmix; AugMix: the input only)
    and name not in BY_HAND
}
LAYOUT_AWARE.update({
    **{  # (the learned methods, their features at an earlier layer)
        name: (lambda cls=METHODS[name]: cls("features.2", features="features.0", generator=gen(5)))
        for name in methods_with(family="learned")
    },
    **BY_HAND,
    "CutMix-elem": lambda: CutMix("features.2", mode="elem", generator=gen(5)),
    "SaliencyMix-gradient": lambda: SaliencyMix("features.2", saliency="gradient", generator=gen(5)),
    "SaliencyMix-saliency_layer": lambda: SaliencyMix(
        "features.2", saliency_layer="features.1", generator=gen(5)
    ),
})  # fmt: skip


@pytest.mark.parametrize("method", list(LAYOUT_AWARE))
def test_every_region_method_mixes_an_nhwc_map_as_its_nchw_twin(method):
    """The same draws on the same values: the NHWC model's mix is the NCHW model's, permuted (logits,
    lam, weights and gradients equal)."""
    results = []
    for nhwc in (True, False):
        torch.manual_seed(0)
        model = Maps(nhwc).double().train()
        x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
        mix = LAYOUT_AWARE[method]()
        with mix.attach(model):
            mix.use_targets(y)
            out = model(x)
            state = mix.state_for(out)
            mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), out, y).sum().backward()
        results.append((out, state, [p.grad for p in model.parameters()]))
    (out, state, grads), (out_ref, state_ref, grads_ref) = results
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.lam, state_ref.lam)
    assert (state.weights is None) == (state_ref.weights is None)
    if state.weights is not None:
        torch.testing.assert_close(state.weights, state_ref.weights)
    torch.testing.assert_close(grads, grads_ref, rtol=1e-10, atol=1e-12)


def test_a_map_whose_layout_nothing_states_is_refused_until_declared():
    """timm's ConvNeXt permutes inside its blocks, so its ``drop_path`` (an Identity) could carry either
    layout: refused in one line naming the fix, accepted declared; a blend (layout-free) is not refused."""
    torch.manual_seed(0)
    model = convnext_timm().double().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    mix = CutMix("stages.1.blocks.0.drop_path")
    with mix.attach(model), pytest.raises(AmbiguousLayoutError) as err:
        model(x)
    message = str(err.value)
    assert "\n" not in message and "stages.1.blocks.0.drop_path" in message
    assert "layout='NCHW' or layout='NHWC'" in message and "stages.1.blocks.0" in message
    declared = CutMix("stages.1.blocks.0.drop_path", layout="NCHW", generator=gen())
    with declared.attach(model):
        declared.pin(lam=0.5, index=torch.tensor([1, 0]), box=(0, 2, 0, 2))
        model(x)
        assert declared.last.weights.shape == (1, 4, 4)  # its (B, 16, 4, 4) map, cut over 4 x 4
    with ManifoldMixup("stages.1.blocks.0.drop_path").attach(model):
        model(x)


def test_windows_inside_maxvit_are_not_maps():
    """torchvision's MaxViT partitions its maps into (B, windows, positions, C) tensors for attention:
    a box over them would not be a box of the image. Refused, declared or not; the block's output is a map."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.maxvit_t(num_classes=3).train()
    block = "blocks.0.layers.0.layers.grid_attention"
    for mix in (CutMix(f"{block}.attn_layer"), CutMix(f"{block}.attn_layer", layout="NHWC")):
        with mix.attach(model), pytest.raises(AmbiguousLayoutError, match="are windows") as err:
            mix.check_output(f"{block}.attn_layer", torch.zeros(2, 196, 49, 64), 2)
        assert f"mix '{block}' itself" in str(err.value)
    mix = CutMix(block, generator=gen())
    with mix.attach(model):
        mix.check_output(block, torch.zeros(2, 64, 56, 56), 2)  # a (B, C, H, W) map: accepted


def test_a_declared_layout_that_contradicts_the_model_is_refused():
    torch.manual_seed(0)
    model = swin().train()
    mix = FMix("features.1", layout="NCHW")
    with (
        mix.attach(model),
        pytest.raises(AmbiguousLayoutError, match="gives NHWC maps; declare layout='NHWC'"),
    ):
        model(torch.randn(2, 3, 16, 16))


@pytest.mark.parametrize(
    "layout, match",
    [("NWHC", "layout must be 'NCHW'"), ({"nosuch": "NHWC"}, "not among"), ({"conv2": "CHW"}, "layout must")],
)
def test_a_bad_layout_argument_is_refused_at_construction(layout, match):
    with pytest.raises(ValueError, match=match):
        PatchUp("conv2", layout=layout)


def test_a_model_input_given_as_nhwc_is_cut_over_height_and_width_when_declared():
    class TakesNHWC(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, 2)

        def forward(self, x):  # (B, H, W, C) images
            return self.head(x.mean((1, 2)))

    torch.manual_seed(0)
    model = TakesNHWC().double().train()
    x = torch.randn(2, 6, 6, 3, dtype=torch.float64)
    index, box = torch.tensor([1, 0]), (0, 3, 1, 4)
    mix = CutMix("input", layout="NHWC")
    with mix.attach(model):
        mix.pin(lam=0.5, index=index, box=box)
        out = model(x)
    pasted = x.clone()
    pasted[:, 0:3, 1:4, :] = x[index][:, 0:3, 1:4, :]
    torch.testing.assert_close(out, model.head(pasted.mean((1, 2))))


def test_channels_last_memory_format_is_not_a_layout():
    """A (B, C, H, W) model and batch stored channels-last mix exactly as the contiguous ones: the same
    mask over the same (H, W) (its mixed map equal up to the convolutions' own rounding, which differs
    between the two formats by about 1e-12 in float64, as the unhooked model's does)."""
    import torchvision

    from mixhook import FeatureRecorder, attach

    outs = []
    for channels_last in (False, True):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=3).double().train()
        x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        mix = PatchUp("layer1", block_size=3, generator=gen(1))
        before, after = FeatureRecorder("layer1", where="before"), FeatureRecorder("layer1", where="after")
        with attach(model, mix, before, after):
            model(x)
        outs.append((mix.last.info["mask"], before.features["layer1"], after.features["layer1"]))
    (mask, h, mixed), (mask_cl, h_cl, mixed_cl) = outs
    assert h_cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(mask, mask_cl)
    torch.testing.assert_close(h_cl, h, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(mixed_cl, mixed, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_mix_puts_an_nhwc_map_of_equal_sides_back_in_its_layout():
    """(B, 6, 6, 6): the channels-first view has the same shape, so only the layout can say that the mixed
    map must be permuted back (the traced path once compared shapes, and gave the NCHW view back)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Flatten(), nn.Linear(216, 3)).double().train()
    x = torch.randn(4, 6, 6, 6, dtype=torch.float64)
    outs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        mix = CutMix("0", layout="NHWC", generator=torch.Generator().manual_seed(1))
        with mix.attach(model):
            mix.pin(lam=0.75, box=(0, 3, 0, 3), index=torch.tensor([1, 0, 3, 2]))
            outs.append((torch.compile(model, backend="eager") if compiled else model)(x))
    h = model[0](x)
    expected = h.clone()
    expected[:, 0:3, 0:3, :] = h[[1, 0, 3, 2], 0:3, 0:3, :]
    torch.testing.assert_close(outs[0], model[1:](expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------- issue 44


def test_a_model_level_format_does_not_reach_into_the_stem():
    """timm's MambaOut states ``output_fmt="NHWC"`` for its stages; its stem permutes in forward() code, and
    the GELU between its two convolutions gives a (B, C, H, W) map: once read as NHWC (cut over C x H), now
    refused until declared, and exact declared."""
    torch.manual_seed(0)
    model = timm_model("mambaout_femto")().double().train()
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    with CutMix("stem.act").attach(model), pytest.raises(AmbiguousLayoutError) as err:
        model(x)
    assert "layout='NCHW' or layout='NHWC'" in str(err.value) and "\n" not in str(err.value)
    reference = copy.deepcopy(model)
    index, box = torch.tensor([1, 2, 3, 0]), (1, 3, 0, 2)
    set_module(reference, "stem.act", Pasted(reference.get_submodule("stem.act"), box, index, (2, 3)))
    mix = CutMix("stem.act", layout="NCHW")
    with mix.attach(model):
        mix.pin(index=index, box=box)
        out = model(x)
    torch.testing.assert_close(out, reference(x), rtol=1e-12, atol=1e-12)
    assert mix.last.weights.shape == (1, 16, 16)


def test_windows_of_timm_maxvit_are_refused_at_the_attention_and_inside_it():
    torch.manual_seed(0)
    model = maxvit_timm().train()
    for layer in ("stages.0.blocks.0.attn_block.attn", "stages.0.blocks.0.attn_block.attn.qkv"):
        mix = CutMix(layer)
        with mix.attach(model), pytest.raises(AmbiguousLayoutError, match="are windows") as err:
            model(torch.randn(2, 3, 64, 64))
        assert "mix a module around it whose output is the map" in str(err.value)


@pytest.mark.parametrize(
    "layer", ["transformer_encoder.0", "transformer_encoder", "transformer_encoder.0.norm1"]
)
def test_blocks_of_positions_inside_nest_are_not_maps(layer):
    """timm's NesT runs its transformer on (B, blocks, positions in a block, C) tensors; a LayerNorm's 4-D
    output there once read as an NHWC map would have been cut over blocks x positions."""
    torch.manual_seed(0)
    model = nest_timm().train()
    with CutMix(f"levels.1.{layer}").attach(model), pytest.raises(AmbiguousLayoutError) as err:
        model(torch.randn(2, 3, 64, 64))
    assert "blocks of positions" in str(err.value) and "\n" not in str(err.value)


def test_unfolded_patches_of_mobilevit_v2_are_not_maps():
    """MobileViT-v2's transformer runs 1x1 convolutions over (B, C, pixels in a patch, patches): NCHW by the
    convolution, but no map; its sides (4 x 24 from a 64 x 96 input) say so. A declared layout accepts it."""
    torch.manual_seed(0)
    model = timm_model("mobilevitv2_050")().train()
    layer = "stages.2.1.transformer.1.attn.qkv_proj"
    with CutMix(layer).attach(model), pytest.raises(AmbiguousLayoutError) as err:
        model(torch.randn(2, 3, 64, 96))
    assert "which makes this (2, 129, 4, 24) map 4x24, but the model's input is 64x96" in str(err.value)
    assert "unfolded patches" in str(err.value)
    with CutMix(layer, layout="NCHW").attach(model):
        model(torch.randn(2, 3, 64, 96))


class PermutedInCode(nn.Module):
    """A convolutional stem, then a channels-last block that holds only a LayerNorm and a Linear (so nothing
    in the model states NHWC): the permute is in forward() code."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = ChannelsLastBlock(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(self.stem(x).permute(0, 2, 3, 1)).mean((1, 2)))


class ChannelsLastBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(c), nn.Linear(c, c)

    def forward(self, x):
        return x + self.fc(self.norm(x))


def test_a_map_read_by_convention_whose_sides_are_not_the_inputs_is_refused():
    """The block's (B, 12, 16, 8) map read as NCHW by convention would be 16 x 8 from a 12 x 16 input:
    refused in one line; declared NHWC it is cut over its height and width."""
    torch.manual_seed(0)
    model = PermutedInCode().double().train()
    x = torch.randn(4, 3, 12, 16, dtype=torch.float64)
    with CutMix("block").attach(model), pytest.raises(AmbiguousLayoutError) as err:
        model(x)
    message = str(err.value)
    assert "PyTorch's convention gives NCHW maps" in message and "16x8" in message and "12x16" in message
    assert "declare layout='NHWC'" in message and "\n" not in message
    reference = copy.deepcopy(model)
    index, box = torch.tensor([1, 2, 3, 0]), (1, 3, 0, 2)
    reference.block = Pasted(reference.block, box, index, (1, 2))
    mix = CutMix("block", layout="NHWC")
    with mix.attach(model):
        mix.pin(index=index, box=box)
        torch.testing.assert_close(model(x), reference(x), rtol=1e-12, atol=1e-12)
    with ManifoldMixup("block").attach(model):  # a blend needs no layout
        model(x)


@pytest.mark.slow
def test_a_video_resnet_block_is_cut_over_its_frames_height_and_width():
    """torchvision's video ResNets take (B, C, T, H, W) clips and keep them so: their blocks (whose
    Conv3d outputs were accepted, the blocks themselves refused for want of a layout) are cut as NCDHW."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.video.r3d_18(num_classes=3).double().train()
    x = torch.randn(4, 3, 4, 16, 24, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0])
    index, box = torch.tensor([1, 2, 3, 0]), (0, 2, 1, 3, 2, 6)
    reference = copy.deepcopy(model)
    block = reference.layer1[1]

    def paste(module, args, out):
        pasted = out.clone()
        pasted[:, :, 0:2, 1:3, 2:6] = out[index][:, :, 0:2, 1:3, 2:6]
        return pasted

    block.register_forward_hook(paste)
    mix = CutMix("layer1.1")
    with mix.attach(model):
        mix.pin(index=index, box=box)
        out = model(x)
        mix.loss(F.cross_entropy, out, y).backward()
    lam = 1 - 2 * 2 * 4 / (4 * 8 * 12)  # the (B, 64, 4, 8, 12) map
    ref = reference(x)
    (lam * F.cross_entropy(ref, y) + (1 - lam) * F.cross_entropy(ref, y[index])).backward()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert mix.last.weights.shape == (1, 4, 8, 12)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    with CutMix("input").attach(model):  # its input: a (B, C, T, H, W) clip, as the model states
        model(x)


@pytest.mark.slow
def test_wav2vec2_convolutional_features_are_cut_along_their_positions():
    """HuggingFace's wav2vec2 feature encoder gives (B, C, L) maps (a conv layer holds a LayerNorm that it
    transposes around, in code): read from the class, cut along L; its positional convolution gives a
    (B, L, C) sequence, refused until declared."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        num_labels=3, classifier_proj_size=8, feat_extract_norm="layer", hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        mask_time_prob=0.0,
    )  # fmt: skip
    model = Wav2Vec2ForSequenceClassification(config).double().train()
    x = torch.randn(4, 800, dtype=torch.float64)
    layer = "wav2vec2.feature_extractor.conv_layers.0"
    index = torch.tensor([1, 2, 3, 0])
    reference = copy.deepcopy(model)

    def paste(module, args, out):
        pasted = out.clone()
        pasted[:, :, 10:50] = out[index][:, :, 10:50]
        return pasted

    reference.get_submodule(layer).register_forward_hook(paste)
    mix = CutMix(layer)
    with mix.attach(model):
        mix.pin(index=index, box=(10, 50))
        out = model(input_values=x).logits
    torch.testing.assert_close(out, reference(input_values=x).logits, rtol=1e-12, atol=1e-12)
    assert mix.last.weights.shape == (1, 159)
    positional = "wav2vec2.encoder.pos_conv_embed"
    with CutMix(positional).attach(model), pytest.raises(AmbiguousLayoutError, match="declare layout='NLC'"):
        model(input_values=x)


def _channels_last_net() -> nn.Module:
    """Convolutions in channels-last (the map at ``layer2`` is 8 channels of 32x32), then a linear head."""
    torch.manual_seed(0)
    layers = {
        "stem": nn.Conv2d(3, 8, 3, padding=1),
        "layer2": nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()),
        "layer3": nn.Conv2d(8, 8, 3, padding=1),
        "pool": nn.AdaptiveAvgPool2d(1),
        "flat": nn.Flatten(),
        "fc": nn.Linear(8, 4),
    }
    return nn.Sequential(OrderedDict(layers)).to(memory_format=torch.channels_last).train()


@pytest.mark.parametrize(
    "make",
    [
        lambda: ManifoldMixup("layer2"),
        lambda: CutMix("layer2"),
        lambda: PatchUp("layer2", block_size=3),
        lambda: PatchUp("layer2", block_size=3, mode="hard"),
        lambda: ResizeMix("layer2"),
        lambda: PuzzleMix("layer2", grids="auto", transport=False),
    ],
    ids=["manifold", "cutmix", "patchup", "patchup-hard", "resizemix", "puzzlemix"],
)
@pytest.mark.parametrize("batch", [2, 16], ids=["small", "gathered-backward"])
def test_a_channels_last_map_stays_channels_last_through_the_mix(make, batch):
    # index_select returns a contiguous tensor whatever its input's layout: a channels-last map came out of
    # the blend contiguous and every convolution after it copied its input and gradient back (issue 72);
    # batch 16 (131,072 elements) takes the blend's gathering backward (GATHER_FROM), batch 2 the plain one
    model = _channels_last_net()
    mix = make()
    mix.attach(model)
    seen = []
    model.layer3.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = torch.randn(batch, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 4, (batch,))
    if hasattr(mix, "use_targets"):
        mix.use_targets(y)
    mix.loss(partial(F.cross_entropy, reduction="none"), model(x), y).mean().backward()
    assert seen[-1].is_contiguous(memory_format=torch.channels_last) and not seen[-1].is_contiguous()
