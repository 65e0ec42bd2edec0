"""GuidedMixup: the pairing, the mix and the soft targets against the authors' lines on the same saliency,
the gradient saliency as a hand-split forward with gradients (float64), activation saliency at a hidden
map, checkpoint replay, the zero-saliency guard and the refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import GuidedMixup
from mixhook.engine.saliency import gaussian_blur
from tests.guidedmixup_reference import distance_function, onecycle_cover
from tests.helpers import SmallCNN, gen, per_sample_ce

tv_functional = pytest.importorskip("torchvision.transforms.functional")


# From 3neutronstar/GuidedMixup (2a09e97): the guided branch of mixup.py's mixup_process /
# FGVC/Implementor/guidedmixup.py's _train (blur, 'sumto1', pairing, 'saliency_label'), with `grad` the
# saliency passed in and `mask_a` stacked over the map's channels instead of 3 (their pairing:
# tests/guidedmixup_reference.py).
def guided_mixup_process(out, target_reweighted, grad):
    sc_a = grad
    sc_a = tv_functional.gaussian_blur(sc_a, (7, 7), (3, 3))
    sc_a /= (sc_a).sum(dim=[-1, -2], keepdim=True)
    indices = onecycle_cover(distance_function(sc_a.detach(), sc_a.detach()).cpu().numpy())
    out_b = out[indices]
    sc_b = sc_a[indices]
    norm_sc_a = torch.div(sc_a, (sc_a + sc_b).detach())
    norm_sc_b = torch.div(sc_b, (sc_a + sc_b).detach())
    lam_a = norm_sc_a.mean(dim=[1, 2])
    lam_b = norm_sc_b.mean(dim=[1, 2])
    mask_a = torch.stack([norm_sc_a] * out.shape[1], dim=1)
    mask_b = torch.stack([norm_sc_b] * out.shape[1], dim=1)
    out = mask_a * out + mask_b * out_b
    target_shuffled_onehot = target_reweighted[indices]
    target_reweighted = target_reweighted * lam_a.unsqueeze(-1) + target_shuffled_onehot * lam_b.unsqueeze(-1)
    return out, target_reweighted, torch.as_tensor(indices, dtype=torch.int64), lam_a


def test_the_mix_pairs_and_targets_are_the_authors_on_the_same_saliency_with_gradients():
    """At the input with a pinned saliency map: the greedy pairs, the mixed images, the label weights and
    the soft-target cross-entropy's value and parameter gradients, in float64."""
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    by_hand = copy.deepcopy(model)
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    for trial in range(5):
        x = torch.randn(10, 3, 12, 12, dtype=torch.float64)
        y = torch.randint(0, 5, (10,))
        saliency = torch.rand(10, 12, 12, dtype=torch.float64, generator=gen(trial)) ** 4
        mix = GuidedMixup("input", generator=gen(trial))
        with mix.attach(model):
            mix.pin(saliency=saliency)
            logits = model(x)
            loss = mix.loss(per_sample_ce, logits, y).mean()
        expected_x, soft, indices, lam_a = guided_mixup_process(x, F.one_hot(y, 5).double(), saliency.clone())
        assert mix.last.index.tolist() == indices.tolist() and sorted(indices.tolist()) == list(range(10))
        torch.testing.assert_close(seen["x"], expected_x, rtol=0, atol=1e-14)
        torch.testing.assert_close(mix.last.lam, lam_a, rtol=0, atol=1e-14)
        theirs = -(soft * F.log_softmax(by_hand(expected_x), 1)).sum(1).mean()  # soft-target CE
        torch.testing.assert_close(loss, theirs, rtol=1e-12, atol=0)
        model.zero_grad(), by_hand.zero_grad()
        loss.backward(), theirs.backward()
        for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-13, msg=name)
        assert not torch.allclose(logits, model(x))  # (it changed the forward)


class Net(nn.Module):
    """stem - block (the mixed map) - tanh - head, in float64; ``ckpt`` checkpoints the block."""

    def __init__(self, ckpt=False):
        super().__init__()
        torch.manual_seed(0)
        self.ckpt = ckpt
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.block = nn.Conv2d(6, 6, 3, padding=1)
        self.head = nn.Linear(6 * 8 * 8, 4)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        h = checkpoint(self.block, h, use_reentrant=False) if self.ckpt else self.block(h)
        return self.head(torch.tanh(h).flatten(1))


