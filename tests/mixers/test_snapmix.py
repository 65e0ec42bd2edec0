"""SnapMix: the mix and both label weights against the authors' ``snapmix``/``get_spm`` on the same draws and
network; loss/targets with weights that do not sum to one; a hand-edited forward with gradients at a hidden
map; batch-norm statistics left as one training forward leaves them; replay, pin_last; the refusals."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import SnapMix
from mixhook.mixers.snapmix import semantic_percent_map, snap_weights

BOXES = []


# The reference: Shaoli-Huang/SnapMix (245bda4), utils/custom_ops.py rand_bbox (np.int as int, the box
# recorded), utils/mixmethod.py get_spm and snapmix, without .cuda(); their model returns (logits, the
# last map, a mid-level output) and its classifier is model.module.classifier: here model.net.fc.
def ref_rand_bbox(size, lam, center=False, attcen=None):
    W = size[2]
    H = size[3]
    cut_rat = np.sqrt(1.0 - lam)
    cut_w = int(W * cut_rat)
    cut_h = int(H * cut_rat)
    cx = np.random.randint(W)
    cy = np.random.randint(H)
    bbx1 = np.clip(cx - cut_w // 2, 0, W)
    bby1 = np.clip(cy - cut_h // 2, 0, H)
    bbx2 = np.clip(cx + cut_w // 2, 0, W)
    bby2 = np.clip(cy + cut_h // 2, 0, H)
    BOXES.append((int(bbx1), int(bbx2), int(bby1), int(bby2)))
    return bbx1, bby1, bbx2, bby2


def ref_get_spm(input, target, conf, model):
    imgsize = (conf["cropsize"], conf["cropsize"])
    bs = input.size(0)
    with torch.no_grad():
        output, fms, _ = model(input)
        clsw = model.net.fc
        weight = clsw.weight.data
        bias = clsw.bias.data
        weight = weight.view(weight.size(0), weight.size(1), 1, 1)
        fms = F.relu(fms)
        poolfea = F.adaptive_avg_pool2d(fms, (1, 1)).squeeze()
        clslogit = F.softmax(clsw.forward(poolfea), dim=1)
        logitlist = []
        for i in range(bs):
            logitlist.append(clslogit[i, target[i]])
        clslogit = torch.stack(logitlist)
        out = F.conv2d(fms, weight, bias=bias)
        outmaps = []
        for i in range(bs):
            evimap = out[i, target[i]]
            outmaps.append(evimap)
        outmaps = torch.stack(outmaps)
        if imgsize is not None:
            outmaps = outmaps.view(outmaps.size(0), 1, outmaps.size(1), outmaps.size(2))
            outmaps = F.interpolate(outmaps, imgsize, mode="bilinear", align_corners=False)
        outmaps = outmaps.squeeze()
        for i in range(bs):
            outmaps[i] -= outmaps[i].min()
            outmaps[i] /= outmaps[i].sum()
    return outmaps, clslogit


def ref_snapmix(input, target, conf, model=None):
    r = np.random.rand(1)
    lam_a = torch.ones(input.size(0), dtype=input.dtype)
    lam_b = 1 - lam_a
    target_b = target.clone()
    if r < conf["prob"]:
        wfmaps, _ = ref_get_spm(input, target, conf, model)
        bs = input.size(0)
        lam = np.random.beta(conf["beta"], conf["beta"])
        lam1 = np.random.beta(conf["beta"], conf["beta"])
        rand_index = torch.randperm(bs)
        wfmaps_b = wfmaps[rand_index, :, :]
        target_b = target[rand_index]
        same_label = target == target_b
        bbx1, bby1, bbx2, bby2 = ref_rand_bbox(input.size(), lam)
        bbx1_1, bby1_1, bbx2_1, bby2_1 = ref_rand_bbox(input.size(), lam1)
        area = (bby2 - bby1) * (bbx2 - bbx1)
        area1 = (bby2_1 - bby1_1) * (bbx2_1 - bbx1_1)
        if area1 > 0 and area > 0:
            ncont = input[rand_index, :, bbx1_1:bbx2_1, bby1_1:bby2_1].clone()
            ncont = F.interpolate(ncont, size=(bbx2 - bbx1, bby2 - bby1), mode="bilinear", align_corners=True)
            input[:, :, bbx1:bbx2, bby1:bby2] = ncont
            lam_a = 1 - wfmaps[:, bbx1:bbx2, bby1:bby2].sum(2).sum(1) / (wfmaps.sum(2).sum(1) + 1e-8)
            lam_b = wfmaps_b[:, bbx1_1:bbx2_1, bby1_1:bby2_1].sum(2).sum(1) / (wfmaps_b.sum(2).sum(1) + 1e-8)
            tmp = lam_a.clone()
            lam_a[same_label] += lam_b[same_label]
            lam_b[same_label] += tmp[same_label]
            lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (input.size()[-1] * input.size()[-2]))
            lam_a[torch.isnan(lam_a)] = lam
            lam_b[torch.isnan(lam_b)] = 1 - lam
    return input, target, target_b, lam_a, lam_b, (lam, rand_index)


class Net(nn.Module):
    """A small ResNet-like classifier: a last (B, 8, h, w) map pooled into an nn.Linear."""

    def __init__(self, classes=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.layer = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.layer(self.stem(x)), 1).flatten(1))


class Returning(nn.Module):
    """The authors' model interface over Net: (logits, the last map, nothing)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        fms = self.net.layer(self.net.stem(x))
        return self.net.fc(F.adaptive_avg_pool2d(fms, 1).flatten(1)), fms, None


