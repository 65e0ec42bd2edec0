"""TL-Align: the mix, the carried labels, the loss and its gradients against the authors' lines on the same
box and partners (timm's ViT at the input, fused attention or not), a block's tokens, torchvision's and
HuggingFace's ViTs, a model that pools its patch tokens, the refusals."""

import copy

import pytest
import torch
import torchvision
from torch import nn

from mixhook import TLA
from tests.helpers import attending_vit, gen

tiny_vit = attending_vit  # (labels carried by an even average would hardly move)


# From Euphoria16/TL-Align, tla.py: one_hot, mixup_target and token_label (device="cpu", and one_hot's
# values in float64 where theirs are float32: the check is in float64).
def one_hot(x, num_classes, on_value=1.0, off_value=0.0, device="cpu"):
    x = x.long().view(-1, 1)
    full = torch.full((x.size()[0], num_classes), off_value, device=device, dtype=torch.float64)
    return full.scatter_(1, x, on_value)


def mixup_target(target, num_classes, lam=1.0, smoothing=0.0, device="cpu"):
    off_value = smoothing / num_classes
    on_value = 1.0 - smoothing + off_value
    y1 = one_hot(target, num_classes, on_value=on_value, off_value=off_value, device=device)
    y2 = one_hot(target.flip(0), num_classes, on_value=on_value, off_value=off_value, device=device)
    return y1 * lam + y2 * (1.0 - lam)


def token_label(target, num_classes, mask, smoothing=0.0, device="cpu"):
    off_value = smoothing / num_classes
    on_value = 1.0 - smoothing + off_value
    y1 = one_hot(target, num_classes, on_value=on_value, off_value=off_value, device=device)
    y1 = y1.unsqueeze(1).repeat(1, len(mask), 1)
    y1[:, mask == 1, :] = y1.flip(0)[:, mask == 1, :]
    return y1