def test_gradient_saliency_at_a_hidden_map_is_a_hand_split_forward_with_gradients():
    """The saliency is sqrt(mean_c g²) of the summed cross-entropy's gradient at the block's output (eval
    mode, no parameter gradient left); the pairs, the blend and the loss's gradients as by hand."""
    model, by_hand = Net(), Net()
    x, y = torch.randn(8, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    mix = GuidedMixup("block", generator=gen())
    with mix.attach(model):
        mix.use_targets(y)
        logits = model(x)
        assert all(p.grad is None for p in model.parameters())
        mix.loss(per_sample_ce, logits, y).mean().backward()
    m = by_hand
    h = m.block(torch.tanh(m.stem(x))).detach().requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(m.head(torch.tanh(h).flatten(1)), y, reduction="sum"), [h])
    saliency = g.square().mean(1).sqrt()
    torch.testing.assert_close(mix.last.info["saliency"], saliency, rtol=1e-12, atol=0)
    h = m.block(torch.tanh(m.stem(x)))
    mixed, soft, index, _ = guided_mixup_process(h, F.one_hot(y, 4).double(), saliency.clone())
    assert mix.last.index.tolist() == index.tolist()
    expected = m.head(torch.tanh(mixed).flatten(1))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-13)
    (-(soft * F.log_softmax(expected, 1)).sum(1).mean()).backward()
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-13, msg=name)


def test_activation_saliency_and_random_pairs_blend_a_hidden_map_by_the_saliency_ratio():
    model = Net()
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    mix = GuidedMixup("block", saliency="activation", pairing="random", blur=0, generator=gen(3))
    with mix.attach(model):
        logits = model(x)
    index = mix.last.index
    assert index.tolist() == torch.randperm(6, generator=gen(3)).tolist()  # (the generator's first draw)
    h = model.block(torch.tanh(model.stem(x))).detach()
    s = h.abs().mean(1)
    s = s / s.sum((1, 2), keepdim=True)
    w = s / (s + s[index])
    torch.testing.assert_close(mix.last.info["weights"], w, rtol=0, atol=1e-15)
    torch.testing.assert_close(mix.last.lam, w.mean((1, 2)), rtol=0, atol=1e-15)
    expected = model.head(torch.tanh(w[:, None] * h + (1 - w[:, None]) * h[index]).flatten(1))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-13)


def test_a_checkpointed_mix_replays_the_same_pairs_and_gradients():
    """The checkpointed block is recomputed in backward: the same saliency, pairs and gradients as without
    checkpointing (neither the gradient pass nor the pairing runs again)."""
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 1])
    grads = []
    for ckpt in (False, True):
        model = Net(ckpt)
        mix = GuidedMixup("block", generator=gen())
        with mix.attach(model):
            mix.use_targets(y)
            mix.loss(per_sample_ce, model(x), y).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_positions_where_both_maps_are_zero_take_half_of_each():
    model = SmallCNN().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    x = torch.randn(2, 3, 6, 6)
    saliency = torch.zeros(2, 6, 6)
    saliency[0, 0, 0], saliency[1, 0, 1] = 1.0, 1.0
    mix = GuidedMixup("input", blur=0)
    with mix.attach(model):
        mix.pin(saliency=saliency, index=[1, 0])
        model(x)
    w = torch.full((6, 6), 0.5)
    w[0, 0], w[0, 1] = 1.0, 0.0
    torch.testing.assert_close(seen["x"][0], w * x[0] + (1 - w) * x[1])
    assert torch.isfinite(mix.last.lam).all() and mix.last.lam.tolist() == [0.5, 0.5]


def test_the_blur_is_torchvisions_on_maps_of_any_size():
    maps = torch.rand(3, 9, 7, dtype=torch.float64)
    theirs = tv_functional.gaussian_blur(maps, [7, 7], [3.0, 3.0])
    torch.testing.assert_close(gaussian_blur(maps, 7, 3.0), theirs)


def test_bad_settings_and_values_are_refused_in_one_line():
    with pytest.raises(ValueError, match="pairing must be one of greedy, random, got 'best'"):
        GuidedMixup("input", pairing="best")
    with pytest.raises(ValueError, match=r"blur must be a kernel size >= 0 \(0: no blur\), got -1"):
        GuidedMixup("input", blur=-1)
    with pytest.raises(ValueError, match="saliency='gradient' there"):
        GuidedMixup("input", saliency="activation")
    with pytest.raises(TypeError, match=r"GuidedMixup.pin\(lam=...\): GuidedMixup draws no lam"):
        GuidedMixup("input").pin(lam=0.3)
    model = SmallCNN()
    with pytest.raises(TypeError, match="GuidedMixup at 'head' needs a \\(B, C, H, W\\) map"):
        with GuidedMixup("head", saliency="activation").attach(model):
            model(torch.randn(2, 3, 6, 6))
    with pytest.raises(RuntimeError, match="use_targets"):
        with GuidedMixup("input").attach(model):
            model(torch.randn(2, 3, 6, 6))


