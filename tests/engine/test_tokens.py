"""Token maps: the region mixers on (B, T, D) tokens through a declared (or the model's) patch grid; a timm
ViT and a torchvision ViT against hand-split forwards, every region mixer equal to itself on the same map,
the leading-token rules, and the grids and sequences that are refused."""

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import mixhook
from mixhook import CutMix, FMix, PatchUp, TokenMix
from mixhook.engine.card import methods_with
from mixhook.engine.tokens import model_grid
from tests.helpers import Lazy, gen

timm = Lazy("timm")  # imported when a test first uses it, not at collection


def tiny_vit(**options):
    torch.manual_seed(0)
    options = {"img_size": 16, "patch_size": 4, "embed_dim": 12, "depth": 2, "num_heads": 2, **options}
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, **options)


def tiny_torchvision_vit():
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=12, mlp_dim=24, num_classes=3
    )


REGION_MIXERS = sorted(methods_with("tokens"))  # (the cards': the region methods that take a token grid)


def test_the_region_mixers_all_take_a_token_grid():
    """The cards' trait ``"tokens"`` names exactly the methods whose constructor takes a token grid
    (``Card`` refuses a card that says otherwise), the region methods among them all."""
    takes = sorted(
        name for name, cls in mixhook.mixers.METHODS.items() if "tokens" in inspect.signature(cls).parameters
    )
    assert REGION_MIXERS == takes and len(takes) >= 15
    assert {"CutMix", "FMix", "TransMix"} <= set(REGION_MIXERS)


def test_cutmix_on_a_timm_vit_block_equals_a_hand_split_forward_with_gradients():
    """Block 0's 1 + 4x4 tokens: the patch tokens of a 2x3 box come from the partner, the class token is
    blended with the corrected lam; logits and every parameter's gradient as a hand-edited forward."""
    model = tiny_vit().double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    index = torch.tensor([2, 0, 3, 1])
    mix = CutMix("blocks.0", tokens="auto", generator=gen())
    with mix.attach(model):
        mix.pin(box=(1, 3, 0, 3), index=index)
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    lam = 1 - 6 / 16
    assert float(mix.last.lam) == lam and mix.last.info["box"] == (1, 3, 0, 3)
    m = by_hand
    h = m.blocks[0](m.norm_pre(m.patch_drop(m._pos_embed(m.patch_embed(x)))))
    cls, patches = h[:, :1], h[:, 1:].reshape(4, 4, 4, 12)  # (B, rows, columns, D), row-major tokens
    cls = lam * cls + (1 - lam) * cls[index]
    inside = torch.zeros(4, 4, 1, dtype=torch.bool)
    inside[1:3, 0:3] = True
    patches = torch.where(inside, patches[index], patches)
    tokens = torch.cat([cls, patches.reshape(4, 16, 12)], dim=1)
    expected = m.forward_head(m.norm(m.blocks[1](tokens)))
    (lam * F.cross_entropy(expected, y) + (1 - lam) * F.cross_entropy(expected, y[index])).backward()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_cutmix_at_a_timm_vits_patch_embedding_cuts_the_grid_before_the_class_token_is_added():
    """Issue 44: ``patch_embed`` gives the 4x4 patch tokens alone (the class token and registers are added
    after it); it was refused for having none of the model's leading tokens."""
    model = tiny_vit(reg_tokens=2).double().train()
    by_hand = copy.deepcopy(model)
    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    index = torch.tensor([2, 0, 3, 1])
    mix = CutMix("patch_embed", tokens="auto", generator=gen())
    with mix.attach(model):
        mix.pin(box=(0, 2, 1, 4), index=index)
        logits = model(x)
    patches = by_hand.patch_embed(x).reshape(4, 4, 4, 12)
    inside = torch.zeros(4, 4, 1, dtype=torch.bool)
    inside[0:2, 1:4] = True
    pasted = torch.where(inside, patches[index], patches).reshape(4, 16, 12)
    m = by_hand
    expected = m.forward_head(m.norm(m.blocks(m.norm_pre(m.patch_drop(m._pos_embed(pasted))))))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    assert float(mix.last.lam) == 1 - 6 / 16


