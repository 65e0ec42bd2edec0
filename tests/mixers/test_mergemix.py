"""MergeMix: the unmixed forward's scores, each image's top-k patches kept, the label weight, against the
authors' lines (OpenMixup's MergeMix classifier in its two modes, the LLaVA augmenter's reading), the
authors' whole step with its plain-mixup forward as a OneOf pinned twice, a block's tokens, per-sample
lams, torchvision's ViT, activation checkpointing, the refusals."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mixhook import ManifoldMixup, MergeMix, OneOf
from tests.helpers import assert_same_step, attending_vit


def mergemix(**kwargs):
    options = {"attention": "blocks.2.attn", **kwargs}
    return MergeMix(options.pop("layer", "input"), generator=torch.Generator().manual_seed(0), **options)


# From Westlake-AI/openmixup, openmixup/models/classifiers/mergemix.py: MergeMix.process_attention_map,
# MergeMix.maximum_saliency (rand_perm: the partners given, as its _no_repeat_shuffle_idx drew them) and
# MergeMix.ranking_mixup (attn_based "topk", and "tome" with no token merged: the source map the identity,
# token_unmerge_from_map's gather), `.cuda()` and the debug plot dropped; scale_factor: the patch side.
def process_attention_map(attn, top_k, attn_based="topk"):
    batch_size = attn.shape[0]
    flat_attn = attn[:, :, 0]
    _, indices = torch.topk(flat_attn, top_k, dim=1)
    flat_attn_ = torch.zeros_like(flat_attn)
    batch_indices = torch.arange(batch_size).unsqueeze(1).expand(-1, top_k)
    flat_attn_[batch_indices, indices] = 1
    return flat_attn_


def maximum_saliency(mask, index, scale_factor):
    results = dict()
    results["index"] = index
    lam_ = torch.sum(mask, dim=1).cpu().numpy() / mask.shape[-1]
    scale_token = int(math.sqrt(mask.shape[-1]))
    mask = mask.reshape(mask.shape[0], 1, scale_token, scale_token)
    mask_ups = F.interpolate(mask, scale_factor=scale_factor, mode="nearest")
    results["mask"] = torch.cat([mask_ups, 1 - mask_ups], dim=1)
    results["lam"] = lam_
    return results


def ranking_mixup(x, lam, feature, index, attn_based, scale_factor):
    results = dict()
    feature = torch.sum(feature, dim=1)  # multi-head -> single head
    if attn_based == "tome":
        source = torch.arange(feature.shape[1]).expand(feature.shape[0], -1)[:, 1:]  # (nothing merged)
        b_idx = torch.arange(feature.shape[0], dtype=torch.long)[:, None].expand(-1, source.shape[1])
        feature = feature[b_idx, source]  # token_unmerge_from_map
    else:
        feature = feature[:, 1:, 1:]
    retain_tokens = int(lam * feature.shape[1])
    mask = process_attention_map(feature, retain_tokens, attn_based=attn_based)
    mask = maximum_saliency(mask.to(x.dtype), index, scale_factor)
    results["img_mix"] = x * mask["mask"][:, 0, :, :].unsqueeze(1) + x[mask["index"], :] * mask["mask"][
        :, 1, :, :
    ].unsqueeze(1)
    results["index"] = mask["index"]
    return results, mask["lam"]


# From JinXins/MergeMix, LLaVA/llava/model/augment/augmenter.py: AugmentedImageProcess.forward's
# use_attn branch and use_mergemix (lam and the permutation given; vp: the patch side).
def augmenter_mergemix(img, attention, lam, index, vp):
    b, c, h, w = img.shape
    tokens_num = (h * w) // (vp * vp)
    attention = attention[:, :, 0, 1:]
    attention_sum = attention.sum(dim=1)
    num_zeros = int(attention_sum.shape[-1] * lam)
    indices = attention_sum.topk(num_zeros, dim=1).indices
    mask = torch.ones(b, tokens_num, dtype=img.dtype)
    mask.scatter_(1, indices, 0.0)
    mask = mask.view(b, 1, h // vp, w // vp)
    mask = F.interpolate(mask, scale_factor=vp, mode="nearest")
    return img * (1 - mask) + mask * img[index, :]


# From openmixup/models/heads/vision_transformer_head.py, VisionTransformerClsHead.lam_loss (not
# multi_label; its criterion a batch-mean cross-entropy, LabelSmoothLoss with smoothing 0 here).
def lam_loss(cls_score, y_a, y_b, lam):
    lam = torch.tensor(lam).view(-1, 1)
    return torch.mean(F.cross_entropy(cls_score, y_a) * lam + F.cross_entropy(cls_score, y_b) * (1 - lam))


# The attention of timm's last block as OpenMixup's ViT returns it (return_attn: the softmax weights per
# head, (B, heads, T, T)), from the block's norm1 input, on the unmixed batch.
def attention_of(vit, x, block=2):
    seen = {}
    handle = vit.blocks[block].attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    with torch.no_grad():
        vit(x)
    handle.remove()
    module, t = vit.blocks[block].attn, seen["x"]
    b, n, c = t.shape
    qkv = module.qkv(t).reshape(b, n, 3, module.num_heads, c // module.num_heads).permute(2, 0, 3, 1, 4)
    return ((qkv[0] @ qkv[1].transpose(-2, -1)) * module.scale).softmax(dim=-1)


def captured_input(model):
    seen = {}
    model.patch_embed.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach()))
    return seen


@pytest.mark.parametrize("score", ["to_class", "first_patch", "from_class"])
def test_the_mix_loss_and_gradients_equal_the_authors_lines(score):
    """The authors' classification code (attn_based "tome" with nothing merged: to_class; "topk":
    first_patch) and their LLaVA augmenter (from_class), on the same lam, partners and attention."""
    model, x, y = attending_vit(), torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    plain, seen = copy.deepcopy(model), captured_input(model)
    lam, index = 0.6, torch.tensor([2, 0, 3, 1])
    mix = mergemix(score=score)
    with mix.attach(model):
        mix.pin(lam=lam, index=index)
        loss = mix.loss(F.cross_entropy, model(x), y)
    loss.backward()
    attn = attention_of(plain, x)
    if score == "from_class":
        mixed, lams = augmenter_mergemix(x, attn, lam, index, 4), np.full(4, int(16 * lam) / 16)
    else:
        mode = "tome" if score == "to_class" else "topk"
        results, lams = ranking_mixup(x, lam, attn, index, mode, 4)
        mixed = results["img_mix"]
    expected = lam_loss(plain(mixed), y, y[index], lams)
    expected.backward()
    torch.testing.assert_close(seen["x"], mixed, rtol=0, atol=0)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    assert float(mix.last.lam) == 9 / 16 and mix.last.info["kept"].tolist() == [9] * 4
    assert not torch.equal(mixed, x) and not torch.equal(mixed, x[index])  # (both images in every mix)


def test_the_authors_step_with_its_plain_mixup_forward_is_a_oneof_pinned_twice():
    """forward_mix with switch_off < 0: the loss of a plain input mixup (alpha 0.8) forward plus
    MergeMix's, as two forwards of a OneOf pinned to each, their losses summed."""
    model, x, y = attending_vit(), torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    plain = copy.deepcopy(model)
    both = OneOf([mergemix(), ManifoldMixup("input", alpha=0.8)])
    base_lam, base_index, lam, index = 0.3, torch.tensor([1, 2, 3, 0]), 0.45, torch.tensor([3, 2, 1, 0])
    with both.attach(model):
        both.pin(choice=1, lam=base_lam, index=base_index)
        base = both.loss(F.cross_entropy, model(x), y)
        both.pin(choice=0, lam=lam, index=index)
        merged = both.loss(F.cross_entropy, model(x), y)
    (base + merged).backward()
    # the authors' forward_train and forward_mix (alpha 0.8's mixup: openmixup/models/augments/mixup.py)
    attn = attention_of(plain, x)
    results, lams = ranking_mixup(x, lam, attn, index, "tome", 4)
    img = base_lam * x + (1 - base_lam) * x[base_index]
    pred_base = plain(img)
    loss_base = F.cross_entropy(pred_base, y) * base_lam + F.cross_entropy(pred_base, y[base_index]) * (
        1 - base_lam
    )
    loss_mix = lam_loss(plain(results["img_mix"]), y, y[index], lams)
    (loss_base + loss_mix).backward()
    torch.testing.assert_close(base + merged, loss_base + loss_mix, rtol=1e-12, atol=1e-13)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_each_image_keeps_its_top_patches_and_per_sample_lams_keep_their_own_count():
    model, x = attending_vit(), torch.randn(5, 3, 16, 16, dtype=torch.double)
    seen, mix = captured_input(model), mergemix()
    with mix.attach(model):
        for step in range(4):
            if step == 3:
                mix.pin(lam=[0.0, 0.1, 0.5, 0.99, 1.0])
            model(x)
            last, mixed = mix.last, seen["x"]
            kept, scores = last.info["kept"], last.info["scores"]
            if step == 3:
                assert kept.tolist() == [0, 1, 8, 15, 16]
            torch.testing.assert_close(
                torch.as_tensor(last.lam, dtype=torch.float64).expand(5), kept.double() / 16
            )
            for i in range(5):
                j, top = int(last.index[i]), set(scores[i].argsort(descending=True)[: int(kept[i])].tolist())
                for p in range(16):
                    r, c = divmod(p, 4)
                    cell = mixed[i, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4]
                    source = x[i] if p in top else x[j]
                    torch.testing.assert_close(cell, source[:, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4])
            own = last.weights  # (the dense targets' own-content weights: the kept patches' pixels)
            assert own.shape == (5, 16, 16) and int(own[0].sum()) == int(kept[0]) * 16


