"""SMMix: the motivating forward's scores, the moved windows, the three-term loss and the gradients of the
model and of the token head against the authors' lines on the same window side and partners (timm's ViT),
a block's tokens, OpenMixup's class-token score, the shared head, the refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import SMMix
from tests.helpers import assert_same_step, attending_vit


def tiny_vit():
    """:func:`~tests.helpers.attending_vit` with a head far from timm's zeros (its logits then tell the
    samples apart: the consistency term's targets)."""
    model = attending_vit()
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
    return model


def smmix(**kwargs):
    options = {"attention": "blocks.2.attn", "features": "norm", "classifier": "head", **kwargs}
    return SMMix(options.pop("layer", "input"), generator=torch.Generator().manual_seed(0), **options)


# From ChenMnZ/SMMix, smmix.py: mixup_target (one_hot's values in float64 here, the check being in float64),
# batch_index_generate, SMMix.smmix and SMMix.index_translate (as functions of `side`; `.cuda()` dropped).
def one_hot(x, num_classes, on_value=1.0, off_value=0.0):
    x = x.long().view(-1, 1)
    return torch.full((x.size()[0], num_classes), off_value, dtype=torch.float64).scatter_(1, x, on_value)


def mixup_target(target, num_classes, lam=1.0, smoothing=0.0):
    off_value = smoothing / num_classes
    on_value = 1.0 - smoothing + off_value
    y1 = one_hot(target, num_classes, on_value=on_value, off_value=off_value)
    y2 = one_hot(target.flip(0), num_classes, on_value=on_value, off_value=off_value)
    mixed_target = y1 * lam + y2 * (1.0 - lam)
    return mixed_target, y1, y2


def batch_index_generate(x, idx):
    B, N, C = x.size()
    offset = torch.arange(B, dtype=torch.long, device=x.device).view(B, 1) * N
    idx = idx + offset
    return idx.reshape(-1)


def index_translate(rectangle_index, rectangle_size=(3, 3), token_size=(7, 7)):
    total_index = torch.arange(token_size[0] * token_size[1]).reshape(1, 1, token_size[0], token_size[1])
    total_index_list = F.unfold(total_index.float(), rectangle_size, stride=1).transpose(1, 2).long()
    sequence_index = total_index_list.index_select(dim=1, index=rectangle_index).squeeze(0)
    return sequence_index


def reference_smmix(side, inputs, attn, rectangle_size):
    inputs_side = inputs.shape[2]
    patch_size = inputs_side // side
    inputs = F.unfold(inputs, patch_size, stride=patch_size).transpose(1, 2)
    source_image = inputs.flip(0)
    attn = attn.reshape(-1, side, side).unsqueeze(1)
    rectangle_attn = F.unfold(attn, rectangle_size, stride=1)
    rectangle_attn = rectangle_attn.sum(dim=1)
    min_region_center_index = torch.argmin(rectangle_attn, dim=1)
    max_region_center_index = torch.argmax(rectangle_attn, dim=1)
    min_region_index = index_translate(min_region_center_index, rectangle_size, token_size=(side, side))
    max_region_index = index_translate(max_region_center_index, rectangle_size, token_size=(side, side))
    min_region_index = batch_index_generate(inputs, min_region_index)
    max_region_index = batch_index_generate(inputs, max_region_index.flip(0))
    B, N, C = inputs.shape
    inputs = inputs.reshape(B * N, C)
    source_image = source_image.reshape(B * N, C)
    inputs[min_region_index] = source_image[max_region_index]
    inputs = inputs.reshape(B, N, C)
    inputs = F.fold(inputs.transpose(1, 2), inputs_side, patch_size, stride=patch_size)
    source_mask = torch.zeros_like(attn).bool()
    source_mask = source_mask.reshape(-1)
    source_mask[min_region_index] = True
    source_mask = source_mask.reshape(B, N)
    target_mask = ~source_mask
    return inputs, target_mask, source_mask