def test_fmix_on_a_torchvision_vit_layer_keeps_the_class_token_with_prefix_keep():
    model = tiny_torchvision_vit().double().train()
    x = torch.randn(3, 3, 16, 16, dtype=torch.double)
    layer = model.encoder.layers.encoder_layer_0
    seen = {}
    layer.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.detach().clone()))
    model.encoder.layers.encoder_layer_1.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("mixed", a[0].detach().clone())
    )
    mask = torch.zeros(4, 4, dtype=torch.double)
    mask[:, :3] = 1  # the sample keeps columns 0-2, its partner gives column 3
    index = torch.tensor([1, 2, 0])
    mix = FMix("encoder.layers.encoder_layer_0", tokens=(4, 4), prefix="keep", generator=gen())
    assert repr(mix).endswith("tokens=(4, 4), prefix='keep', decay_power=3.0, max_soft=0.0, spectrum=None)")
    with mix.attach(model):
        mix.pin(mask=mask, index=index)
        model(x)
    h = seen["h"]
    m = mask.reshape(1, 16, 1)
    expected = torch.cat([h[:, :1], m * h[:, 1:] + (1 - m) * h[index, 1:]], dim=1)
    torch.testing.assert_close(seen["mixed"], expected, rtol=0, atol=1e-15)
    assert float(mix.last.lam) == 0.75


@pytest.mark.parametrize(
    "name", [n for n in REGION_MIXERS if n not in methods_with("attention")]
)  # (those that read attention: their own tests)
def test_every_region_mixer_mixes_tokens_as_it_mixes_the_same_map(name):
    """The same mixer, the same seed: its tokens' patch part equals its mix of the (B, D, gh, gw) map the
    tokens are, and the leading tokens are blended with the lam the targets get."""
    cls = getattr(mixhook, name)
    options = {
        "PatchUp": {"block_size": 3},
        "AttentiveCutMix": {"grid": 2, "top_k": 1},
        "GuidedMixup": {"saliency": "activation"},  # (the map's own: no labels for a gradient pass)
    }.get(name, {})
    tokens = torch.randn(4, 2 + 20, 6, dtype=torch.double)  # 2 leading tokens, a 4x5 grid
    grid = tokens[:, 2:].transpose(1, 2).reshape(4, 6, 4, 5)
    results = []
    for value, extra in ((tokens, {"tokens": (4, 5)}), (grid, {})):
        model = nn.Sequential(nn.Identity()).train()
        mix = cls("0", generator=gen(7), **options, **extra)
        with mix.attach(model):
            out = model(value)
        results.append((out, mix.last))
    (mixed_tokens, last), (mixed_map, map_last) = results
    assert torch.equal(last.index, map_last.index) and torch.equal(last.lam, map_last.lam)
    assert torch.equal(mixed_tokens[:, 2:], mixed_map.flatten(2).transpose(1, 2))
    lam = last.lam.to(torch.double)
    lam = lam.view(-1, 1, 1) if lam.ndim else lam
    torch.testing.assert_close(mixed_tokens[:, :2], lam * tokens[:, :2] + (1 - lam) * tokens[last.index, :2])


def test_per_sample_cutmix_blends_each_class_token_with_its_own_lam():
    tokens = torch.randn(4, 1 + 16, 5, dtype=torch.double)
    model = nn.Sequential(nn.Identity()).train()
    mix = CutMix("0", mode="elem", tokens=(4, 4), generator=gen(2))
    seen = {}
    model.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))
    with mix.attach(model):
        model(tokens)
    lam, index = mix.last.lam, mix.last.index
    assert lam.shape == (4,) and len(set(lam.tolist())) > 1
    expected = lam.view(4, 1, 1) * tokens[:, :1] + (1 - lam.view(4, 1, 1)) * tokens[index, :1]
    torch.testing.assert_close(seen["out"][:, :1], expected)