def test_the_mix_and_the_label_weights_equal_the_authors_on_the_same_draws():
    conf = {"cropsize": 16, "prob": 1.0, "beta": 5.0}
    checked = 0
    for seed in range(12):
        torch.manual_seed(100 + seed)
        net = Net().double().train()
        theirs = copy.deepcopy(net)
        x = torch.randn(6, 3, 16, 16, dtype=torch.float64)
        y = torch.tensor([0, 1, 2, 3, 0, 1]) if seed % 2 else torch.tensor([0, 0, 1, 1, 2, 2])
        np.random.seed(seed)
        torch.manual_seed(seed)
        BOXES.clear()
        mixed, _, _, lam_a, lam_b, (lam, index) = ref_snapmix(x.clone(), y, conf, Returning(theirs))
        box, partner_box = BOXES
        seen = {}
        net.stem.register_forward_pre_hook(lambda m, a, seen=seen: seen.__setitem__("x", a[0]))
        mix = SnapMix("input", features="layer", classifier="fc", alpha=5.0)
        with mix.attach(net):
            mix.pin(lam=0.5, index=index, box=box, partner_box=partner_box)  # (lam sets no box: both pinned)
            mix.use_targets(y)
            net(x)
        torch.testing.assert_close(seen["x"], mixed, rtol=0, atol=1e-15)
        torch.testing.assert_close(mix.last.lam, lam_a, rtol=0, atol=1e-13)
        torch.testing.assert_close(mix.last.partner_lam, lam_b, rtol=0, atol=1e-13)
        checked += bool((lam_a + lam_b - 1).abs().max() > 1e-3)
    assert checked >= 10  # the weights do not sum to one, as the paper means


def test_batch_norm_running_statistics_are_those_of_one_training_forward():
    torch.manual_seed(0)
    net = Net().train()
    plain = copy.deepcopy(net)
    x, y = torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3])
    mix = SnapMix("input", features="layer", classifier="fc")
    with mix.attach(net):
        mix.use_targets(y)
        net(x)
    mixed_input = {}
    plain.stem.register_forward_pre_hook(lambda m, a: mixed_input.__setitem__("x", a[0]))
    again = SnapMix("input", features="layer", classifier="fc")
    with again.attach(plain):
        again.pin(box=mix.last.info["box"], partner_box=mix.last.info["partner_box"], index=mix.last.index)
        again.pin(cam=torch.zeros(4, 8, 8))  # (no map pass: only the training forward's statistics)
        again.use_targets(y)
        plain(x)
    for (name, a), b in zip(net.named_buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b), name