# From ChenMnZ/SMMix, deit.py: Attention.forward's attn_softmax and VisionTransformer.forward's score,
# on timm's modules (the last block's attention on its norm1 input), in eval mode without gradients.
def reference_motivation(vit, x, last=2):
    seen = {}
    handle = vit.blocks[last].attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    vit.eval()
    with torch.no_grad():
        logits = vit(x)
        attn_module, t = vit.blocks[last].attn, seen["x"]
        B, N, C = t.shape
        qkv = attn_module.qkv(t).reshape(B, N, 3, attn_module.num_heads, C // attn_module.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * attn_module.scale).softmax(dim=-1)
    vit.train()
    handle.remove()
    return logits, attn


def soft_ce(logits, target):  # timm's SoftTargetCrossEntropy
    return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()


@pytest.mark.parametrize("score", ["patches", "class"])
def test_the_loss_and_gradients_equal_the_authors_on_the_same_window_side(score):
    model, x, y = tiny_vit(), torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    plain = copy.deepcopy(model)
    mix, smoothing, side = smmix(score=score), 0.1, 2
    criterion = nn.CrossEntropyLoss(reduction="none", label_smoothing=smoothing)
    with mix.attach(model):
        head = copy.deepcopy(mix.head)
        mix.pin(side=side, index=torch.arange(3, -1, -1))
        loss = mix.loss(criterion, model(x), y).mean()
    loss.backward()
    # the authors' step (engine.py's train_one_epoch, the SMMix branch)
    motivation, attn = reference_motivation(plain, x)
    attn = attn[:, :, 1:, 1:].mean(dim=(1, 2)) if score == "patches" else attn[:, :, 0, 1:].mean(1)
    mixed, target_mask, source_mask = reference_smmix(4, x.clone(), attn, (side, side))
    lam = (16 - side * side) / 16
    mixed_target, target_target, source_target = mixup_target(y, 3, lam, smoothing)
    mixed_prediction = lam * motivation + (1 - lam) * motivation.flip(0)
    tokens = plain.forward_features(mixed)
    outputs, image_token = plain.forward_head(tokens), tokens[:, 1:]
    target_result = head((image_token * target_mask.unsqueeze(-1)).sum(1) / target_mask.sum(1, keepdim=True))
    source_result = head((image_token * source_mask.unsqueeze(-1)).sum(1) / source_mask.sum(1, keepdim=True))
    loss_cls = soft_ce(outputs, mixed_target)
    loss_fine = 1 / 2 * (soft_ce(target_result, target_target) + soft_ce(source_result, source_target))
    kl = nn.KLDivLoss(reduction="batchmean")(
        F.log_softmax(outputs, dim=1), F.softmax(mixed_prediction, dim=1)
    )
    expected = loss_cls + loss_fine + kl
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    for a, b in zip(mix.head.parameters(), head.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert mix.last.info["side"] == side and float(mix.last.lam) == lam
    assert not torch.equal(mixed, x)  # (a mix that moved nothing would pass the rest)
    assert mix.last.loss_inputs is None  # (the tokens and their graph went with the output, not kept)


def test_the_moved_windows_are_the_partners_most_scored_ones():
    """Drawn sides: each sample's least scored window holds its partner's most scored window's patches."""
    model, x = tiny_vit(), torch.randn(5, 3, 16, 16, dtype=torch.double)
    mix = smmix()
    seen = {}
    model.patch_embed.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].detach()))
    with mix.attach(model):
        for _ in range(4):
            model(x)
            last, (mixed,) = mix.last, (seen["x"],)
            s = last.info["side"]
            assert 1 <= s <= 3 and float(last.lam) == 1 - s * s / 16
            sums = F.avg_pool2d(last.info["scores"].view(5, 1, 4, 4), s, stride=1).flatten(1)
            for i in range(5):
                j = int(last.index[i])
                (ty, tx), (sy, sx) = last.info["target"][i].tolist(), last.info["source"][i].tolist()
                assert sums[i].argmin() == ty * (5 - s) + tx and sums[j].argmax() == sy * (5 - s) + sx
                got = mixed[i, :, 4 * ty : 4 * (ty + s), 4 * tx : 4 * (tx + s)]
                torch.testing.assert_close(got, x[j, :, 4 * sy : 4 * (sy + s), 4 * sx : 4 * (sx + s)])


def test_on_a_blocks_tokens_the_windows_move_tokens_and_a_shared_head_trains_the_classifier():
    model, x, y = tiny_vit(), torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    plain = copy.deepcopy(model)
    mix = smmix(layer="blocks.0", tokens="auto", token_head="shared")
    with mix.attach(model):
        assert list(mix.parameters()) == []
        mix.pin(side=3, index=[1, 2, 3, 0])
        loss = mix.loss(F.cross_entropy, model(x), y)
    loss.backward()
    motivation, attn = reference_motivation(plain, x)
    scores = attn[:, :, 1:, 1:].mean(dim=(1, 2)).view(4, 4, 4)
    index = torch.tensor([1, 2, 3, 0])
    sums = F.avg_pool2d(scores[:, None], 3, stride=1).flatten(1)  # (4 windows of 3x3 on the 4x4 grid)
    low, high = sums.argmin(1), sums.argmax(1)[index]
    t = plain.blocks[0](plain._pos_embed(plain.patch_embed(x)))
    grid = t[:, 1:].reshape(4, 4, 4, -1).clone()
    pasted = torch.zeros(4, 4, 4, dtype=torch.bool)
    for i in range(4):
        ty, tx, sy, sx = low[i] // 2, low[i] % 2, high[i] // 2, high[i] % 2
        grid[i, ty : ty + 3, tx : tx + 3] = t[index[i], 1:].reshape(4, 4, -1)[sy : sy + 3, sx : sx + 3]
        pasted[i, ty : ty + 3, tx : tx + 3] = True
    lam = 1 - 9 / 16
    cls = lam * t[:, :1] + (1 - lam) * t[index, :1]  # (prefix="blend": the class token by lam)
    tokens = plain.norm(plain.blocks[2](plain.blocks[1](torch.cat([cls, grid.flatten(1, 2)], 1))))
    logits, patches, pasted = plain.forward_head(tokens), tokens[:, 1:], pasted.flatten(1).double()
    own = plain.head((patches * (1 - pasted)[..., None]).sum(1) / (1 - pasted).sum(1, keepdim=True))
    theirs = plain.head((patches * pasted[..., None]).sum(1) / pasted.sum(1, keepdim=True))
    wanted = F.softmax(lam * motivation + (1 - lam) * motivation[index], 1)
    expected = (
        lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])
        + (F.cross_entropy(own, y) + F.cross_entropy(theirs, y[index])) / 2
        + F.kl_div(F.log_softmax(logits, 1), wanted, reduction="batchmean")
    )  # fmt: skip
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_token_head_is_saved_and_loaded_and_is_the_same_in_every_workflow():
    a, b = smmix(), smmix()
    with a.attach(tiny_vit()):
        with torch.no_grad():
            a.head.weight.add_(1.0)
        state = a.state_dict()
    with b.attach(tiny_vit()):
        fresh = b.head.weight.clone()
    late = smmix()
    late.load_state_dict(state)  # (before attach: loaded when the head is made)
    with late.attach(tiny_vit()):
        torch.testing.assert_close(late.head.weight, a.head.weight, rtol=0, atol=0)
    torch.testing.assert_close(fresh, a.head.weight - 1, rtol=0, atol=0)  # (made from the mixer's seed)