# From Euphoria16/TL-Align, timm/models/vision_transformer.py: Attention.forward's label lines (the
# attention softmax before attn_drop, averaged over heads, times the labels) and Block.forward's average
# with the labels it was given; `.float()` left out so that the float64 check stays float64.
def aligned(attn_module, x, label_embed):
    B, N, C = x.shape
    qkv = attn_module.qkv(x).reshape(B, N, 3, attn_module.num_heads, C // attn_module.num_heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    attn = (q @ k.transpose(-2, -1)) * attn_module.scale
    attn = attn.softmax(dim=-1)
    attn_softmax = torch.mean(attn.detach().clone(), dim=1)
    label_aligned = attn_softmax @ label_embed
    return (label_aligned + label_embed) / 2


def reference_labels(vit, mixed, label_embed, start=0):
    """The authors' forward_features with label_embed, through timm's blocks from ``start`` on."""
    x = vit._pos_embed(vit.patch_embed(mixed))
    for i, blk in enumerate(vit.blocks):
        if i >= start:
            label_embed = aligned(blk.attn, blk.norm1(x), label_embed)
        x = blk(x)
    return label_embed


@pytest.mark.parametrize("fused", [True, False])
def test_the_loss_and_gradients_equal_the_authors_on_the_same_box(fused):
    model = tiny_vit()
    for block in model.blocks:
        block.attn.fused_attn = fused
    plain = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    flip = torch.arange(3, -1, -1)
    yl, yh, xl, xh = 1, 3, 0, 3  # the box on the 4x4 patch grid (the authors' rand_token_bbox's bounds)
    smoothing = 0.1
    mix = TLA("input", attention="blocks.*.attn", generator=gen())
    criterion = nn.CrossEntropyLoss(reduction="none", label_smoothing=smoothing)
    with mix.attach(model):
        mix.pin(box=(yl, yh, xl, xh), index=flip)
        loss = mix.loss(criterion, model(x), y).mean()
    loss.backward()
    # the authors' TL_AlignMix._mix_batch (TokenMix mode) and __call__, with patch_size 4
    b, c, h, w, p = *x.shape, 4
    mixed = x.clone().view(b, c, h // p, p, w // p, p).permute(0, 1, 2, 4, 3, 5).contiguous()
    mixed[:, :, yl:yh, xl:xh, :, :] = mixed.flip(0)[:, :, yl:yh, xl:xh, :, :]
    mixed = mixed.permute(0, 1, 2, 4, 3, 5).contiguous().view(b, -1, h, w)
    lam = 1.0 - (yh - yl) * (xh - xl) / 16
    mask = torch.zeros(4, 4)
    mask[yl:yh, xl:xh] = 1
    cls_target = mixup_target(y, 3, lam, smoothing).double()
    token_target = token_label(y, 3, mask.view(-1), smoothing).double()
    label_embed = torch.cat([cls_target.unsqueeze(1), token_target], dim=1)
    with torch.no_grad():
        target = reference_labels(plain, mixed, label_embed)[:, 0]
    expected = torch.sum(-target * plain(mixed).log_softmax(-1), dim=-1).mean()  # SoftTargetCrossEntropy
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    for (name, a), b_ in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b_.grad, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(mix.targets(y, 3, smoothing), target.float(), rtol=1e-6, atol=1e-7)
    last = mix.last
    assert last.info["box"] == (yl, yh, xl, xh) and last.info["aligned"] == 3
    assert last.info["area_lam"] == lam and last.lam.shape == (4,)
    assert not torch.allclose(last.lam, torch.full((4,), lam, dtype=torch.double))  # the labels moved
    assert last.info["token_labels"].shape == (4, 17) and last.info["prefix"] == 1


def test_the_drawn_box_lies_on_the_patch_grid_and_lam_is_the_patches_kept():
    model = tiny_vit()
    mix = TLA("input", attention="blocks.*.attn", generator=gen(3))
    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    seen = {}
    model.patch_embed.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach()))
    with mix.attach(model):
        for _ in range(5):
            model(x)
            y1, y2, x1, x2 = mix.last.info["box"]
            assert 0 <= y1 <= y2 <= 4 and 0 <= x1 <= x2 <= 4
            assert mix.last.info["area_lam"] == 1 - (y2 - y1) * (x2 - x1) / 16
            expected = x.clone()
            rows, cols = slice(4 * y1, 4 * y2), slice(4 * x1, 4 * x2)
            expected[:, :, rows, cols] = x[mix.last.index][:, :, rows, cols]
            torch.testing.assert_close(seen["x"], expected, rtol=0, atol=0)


def test_on_a_blocks_tokens_the_labels_start_there():
    """Mixed at block 0's tokens: the class token is blended by lam (its label the mixed target) and the
    labels go through blocks 1 and 2 only (block 0's attention ran before the mix)."""
    model = tiny_vit()
    plain = copy.deepcopy(model)
    x, index, box = torch.randn(3, 3, 16, 16, dtype=torch.double), torch.tensor([2, 0, 1]), (0, 2, 1, 4)
    mix = TLA("blocks.0", attention="blocks.*.attn", tokens="auto")
    with mix.attach(model):
        mix.pin(box=box, index=index)
        model(x)
    with torch.no_grad():
        t = plain.blocks[0](plain._pos_embed(plain.patch_embed(x)))
        cells = torch.zeros(4, 4, dtype=torch.double)
        cells[0:2, 1:4] = 1
        lam = 1 - 6 / 16
        mixed = t.clone()
        mixed[:, 1:] = torch.where(cells.flatten()[None, :, None].bool(), t[index, 1:], t[:, 1:])
        mixed[:, 0] = lam * t[:, 0] + (1 - lam) * t[index, 0]
        labels = torch.cat([torch.tensor([1 - lam]), cells.flatten()]).expand(3, -1).unsqueeze(-1)
        for blk in plain.blocks[1:]:
            labels = aligned(blk.attn, blk.norm1(mixed), labels)
            mixed = blk(mixed)
    torch.testing.assert_close(mix.last.lam, 1 - labels[:, 0, 0], rtol=1e-12, atol=1e-14)
    assert mix.last.info["aligned"] == 2
    kept = TLA("blocks.0", attention="blocks.*.attn", tokens="auto", prefix="keep")
    with kept.attach(model):
        kept.pin(box=box, index=index)
        model(x)
    assert float(kept.last.info["token_labels"][0, 0]) != float(mix.last.info["token_labels"][0, 0])