def test_on_a_blocks_tokens_the_top_tokens_are_kept_and_the_class_token_blended():
    model, x, y = attending_vit(), torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    plain = copy.deepcopy(model)
    mix = mergemix(layer="blocks.0", tokens="auto", attention="blocks.1.attn")
    index = torch.tensor([1, 2, 3, 0])
    with mix.attach(model):
        mix.pin(lam=0.7, index=index)
        loss = mix.loss(F.cross_entropy, model(x), y)
    loss.backward()
    scores = attention_of(plain, x, block=1).mean(1)[:, 1:, 0]  # (to_class: each patch's to the class)
    top = scores.argsort(1, descending=True)[:, :11]
    t = plain.blocks[0](plain._pos_embed(plain.patch_embed(x)))
    own = torch.zeros(4, 16, dtype=torch.bool).scatter_(1, top, True)
    patches = torch.where(own[..., None], t[:, 1:], t[index, 1:])
    lam = 11 / 16
    cls = lam * t[:, :1] + (1 - lam) * t[index, :1]
    logits = plain.forward_head(plain.norm(plain.blocks[2](plain.blocks[1](torch.cat([cls, patches], 1)))))
    expected = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_pinned_scores_skip_the_unmixed_forward():
    model, x = attending_vit(), torch.randn(2, 3, 16, 16, dtype=torch.double)
    calls = []
    model.blocks[2].attn.register_forward_pre_hook(lambda m, a: calls.append(1))
    scores = torch.arange(32, dtype=torch.double).view(2, 16)
    seen, mix = captured_input(model), mergemix()
    with mix.attach(model):
        mix.pin(scores=scores, lam=0.25, index=[1, 0])
        model(x)
    assert len(calls) == 1  # (the mixed forward's alone)
    assert mix.last.info["kept"].tolist() == [4, 4]
    torch.testing.assert_close(seen["x"][:, :, 12:, :], x[:, :, 12:, :])  # (the last row's 4 patches)
    torch.testing.assert_close(seen["x"][:, :, :12, :], x[[1, 0], :, :12, :])