# From Westlake-AI/openmixup (477fcf0) openmixup/models/augments/guidedmix.py: guidedmix for
# condition='greedy' with `.cuda()` dropped and onecycle_cover as above. The greedy cycle it computes is
# never used: the images and labels mixed are those of its first random permutation.
def openmixup_guidedmix(img, gt_label, features, size=(7, 7), sigma=(3, 3)):
    rand_index = torch.randperm(img.size(0))
    img_ = img[rand_index]
    y_a = gt_label
    y_b = gt_label[rand_index]
    features = tv_functional.gaussian_blur(features, size, sigma)
    features /= (features).sum(dim=[-1, -2], keepdim=True)
    features_ = features[rand_index]
    x = distance_function(features.detach(), features_.detach()).cpu().numpy()
    rand_index = onecycle_cover(x)
    norm_features = torch.div(features, (features + features_).detach())
    lam = norm_features.mean(dim=[-1, -2]).unsqueeze(-1)
    lam_ = 1 - lam
    mask = torch.stack([norm_features] * 3, dim=1)
    img = mask * img + (1 - mask) * img_
    return img, (y_a, y_b, lam, lam_)


def test_openmixups_port_is_the_saliency_weighted_mix_of_random_pairs():
    """OpenMixup's port pairs at random in effect: pairing='random' with its permutation is its mix."""
    model = SmallCNN().double().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    x, y = torch.randn(8, 3, 10, 10, dtype=torch.float64), torch.randint(0, 5, (8,))
    saliency = torch.rand(8, 10, 10, dtype=torch.float64) ** 3
    torch.manual_seed(4)
    theirs, (_, y_b, lam, _) = openmixup_guidedmix(x, y, saliency.clone())
    torch.manual_seed(4)
    index = torch.randperm(8)
    assert torch.equal(y_b, y[index])
    mix = GuidedMixup("input", pairing="random")
    with mix.attach(model):
        mix.pin(saliency=saliency, index=index)
        model(x)
    torch.testing.assert_close(seen["x"], theirs, rtol=0, atol=1e-14)
    torch.testing.assert_close(mix.last.lam, lam[:, 0], rtol=0, atol=1e-15)


def test_on_a_timm_vits_tokens_the_patches_blend_by_the_gradient_saliency_with_gradients():
    """Block 0's 1 + 4x4 tokens of a timm ViT (``tokens="auto"``): the saliency is the summed
    cross-entropy's gradient at the block's patch tokens (eval mode), the pairs and per-patch weights are
    the authors' on it, the class token is blended with each sample's lam; logits and every parameter's
    gradient as a hand-edited forward, in float64."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    options = {"img_size": 16, "patch_size": 4, "embed_dim": 12, "depth": 2, "num_heads": 2}
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, **options)
    model = model.double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(6, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    mix = GuidedMixup("blocks.0", tokens="auto", generator=gen())
    with mix.attach(model):
        mix.use_targets(y)
        logits = model(x)
        mix.loss(per_sample_ce, logits, y).mean().backward()
    m = by_hand

    def block0(images):
        return m.blocks[0](m.norm_pre(m.patch_drop(m._pos_embed(m.patch_embed(images)))))

    def rest(tokens):
        return m.forward_head(m.norm(m.blocks[1](tokens)))

    m.eval()
    h = block0(x).detach().requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(rest(h), y, reduction="sum"), [h])
    grid = g[:, 1:].transpose(1, 2).reshape(6, 12, 4, 4)  # (B, D, rows, columns)
    saliency = grid.square().mean(1).sqrt()
    torch.testing.assert_close(mix.last.info["saliency"], saliency, rtol=1e-12, atol=0)
    m.train()
    h = block0(x)
    patches = h[:, 1:].transpose(1, 2).reshape(6, 12, 4, 4)
    mixed, soft, index, lam = guided_mixup_process(patches, F.one_hot(y, 3).double(), saliency.clone())
    assert mix.last.index.tolist() == index.tolist()
    torch.testing.assert_close(mix.last.lam, lam, rtol=0, atol=1e-14)
    cls = lam.view(-1, 1, 1) * h[:, :1] + (1 - lam.view(-1, 1, 1)) * h[index, :1]
    expected = rest(torch.cat([cls, mixed.flatten(2).transpose(1, 2)], dim=1))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    (lam * per_sample_ce(expected, y) + (1 - lam) * per_sample_ce(expected, y[index])).mean().backward()
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