def test_a_model_that_pools_its_patch_tokens_is_labelled_by_their_mean():
    model = tiny_vit(class_token=False, global_pool="avg")
    mix = TLA("input", attention="blocks.*.attn", generator=gen(1))
    with mix.attach(model):
        mix.pin(box=(0, 2, 0, 4), index=[1, 0])
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    labels = mix.last.info["token_labels"]
    assert mix.last.info["prefix"] == 0 and labels.shape == (2, 16)
    torch.testing.assert_close(mix.last.lam, 1 - labels.mean(1), rtol=0, atol=0)


def test_torchvision_and_huggingface_vits_carry_their_attention_weights():
    """torchvision's nn.MultiheadAttention (read again in eval mode: the weights before its dropout, and no
    draw from the global generator) and HuggingFace's ViT (sdpa) give the labels the eager weights give."""
    import transformers

    torch.manual_seed(0)
    tv = torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=12, mlp_dim=24, num_classes=3,
        attention_dropout=0.5,
    ).double().train()  # fmt: skip
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, num_labels=3,
    )  # fmt: skip
    hf = transformers.ViTForImageClassification(config).double().train()
    eager = transformers.ViTForImageClassification._from_config(config, attn_implementation="eager").double()
    eager.load_state_dict(hf.state_dict())
    x, index, box = torch.randn(3, 3, 16, 16, dtype=torch.double), [2, 0, 1], (1, 3, 0, 2)
    mixed = x.clone()
    mixed[:, :, 4:12, 0:8] = x[index, :, 4:12, 0:8]
    start = torch.zeros(17, dtype=torch.double)  # the class token's label, then the 4x4 patches'
    start[0] = 4 / 16  # (the partner's share of the mixed target: 1 - lam)
    start[1:].view(4, 4)[1:3, 0:2] = 1

    queries = {}  # each layer's input (the same when the reader calls it again)
    for i, layer in enumerate(tv.encoder.layers):
        layer.self_attention.register_forward_pre_hook(
            lambda m, a, i=i: queries.__setitem__(i, a[0].detach()), prepend=True
        )
    mix = TLA("input", attention="encoder.layers.*.self_attention")
    with mix.attach(tv):
        mix.pin(box=box, index=index)
        torch.manual_seed(5)
        tv(x)
        after = torch.rand(1)
    torch.manual_seed(5)
    unhooked = copy.deepcopy(tv)
    for layer in unhooked.encoder.layers:
        layer.self_attention._forward_pre_hooks.clear()
    unhooked(mixed)
    assert torch.equal(after, torch.rand(1))  # reading the weights drew nothing from the global generator
    labels = start.expand(3, -1)
    for i, layer in enumerate(tv.encoder.layers):
        q = queries[i]
        layer.self_attention.eval()
        with torch.no_grad():
            _, w = layer.self_attention(q, q, q, need_weights=True)
        layer.self_attention.train()
        labels = ((w @ labels.unsqueeze(-1)).squeeze(-1) + labels) / 2
    torch.testing.assert_close(mix.last.lam, 1 - labels[:, 0], rtol=1e-12, atol=1e-14)

    mix = TLA("input", attention="vit.layers.*.attention")
    with mix.attach(hf):
        mix.pin(box=box, index=index)
        hf(pixel_values=x)
    eager.eval()  # (no dropout in this config)
    labels = start.expand(3, -1)
    for attn in eager(pixel_values=mixed, output_attentions=True).attentions:
        labels = ((attn.mean(1) @ labels.unsqueeze(-1)).squeeze(-1) + labels) / 2
    # HuggingFace's eager attention takes its softmax in float32, hence the tolerance
    torch.testing.assert_close(mix.last.lam, 1 - labels[:, 0], rtol=1e-6, atol=1e-8)