def test_refusals_are_one_line():
    model = tiny_vit()
    with pytest.raises(TypeError, match="^SMMix: classifier='norm' is a LayerNorm, not the Linear"):
        smmix(classifier="norm").attach(model)
    with pytest.raises(TypeError, match="^SMMix: attention='blocks.2.mlp' is a Mlp, not an attention"):
        smmix(attention="blocks.2.mlp").attach(model)
    with pytest.raises(ValueError, match="^SMMix at 'blocks.0': it moves windows of a ViT's patches"):
        smmix(layer="blocks.0")
    with pytest.raises(ValueError, match="^score must be one of patches, class, got 'cls'$"):
        smmix(score="cls")
    with pytest.raises(ValueError, match="^min_side and max_side must satisfy"):
        smmix(min_side=0.8, max_side=0.5)
    with pytest.raises(RuntimeError, match="^SMMix: the token head is made at attach"):
        list(smmix().parameters())
    doubled = smmix()
    doubled.clean = True
    with pytest.raises(ValueError, match="^SMMix trains on its mix alone .*; leave clean=False$"):
        doubled.attach(model)
    mix = smmix(features="blocks.0")  # (a block before the mixed input's tokens: it runs after the mix)
    with mix.attach(model):
        mix.pin(side=5)
        with pytest.raises(ValueError, match=r"^pinned side 5 does not fit the 4x4 patch grid \(1..4\)$"):
            model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    mix = smmix()
    with mix.attach(model):
        logits = model(torch.randn(2, 3, 16, 16, dtype=torch.double))
        with pytest.raises(ValueError, match=r"^targets\(\): SMMix trains with a token head's"):
            mix.targets(torch.tensor([0, 1]), 3)
        mix.loss(F.cross_entropy, logits, torch.tensor([0, 1]))


def test_under_activation_checkpointing_the_loss_and_gradients_are_a_plain_runs():
    """timm's grad checkpointing recomputes every block in backward: the motivating forward runs once, the
    final norm's tokens are the forward's, and the loss and gradients equal the plain run's."""
    plain, checkpointed = tiny_vit(), tiny_vit()
    checkpointed.set_grad_checkpointing(True)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    found = []
    for model in (plain, checkpointed):
        mix = smmix()
        with mix.attach(model):
            mix.pin(side=2, index=[3, 2, 1, 0])
            loss = mix.loss(F.cross_entropy, model(x), y)
            loss.backward()
        found.append((loss.detach(), [p.grad for p in [*model.parameters(), *mix.head.parameters()]]))
    assert_same_step(*found)


def test_torchvision_vit_scores_its_multihead_attention_once():
    """torchvision's nn.MultiheadAttention is called again to read its weights: once, and the scores are
    its weights (eval mode) on the motivating forward's input to it."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=12, mlp_dim=24, num_classes=3
    ).double().train()  # fmt: skip
    layer = model.encoder.layers.encoder_layer_1.self_attention
    seen = []
    layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    mix = SMMix("input", "encoder.layers.encoder_layer_1.self_attention", "encoder.ln", "heads.head")
    with mix.attach(model):
        mix.pin(side=2, index=[1, 0])
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    assert len(seen) == 3  # the motivating forward, its read of the weights, the mixed forward
    model.eval()
    with torch.no_grad():
        _, weights = layer(seen[0], seen[0], seen[0], need_weights=True)
    torch.testing.assert_close(mix.last.info["scores"], weights[:, 1:, 1:].mean(1), rtol=1e-12, atol=1e-14)