def test_loss_and_targets_weigh_the_two_labels_by_their_own_weights():
    torch.manual_seed(0)
    net = Net().double().train()
    by_hand = copy.deepcopy(net)
    x, y = torch.randn(5, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 3])
    mix = SnapMix("stem", features="layer", classifier="fc", generator=torch.Generator().manual_seed(3))
    with mix.attach(net):
        mix.use_targets(y)
        logits = net(x)
        loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y)
        soft = mix.targets(y, num_classes=4, dtype=torch.float64)
        loss.sum().backward()
        with pytest.raises(ValueError, match="one loss per sample"):
            mix.loss(F.cross_entropy, logits, y)
    last = mix.last
    own, partner, index = last.lam, last.partner_lam, last.index
    (y1, y2, x1, x2), (p1, p2, q1, q2) = last.info["box"], last.info["partner_box"]
    assert own.shape == partner.shape == (5,) and float((own + partner - 1).abs().max()) > 1e-3
    # the hand-edited forward: the partner's box resized into the box at the stem's output
    m = by_hand
    h = m.stem(x)
    content = h[index][:, :, p1:p2, q1:q2]
    content = F.interpolate(content, size=(y2 - y1, x2 - x1), mode="bilinear", align_corners=True)
    h = h.clone()
    h[:, :, y1:y2, x1:x2] = content
    expected = m.fc(F.adaptive_avg_pool2d(m.layer(h), 1).flatten(1))
    assert torch.equal(logits, expected)
    ce = lambda t: F.cross_entropy(expected, t, reduction="none")  # noqa: E731
    (own * ce(y) + partner * ce(y[index])).sum().backward()
    for p, q in zip(net.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    one_hot = F.one_hot(y, 4).double()
    torch.testing.assert_close(soft, own[:, None] * one_hot + partner[:, None] * one_hot[index])
    # the weights are the semantic percent maps' shares, from the unmixed batch's own maps
    with torch.no_grad():
        fms = F.relu(by_hand.layer(by_hand.stem(x)))
    w = by_hand.fc.weight[y]
    cam = torch.einsum("bdhw,bd->bhw", fms, w) + by_hand.fc.bias[y][:, None, None]
    spm = semantic_percent_map(cam, 16, 16)
    expect_own, expect_partner = snap_weights(spm, index, y, last.info["box"], last.info["partner_box"])
    torch.testing.assert_close(own, expect_own)
    torch.testing.assert_close(partner, expect_partner)


def test_checkpoint_replay_and_pin_last_repeat_the_mix_and_its_weights():
    torch.manual_seed(0)
    net = Net().double().train()
    plain = copy.deepcopy(net)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    mix = SnapMix("stem", features="layer", classifier="fc", generator=torch.Generator().manual_seed(1))
    with mix.attach(net):
        mix.use_targets(y)
        out = checkpoint(net, x, use_reentrant=False)
        out.sum().backward()
        first = mix.last
        mix.pin_last()
        mix.use_targets(y)
        again = net(x)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert torch.equal(mix.last.lam, first.lam) and torch.equal(mix.last.partner_lam, first.partner_lam)
    same = SnapMix("stem", features="layer", classifier="fc")
    with same.attach(plain):
        same.pin(lam=0.5, index=first.index, box=first.info["box"], partner_box=first.info["partner_box"])
        same.use_targets(y)
        plain(x).sum().backward()
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_snapmix_refuses_a_model_without_a_linear_classifier_over_pooled_features():
    net = Net().train()
    with pytest.raises(TypeError, match="needs the nn.Linear classifier over pooled features"):
        SnapMix("input", features="layer", classifier="layer").attach(net)
    mix = SnapMix("input", features="stem", classifier="fc")
    with mix.attach(net):
        mix.use_targets(torch.tensor([0, 1]))
        with pytest.raises(TypeError, match="pooled D = 8 features classifier 'fc' takes"):
            net(torch.randn(2, 3, 16, 16))
    mix = SnapMix("input", features="layer", classifier="fc")
    with mix.attach(net), pytest.raises(RuntimeError, match="use_targets"):
        net(torch.randn(2, 3, 16, 16))
    with pytest.raises(ValueError, match="takes no policies"):
        from mixhook.policies import Remix

        SnapMix("input", features="layer", classifier="fc").use(Remix(torch.ones(4)))
    mix = SnapMix("input", features="layer", classifier="fc")
    with mix.attach(net), pytest.raises(ValueError, match="per-position labels"):
        mix.use_targets(torch.tensor([0, 1]))
        logits = net(torch.randn(2, 3, 16, 16))
        mix.targets(torch.zeros(2, 4, 4, dtype=torch.int64), num_classes=4, logits=logits)


def test_under_oneof_the_map_pass_mixes_nothing_and_draws_no_choice():
    """SnapMix's pass on the unmixed batch runs the model again inside the training forward: neither
    OneOf's choice nor its other mixer may act in it (a second choice, or a CutMix of the batch whose maps
    weigh the labels, would be silently wrong)."""
    from mixhook import CutMix, OneOf

    torch.manual_seed(0)
    net = Net().double().train()
    alone = copy.deepcopy(net)
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    snap = SnapMix("input", features="layer", classifier="fc", generator=torch.Generator().manual_seed(1))
    cut = CutMix("input", generator=torch.Generator().manual_seed(2))
    both = OneOf([snap, cut], p=[0.5, 0.5], generator=torch.Generator().manual_seed(0))
    with both.attach(net):
        both.pin(choice=0)
        snap.use_targets(y)
        logits = net(x)
        assert cut.last is None and snap.last is not None
        first = snap.last
    solo = SnapMix("input", features="layer", classifier="fc")
    with solo.attach(alone):
        solo.pin(lam=0.5, index=first.index, box=first.info["box"], partner_box=first.info["partner_box"])
        solo.use_targets(y)
        expected = alone(x)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert torch.equal(solo.last.lam, first.lam) and torch.equal(solo.last.partner_lam, first.partner_lam)
    for a, b in zip(net.buffers(), alone.buffers(), strict=True):
        assert torch.equal(a, b)


def test_with_the_clean_batch_kept_the_targets_are_the_clean_ones_then_the_weighted_mix():
    torch.manual_seed(0)
    net = Net().double().train()
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    mix = SnapMix("stem", features="layer", classifier="fc", generator=torch.Generator().manual_seed(1))
    mix.clean = True
    with mix.attach(net):
        mix.use_targets(y)
        logits = net(x)
        soft = mix.targets(y, num_classes=4, dtype=torch.float64, logits=logits)
        loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y)
    own, partner, index = mix.last.lam, mix.last.partner_lam, mix.last.index
    one = F.one_hot(y, 4).double()
    torch.testing.assert_close(soft, torch.cat([one, own[:, None] * one + partner[:, None] * one[index]]))
    ce = lambda o, t: F.cross_entropy(o, t, reduction="none")  # noqa: E731
    mixed = logits[4:]
    torch.testing.assert_close(
        loss, torch.cat([ce(logits[:4], y), own * ce(mixed, y) + partner * ce(mixed, y[index])])
    )