def test_refusals_are_one_line():
    model = tiny_vit()
    with pytest.raises(TypeError, match="TLA: attention='blocks.0.mlp' is a Mlp, not an attention module"):
        TLA("input", attention="blocks.*.mlp").attach(model)
    with pytest.raises(ValueError, match="^readout must be one of auto, class, mean, got 'max'$"):
        TLA("input", attention="blocks.*.attn", readout="max")
    with pytest.raises(ValueError, match="^TLA at 'blocks.0': its labels follow a ViT's tokens"):
        TLA("blocks.0", attention="blocks.*.attn")
    with pytest.raises(ValueError, match="^attention must name the attention modules"):
        TLA("input", attention=[])
    mix = TLA("blocks.2", attention=["blocks.0.attn", "blocks.1.attn"], tokens="auto")
    with (
        mix.attach(model),
        pytest.raises(RuntimeError, match=r"^TLA: no attention layer of attention=\('blocks.0.attn', "),
    ):
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    pooled = tiny_vit(global_pool="max", class_token=False)
    with pytest.raises(ValueError, match="^TLA: VisionTransformer pools its tokens with global_pool='max'"):
        TLA("input", attention="blocks.*.attn").attach(pooled)
    net = nn.Sequential(*(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True) for _ in range(2))).train()
    with pytest.raises(ValueError, match="^TLA: Sequential does not state which token its head reads"):
        TLA("0", attention="*.self_attn", tokens=(2, 2)).attach(net)
    mix = TLA("0", attention="*.self_attn", tokens=(2, 2), readout="class")
    with mix.attach(net):
        net(torch.randn(3, 5, 8))  # declared tokens: 1 leading token and a 2x2 grid
    assert mix.last.lam.shape == (3,) and mix.last.info["aligned"] == 1  # (layer 0's ran before the mix)
    registers = tiny_vit(class_token=False, reg_tokens=2, global_pool="avg")  # (two leading registers)
    with TLA("input", attention="blocks.*.attn", readout="class").attach(registers):
        with pytest.raises(
            ValueError, match=r"^TLA: .* has no class token \(its leading tokens are registers"
        ):
            registers(torch.randn(2, 3, 16, 16, dtype=torch.double))
    model.eval()
    with TLA("input", attention="blocks.*.attn").attach(model):
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))  # an eval forward: nothing mixed, no refusal


def test_under_activation_checkpointing_the_labels_and_gradients_are_a_plain_runs():
    """timm's grad checkpointing recomputes every block in backward: the labels are carried once, in the
    forward, and the loss and gradients equal the plain run's."""
    plain, checkpointed = tiny_vit(), tiny_vit()
    checkpointed.set_grad_checkpointing(True)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    criterion = nn.CrossEntropyLoss(reduction="none")
    found = []
    for model in (plain, checkpointed):
        mix = TLA("input", attention="blocks.*.attn")
        with mix.attach(model):
            mix.pin(box=(0, 3, 1, 3), index=[3, 2, 1, 0])
            mix.loss(criterion, model(x), y).mean().backward()
        found.append((mix.last, [p.grad for p in model.parameters()]))
    (a, grads_a), (b, grads_b) = found
    assert a.info["aligned"] == b.info["aligned"] == 3
    torch.testing.assert_close(a.lam, b.lam, rtol=0, atol=0)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)


def test_with_the_clean_batch_kept_the_labels_follow_the_mixed_rows():
    """clean=True doubles the batch before the attention layers: the labels are carried through the mixed
    rows' attention, as without the clean rows."""
    kept, alone = tiny_vit(), tiny_vit()
    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    found = []
    for model, clean in ((kept, True), (alone, False)):
        mix = TLA("input", attention="blocks.*.attn")
        mix.clean = clean
        with mix.attach(model):
            mix.pin(box=(1, 3, 0, 2), index=[3, 2, 1, 0])
            assert model(x).shape[0] == (8 if clean else 4)
        found.append(mix.last)
    assert found[0].lam.shape == (4,) and found[0].info["aligned"] == 3
    torch.testing.assert_close(found[0].lam, found[1].lam, rtol=1e-12, atol=1e-14)