def test_under_activation_checkpointing_the_loss_and_gradients_are_a_plain_runs():
    plain, checkpointed = attending_vit(), attending_vit()
    checkpointed.set_grad_checkpointing(True)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    found = []
    for model in (plain, checkpointed):
        mix = mergemix()
        with mix.attach(model):
            mix.pin(lam=0.4, index=[3, 2, 1, 0])
            loss = mix.loss(F.cross_entropy, model(x), y)
            loss.backward()
        found.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert_same_step(*found)


def test_torchvision_vit_scores_its_multihead_attention():
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=12, mlp_dim=24, num_classes=3
    ).double().train()  # fmt: skip
    layer = model.encoder.layers.encoder_layer_1.self_attention
    seen = []
    layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    mix = MergeMix("input", "encoder.layers.encoder_layer_1.self_attention")
    with mix.attach(model):
        mix.pin(lam=0.5, index=[1, 0])
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    assert len(seen) == 3  # the unmixed forward, its read of the weights, the mixed forward
    model.eval()
    with torch.no_grad():
        _, weights = layer(seen[0], seen[0], seen[0], need_weights=True)
    torch.testing.assert_close(mix.last.info["scores"], weights[:, 1:, 0], rtol=1e-12, atol=1e-14)


def test_refusals_are_one_line():
    model = attending_vit()
    with pytest.raises(TypeError, match="^MergeMix: attention='blocks.2.mlp' is a Mlp, not an attention"):
        mergemix(attention="blocks.2.mlp").attach(model)
    with pytest.raises(ValueError, match="^MergeMix at 'blocks.0': it keeps a ViT's most attended patches"):
        mergemix(layer="blocks.0")
    with pytest.raises(ValueError, match="^score must be one of to_class, from_class, patches, first_patch"):
        mergemix(score="cls")
    pooled, x = attending_vit(class_token=False, global_pool="avg"), torch.randn(2, 3, 16, 16).double()
    mix = mergemix()
    with mix.attach(pooled):
        refused = (
            r"^MergeMix: .* has no class token \(it attends over patches alone\), and .*'patches'; train"
        )
        with pytest.raises(ValueError, match=refused):
            pooled(x)
    with mergemix(score="patches").attach(pooled):
        pooled(x)  # (the patches' attention: no class token needed)
    mix = mergemix()
    with mix.attach(model):
        mix.pin(scores=torch.zeros(2, 9))
        with pytest.raises(ValueError, match=r"^MergeMix: the scores are \(2, 9\), the mixed map has 2 "):
            model(x)
    mix = mergemix()
    with mix.attach(model):
        mix.pin(scores=torch.zeros(2, 16))  # (timm's patch embedding would refuse it after the mix)
        with pytest.raises(ValueError, match="^MergeMix at 'input': the 14x14 input is not a whole number"):
            model(torch.randn(2, 3, 14, 14).double())