def swin_with_square_last_map():
    """A timm Swin whose last stage gives (B, 8, 8, 8) maps: channels last, its height equal to its channels,
    so a (B, D, h, w) reading passes every shape check and reads the wrong axis."""
    timm = pytest.importorskip("timm")
    return timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, num_classes=5, img_size=64, embed_dim=4,
        depths=(1, 1), num_heads=(1, 1), window_size=4, drop_path_rate=0.0,
    ).double()  # fmt: skip


def test_a_channels_last_last_map_is_read_by_its_layout_even_where_its_height_equals_its_channels():
    torch.manual_seed(0)
    model = swin_with_square_last_map().train()
    x, y = torch.randn(6, 3, 64, 64, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 0])
    with torch.no_grad():
        fms = model.eval().forward_features(x)  # (B, h, w, D): the map the head pools
    model.train()
    assert fms.shape == (6, 8, 8, 8)
    w, b = model.head.fc.weight, model.head.fc.bias
    mix = SnapMix("input", features="norm", classifier="head.fc")  # (the map the head pools)
    with mix.attach(model):
        mix.pin(lam=0.5, box=(8, 40, 16, 48), partner_box=(0, 32, 0, 32))
        mix.use_targets(y)
        model(x)
    index = mix.last.index
    for reading, expected in ((fms.permute(0, 3, 1, 2), True), (fms, False)):  # its layout; the wrong axis
        cam = torch.einsum("bdhw,bd->bhw", F.relu(reading), w[y]) + b[y][:, None, None]
        spm = semantic_percent_map(cam, 64, 64)
        own, taken = snap_weights(spm, index, y, (8, 40, 16, 48), (0, 32, 0, 32))
        same = torch.allclose(mix.last.lam, own, rtol=0, atol=1e-12) and torch.allclose(
            mix.last.partner_lam, taken, rtol=0, atol=1e-12
        )
        assert same is expected


class ConvNeXtBlock(nn.Module):
    """A ConvNeXt block as its reference code writes it (a depthwise convolution, then a LayerNorm and a
    Linear over the channels of the map permuted in forward code): its output's layout nothing states."""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.norm, self.pw = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.pw(self.norm(self.dw(x).permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.stage, self.fc = ConvNeXtBlock(), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(self.stage(self.stem(x)).mean((2, 3)))


def test_features_whose_layout_the_model_does_not_state_are_refused_where_it_works_on_both():
    model = ConvNeXtLike().train()  # its stage's (B, 8, 8, 8) map could be (B, C, H, W) or (B, H, W, C)
    mix = SnapMix("input", features="stage", classifier="fc")
    with mix.attach(model), pytest.raises(TypeError, match="^SnapMix's features at 'stage': .*declare it"):
        mix.use_targets(torch.tensor([0, 1]))
        model(torch.randn(2, 3, 16, 16))