def test_seq_first_tokens_are_cut_along_their_own_batch_dimension():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)  # (T, B, D): the batch at dim 1
    model = nn.Sequential(layer).double().train()
    x = torch.randn(1 + 9, 3, 8, dtype=torch.double)
    index = torch.tensor([2, 0, 1])
    mix = TokenMix("0", tokens=(3, 3), generator=gen())
    cells = torch.ones(3, 3, dtype=torch.bool)
    cells[0, 0] = cells[2, 1] = False
    with mix.attach(model):
        mix.pin(cells=cells, index=index)
        out = model(x)
    h = layer(x)  # eval-free: no dropout, so the plain layer gives what the hook saw
    keep = cells.reshape(9, 1, 1).double()
    lam = 7 / 9
    expected = torch.cat([lam * h[:1] + (1 - lam) * h[:1, index], keep * h[1:] + (1 - keep) * h[1:, index]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert float(mix.last.lam) == lam


def test_the_model_states_its_grid():
    def stated(model):
        grid = model_grid(model)
        return grid.rows, grid.cols, grid.prefix

    assert stated(tiny_vit()) == (4, 4, 1)
    assert stated(tiny_vit(reg_tokens=2)) == (4, 4, 3)
    assert stated(tiny_vit(img_size=(16, 24))) == (4, 6, 1)
    assert stated(tiny_torchvision_vit()) == (4, 4, 1)
    assert model_grid(torchvision.models.resnet18()) is None


@pytest.mark.parametrize(
    ("model", "layer", "make", "error", "message"),
    [
        (
            tiny_vit,
            "blocks.0",
            lambda: CutMix("blocks.0", tokens=(2, 8)),
            ValueError,
            r"CutMix at 'blocks.0': tokens=\(2, 8\) but the model's patch grid is 4x4 \(timm "
            r"patch_embed.grid_size\); declare tokens=\(4, 4\) or tokens='auto'",
        ),
        (
            tiny_vit,
            "blocks.0",
            lambda: CutMix("blocks.0"),
            TypeError,
            r"CutMix at 'blocks.0': Block states no layout for its 3-D map .*; declare layout='NCL' "
            r"\(\(B, C, L\)\) or layout='NLC' \(\(B, L, C\)\); for \(B, T, D\) tokens declare their patch "
            r"grid: tokens=\(rows, columns\) or 'auto'",
        ),
        (
            tiny_vit,
            "head",
            lambda: FMix("head", tokens="auto"),
            TypeError,
            r"FMix at 'head' with tokens='auto' needs \(B, T, D\) tokens, but has shape \(2, 3\)",
        ),
        (
            lambda: nn.Sequential(nn.Identity()),
            "0",
            lambda: PatchUp("0", tokens="auto"),
            TypeError,
            "PatchUp at '0': tokens='auto' but Sequential does not state a fixed patch grid",
        ),
        (
            lambda: nn.Sequential(nn.Identity()),
            "0",
            lambda: TokenMix("0", tokens=(5, 5)),
            ValueError,
            r"TokenMix at '0': has 17 tokens, fewer than the 5x5 = 25 patch tokens of the grid "
            r"tokens=\(5, 5\)",
        ),
    ],
)
def test_grids_that_do_not_fit_are_refused_in_one_line(model, layer, make, error, message):
    model = model().train()
    x = (
        torch.randn(2, 3, 16, 16)
        if isinstance(model, timm.models.VisionTransformer)
        else torch.randn(2, 17, 4)
    )
    with pytest.raises(error, match=message):
        with make().attach(model):
            model(x)


@pytest.mark.parametrize(
    ("tokens", "prefix", "message"),
    [
        ((4,), "blend", r"tokens must be the patch grid \(rows, columns\) as two ints >= 1, 'auto'"),
        ((0, 4), "blend", r"got \(0, 4\)"),
        ("grid", "blend", "got 'grid'"),
        ((4, 4), "mix", "prefix must be one of blend, keep, got 'mix'"),
    ],
)
def test_bad_token_arguments_are_refused_in_one_line(tokens, prefix, message):
    with pytest.raises(ValueError, match=message):
        CutMix("blocks.0", tokens=tokens, prefix=prefix)