def test_the_authors_lam_draw_is_beta_alpha_alpha():
    """One lam per batch from Beta(alpha, alpha) (alpha 0.5: spread towards 0 and 1), a whole number of
    patches kept."""
    model, x = attending_vit(), torch.randn(2, 3, 16, 16, dtype=torch.double)
    mix = mergemix(alpha=0.5)
    with mix.attach(model):
        shares = []
        for _ in range(40):
            mix.pin(scores=torch.rand(2, 16, dtype=torch.double))
            model(x)
            shares.append(float(mix.last.lam))
    assert float(np.std(shares)) > 0.2 and all(s in {k / 16 for k in range(17)} for s in shares)


def test_with_the_clean_batch_kept_the_mixed_rows_are_the_mix_alone():
    """clean=True: the scores come from the unmixed forward of the B samples, and the logits' mixed rows
    equal a forward without the clean rows on the same draws (the clean rows: the unmixed batch's)."""
    x, index = torch.randn(4, 3, 16, 16, dtype=torch.double), [3, 2, 1, 0]
    found = []
    for clean in (True, False):
        model, mix = attending_vit(), mergemix()
        mix.clean = clean
        with mix.attach(model):
            mix.pin(lam=0.55, index=index)
            found.append((model(x).detach(), mix.last))
        plain = model.eval()(x).detach()
    (doubled, kept), (alone, last) = found
    assert doubled.shape[0] == 8 and kept.clean and kept.info["kept"].tolist() == [8] * 4
    torch.testing.assert_close(doubled[4:], alone, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(doubled[:4], plain, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(kept.info["scores"], last.info["scores"], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["MergeMix", "TransMix", "SMMix"])
def test_registers_without_a_class_token_are_not_read_as_one(name):
    """timm's class_token=False with two registers: two leading tokens, none of them a class token; a
    method that reads the class token's attention refuses in one line (it read register 0's)."""
    import mixhook

    model = attending_vit(class_token=False, reg_tokens=2, global_pool="avg")
    options = {"MergeMix": {}, "TransMix": {}, "SMMix": {"features": "norm", "classifier": "head"}}[name]
    extra = {"score": "class"} if name == "SMMix" else {}
    mix = getattr(mixhook, name)("input", attention="blocks.2.attn", **options, **extra)
    with mix.attach(model):
        with pytest.raises(
            ValueError, match=rf"^{name}: .* has no class token \(its leading tokens are registers"
        ):
            model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    with mergemix(score="patches").attach(model):
        model(
            torch.randn(2, 3, 16, 16, dtype=torch.double)
        )  # (the patches' attention: the registers left out)


def test_a_huggingface_vit_on_a_larger_input_is_refused_not_read_on_the_wrong_tokens():
    """A HuggingFace ViT states its grid at config.image_size; with interpolate_pos_encoding on a larger
    input its attention has more tokens: refused in one line (the leading-token count it states, one class
    token, does not fit), where the extra tokens had been taken for leading ones."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=16, patch_size=4, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, num_labels=3, attn_implementation="eager",
    )  # fmt: skip
    model = ViTForImageClassification(config).double().train()
    mix = MergeMix("input", "vit.layers.1.attention")
    with mix.attach(model):
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))  # (at its size: read)
        assert mix.last.info["scores"].shape == (2, 16)
        with pytest.raises(
            ValueError, match=r"has 65 tokens, which do not fit the model's 4x4 patches and 1 "
        ):
            model(torch.randn(2, 3, 32, 32, dtype=torch.double), interpolate_pos_encoding=True)


@pytest.mark.parametrize("score", ["to_class", "from_class", "patches", "first_patch"])
def test_behind_a_class_token_and_registers_each_score_reads_the_patches(score):
    """timm's ViT with a class token and two registers (three leading tokens): each score reads the patch
    tokens' rows or columns, and the class token's, never a register's."""
    model = attending_vit(reg_tokens=2)
    x = torch.randn(2, 3, 16, 16, dtype=torch.double)
    mix = mergemix(score=score)
    with mix.attach(model):
        mix.pin(lam=0.5, index=[1, 0])
        model(x)
    a = attention_of(copy.deepcopy(model).eval(), x).mean(1)  # (B, 19, 19): class, 2 registers, 16 patches
    expected = {
        "to_class": a[:, 3:, 0], "from_class": a[:, 0, 3:], "patches": a[:, 3:, 3:].mean(1),
        "first_patch": a[:, 3:, 3],
    }[score]  # fmt: skip
    torch.testing.assert_close(mix.last.info["scores"], expected, rtol=1e-12, atol=1e-14)


def test_on_a_grid_of_more_rows_than_columns_the_scores_map_row_major():
    """A 16x8 image of 4-pixel patches (a 4x2 grid): patch p is row p // 2, column p % 2."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=(16, 8), patch_size=4, embed_dim=12,
        depth=2, num_heads=2,
    ).double().train()  # fmt: skip
    seen, x = captured_input(model), torch.randn(2, 3, 16, 8, dtype=torch.double)
    scores = torch.tensor([[7.0, 6, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.double)
    mix = MergeMix("input", "blocks.1.attn")
    with mix.attach(model):
        mix.pin(scores=scores, lam=0.5, index=[1, 0])
        model(x)
    mixed = seen["x"]
    torch.testing.assert_close(mixed[0, :, :8], x[0, :, :8])  # (its top 4: patches 0-3, the first two rows)
    torch.testing.assert_close(mixed[0, :, 8:], x[1, :, 8:])
    torch.testing.assert_close(mixed[1, :, 8:], x[1, :, 8:])  # (its top 4: patches 4-7, the last two rows)
    torch.testing.assert_close(mixed[1, :, :8], x[0, :, :8])


def test_on_a_blocks_tokens_under_activation_checkpointing_with_per_sample_lams():
    """The mix on a checkpointed block's output (recomputed in backward from the pinned scores and draws):
    loss and gradients equal a plain run's; per-sample lams keep their own counts."""
    plain, checkpointed = attending_vit(), attending_vit()
    checkpointed.set_grad_checkpointing(True)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    found = []
    for model in (plain, checkpointed):
        mix = mergemix(layer="blocks.1", tokens="auto")
        with mix.attach(model):
            mix.pin(lam=[0.2, 0.5, 0.7, 1.0], index=[3, 2, 1, 0])
            loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), model(x), y).mean()
            loss.backward()
        found.append((loss.detach(), [p.grad for p in model.parameters()], mix.last))
    (a, grads_a, last), (b, grads_b, _) = found
    assert last.info["kept"].tolist() == [3, 8, 11, 16]
    torch.testing.assert_close(last.lam, torch.tensor([3, 8, 11, 16], dtype=torch.double) / 16)
    assert_same_step((a, grads_a), (b, grads_b))
