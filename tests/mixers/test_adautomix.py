"""AdAutoMix against the authors' code on the same draws (float64): the generator's shares, one training
step's loss and gradients (the model's and the generator's) on an adversarial step and on the other kind,
the alternation kept across a resume, and bad input in one line.

The reference lines are copied from JinXins/Adversarial-AutoMixup (``openmixup/models/heads/Ada_mix_pine.py``:
``AdaptiveMask.caculate_attention``, ``normal_mix``, ``forward``; ``openmixup/models/classifiers/
AdAutoMix.py``: ``AdAutoMix.mixup``, ``forward_train``, ``forward_k``, ``forward_q``, the two-sample path),
with mmcv's ``ConvModule`` written as the ``nn.Conv2d`` and ``nn.ReLU`` it builds there (``norm_cfg=None``,
its default activation), the classifier heads as the model's own (one fc for their ``head_one_q``,
``head_mix_q`` and ``head_mix_k``), and their casts to float32 made to the features' dtype so that both
sides compare in float64.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import AdAutoMix
from mixhook.mixers.adautomix import AdaptiveMask
from tests.mixers.test_automix import Net, batch

# ------------------------------------------------------- openmixup/models/heads/Ada_mix_pine.py (authors')


class TheirAdaptiveMask(nn.Module):
    def __init__(self, in_channel, reduction=2, lam_concat=True, use_scale=True, unsampling_mode="nearest",
                 scale_factor=4):  # fmt: skip
        super().__init__()
        self.in_channel, self.reduction = in_channel, reduction
        self.inter_channels = max(in_channel // reduction, 1)
        self.lam_concat, self.use_scale = lam_concat, use_scale
        self.upsample_mode, self.scale_factor = unsampling_mode, scale_factor
        self.qk_channel = self.in_channel + 1 if self.lam_concat else self.in_channel
        self.conv_q = nn.Sequential(nn.Conv2d(self.qk_channel, self.inter_channels, 1), nn.ReLU())
        self.conv_k = nn.Sequential(nn.Conv2d(self.qk_channel, self.inter_channels, 1), nn.ReLU())
        self.conv_v = nn.Conv2d(in_channels=self.qk_channel, out_channels=1, kernel_size=1, stride=1)

    def caculate_attention(self, f_map, f_map_):
        b, c, w, h = f_map.size()
        q, k = self.conv_q(f_map).view(b, self.inter_channels, -1).permute(0, 2, 1), \
            self.conv_k(f_map).view(b, self.inter_channels, -1)  # fmt: skip
        q_, k_ = self.conv_q(f_map_).view(b, self.inter_channels, -1).permute(0, 2, 1), \
            self.conv_k(f_map_).view(b, self.inter_channels, -1)  # fmt: skip
        attn = torch.matmul(q, k_)
        attn_ = torch.matmul(q_, k)
        if self.use_scale:
            attn /= self.inter_channels**0.5
            attn_ /= self.inter_channels**0.5
        attn_soft, attn_soft_ = attn.softmax(dim=-1), attn_.softmax(dim=-1)
        return attn_soft, attn_soft_

    def normal_mix(self, f_map, f_map_, lam):
        b, c, w, h = f_map.size()
        if self.lam_concat:
            lam_block = torch.zeros([b, 1, h, w]).to(f_map)
            lam_block[:] = lam
            f_map = torch.cat([f_map, lam_block], dim=1)
            f_map_ = torch.cat([f_map_, 1 - lam_block], dim=1)
        v, v_ = f_map, f_map_
        v = self.conv_v(v).view(b, 1, -1).permute(0, 2, 1)
        v_ = self.conv_v(v_).view(b, 1, -1).permute(0, 2, 1)
        attn, attn_ = self.caculate_attention(f_map, f_map_)
        mask_lam = torch.matmul(attn, v).view(b, 1, h, w)
        mask_lam_ = torch.matmul(attn_, v_).view(b, 1, h, w)
        mask = torch.cat([mask_lam, mask_lam_], dim=1)
        return mask

    def co_caculate_attention(self, feature_map):
        b, c, w, h = feature_map[0].size()
        q = []
        k = []
        attn = []
        for i in range(0, len(feature_map)):
            q.append(self.conv_q(feature_map[i]).view(b, self.inter_channels, -1).permute(0, 2, 1))
            k.append(self.conv_k(feature_map[i]).view(b, self.inter_channels, -1))
        for i in range(0, len(q)):
            b, c, p = k[0].size()
            co_attn = torch.zeros(b, p, p).to(feature_map[0])  # (theirs: .cuda(), float32)
            for j in range(0, len(k)):
                if i != j:
                    co_attn += torch.matmul(q[i], k[j])
            if self.use_scale:
                co_attn /= self.inter_channels**0.5
            co_attn = co_attn.softmax(dim=-1)
            attn.append(co_attn)
        return attn

    def co_mix(self, feature_map, lam):
        b, c, w, h = feature_map[0].size()
        if self.lam_concat:
            for i in range(0, len(feature_map)):
                lam_block = torch.zeros([b, 1, h, w]).to(feature_map[i])
                lam_block[:] = lam[i]
                feature_map[i] = torch.cat([feature_map[i], lam_block], dim=1)
        v = []
        for i in range(0, len(feature_map)):
            v.append(feature_map[i])
            v[i] = self.conv_v(v[i]).view(b, 1, -1).permute(0, 2, 1)
        attn = self.co_caculate_attention(feature_map)
        mask_zero = torch.matmul(attn[0], v[0]).view(b, 1, h, w)
        mask_list = [mask_zero]
        for i in range(1, len(v)):
            mask_lam = torch.matmul(attn[i], v[i]).view(b, 1, h, w)
            mask_list.append(mask_lam)
            if i == 1:
                mask = torch.cat([mask_zero, mask_list[i]], dim=1)
            else:
                mask = torch.cat([mask, mask_list[i]], dim=1)
        return mask

    def forward(self, f_maps, lam):
        if len(f_maps) == 2:
            mask = self.normal_mix(f_maps[0], f_maps[1], lam)
        else:
            mask = self.co_mix(list(f_maps), lam)
        mask = F.interpolate(mask, scale_factor=self.scale_factor, mode=self.upsample_mode)
        return {"mask": mask.softmax(dim=1)}


# ------------------------------------------------ openmixup/models/classifiers/AdAutoMix.py (authors')


def their_step(q, k, block, img, gt_label, lam, index_mb, index_bb, it, lam_margin=0.03, beta_radio=0.3):
    """forward_train with mix_samples=2 (co_mix 2), is_random False, switch_off 0, save off, head weights 1
    (head_one_q, head_mix_q, head_mix_k: the models' own fc); ``it``: their ``self.iter``. The loss."""
    index = [index_mb, index_bb]
    feature = k.features(img)  # backbone_k(img)[0]
    # mixup
    lam_mb, lam_bb = lam[0], lam[1]
    mb = [feature, feature[index[0], :]]
    bb = [feature, feature[index[1], :]]
    mask_mb = block(mb, lam_mb)["mask"]
    mask_bb = block(bb, lam_bb)["mask"].clone().detach()
    if lam_margin >= lam_bb or lam_margin >= 1 - lam_bb:
        mask_bb[:, 0, :, :] = lam_bb
        mask_bb[:, 1, :, :] = 1 - lam_bb
    img_mix_mb = img * mask_mb[:, 0, :, :].unsqueeze(1) + img[index[0], :] * mask_mb[:, 1, :, :].unsqueeze(1)
    img_mix_bb = img * mask_bb[:, 0, :, :].unsqueeze(1) + img[index[1], :] * mask_bb[:, 1, :, :].unsqueeze(1)
    # forward_k (ClsMixupHead.loss, CE: criterion(score, y_a) * lam + criterion(score, y_b) * (1 - lam))
    pred_mix_k = k(img_mix_mb)
    loss_mix_k = F.cross_entropy(pred_mix_k, gt_label) * lam_mb + F.cross_entropy(
        pred_mix_k, gt_label[index_mb]
    ) * (1 - lam_mb)
    simi = torch.nn.CosineSimilarity(dim=-1)
    x_ = img[index_mb, :]
    pred_x = k(img)
    pred_x_ = k(x_)
    cos_simi_weight = torch.mean(simi(pred_mix_k, pred_x) * lam_mb + simi(pred_mix_k, pred_x_) * (1 - lam_mb))
    # forward_q
    loss_one_q = F.cross_entropy(q(img), gt_label)
    pred_mix_q = q(img_mix_bb)
    loss_mix_q = F.cross_entropy(pred_mix_q, gt_label) * lam_bb + F.cross_entropy(
        pred_mix_q, gt_label[index_bb]
    ) * (1 - lam_bb)
    # loss summary
    loss = loss_mix_q + loss_one_q
    if it % 2 == 0:
        loss_mix_k = (-1.0) * beta_radio * loss_mix_k + (1 - beta_radio) * cos_simi_weight
    return loss + loss_mix_k, mask_mb, img_mix_bb


def co_loss(pred, y, indices, lam):
    """ClsMixupHead.co_loss (CE): ``criterion(score, y[0]) * lam[0] + ...``."""
    loss = F.cross_entropy(pred, y[indices[0]]) * lam[0]
    for i in range(1, len(indices)):
        loss += F.cross_entropy(pred, y[indices[i]]) * lam[i]
    return loss


def their_co_step(q, k, block, img, gt_label, lam, index_mb, index_bb, it, lam_margin=0.03, rule="authors",
                  mixup_radio=0.5, beta_radio=0.3):  # fmt: skip
    """forward_train's co_mix > 2 path (``lam``: the Beta draws, normalised here as theirs): the loss."""
    co_lam = [lam[i] / sum(lam) for i in range(len(lam))]
    feature = k.features(img)
    b, c, w, h = img.size()
    # co_mixup
    mb = [feature[index_mb[i], :] for i in range(len(index_mb))]
    bb = [feature[index_bb[i], :] for i in range(len(index_bb))]
    mask_mb = block(mb, co_lam)["mask"]
    mask_bb = block(bb, co_lam)["mask"].clone().detach()
    if lam_margin >= co_lam[0] or (
        lam_margin > 1 - co_lam[0] if rule == "authors" else lam_margin < 1 - co_lam[0]
    ):  # (the authors' line; OpenMixup's port: `self.lam_margin < 1 - lam[0]`)
        mask_bb[:, 0, :, :] = co_lam[0]
        mask_bb[:, 1, :, :] = co_lam[1]
        mask_bb[:, 2, :, :] = co_lam[2]
    img_mix_mb = torch.zeros([b, c, w, h]).to(img)
    img_mix_bb = torch.zeros([b, c, w, h]).to(img)
    for i in range(0, len(co_lam)):
        img_mix_mb += img[index_mb[i], :] * mask_mb[:, i, :, :].unsqueeze(1)
        img_mix_bb += img[index_bb[i], :] * mask_bb[:, i, :, :].unsqueeze(1)
    # forward_k
    pred_mix_k = k(img_mix_mb)
    loss_mix_k = co_loss(pred_mix_k, gt_label, index_mb, co_lam)
    simi = torch.nn.CosineSimilarity(dim=-1)
    pred = [k(img[index_mb[i], :]) for i in range(len(co_lam))]
    cos_simi_weight = 0.0
    for i in range(0, len(co_lam)):
        cos_simi_weight += simi(pred_mix_k, pred[i]) * co_lam[i]
    cos_simi_weight = torch.mean(cos_simi_weight)
    # forward_q
    loss_one_q = F.cross_entropy(q(img), gt_label)
    co_mixed_x = img[index_bb[0],] * co_lam[0]
    for i in range(1, len(co_lam)):
        co_mixed_x += img[index_bb[i],] * co_lam[i]
    loss_co_mix_q = co_loss(q(co_mixed_x), gt_label, index_bb, co_lam)
    loss_re_q = loss_one_q * (1 - mixup_radio) + loss_co_mix_q * mixup_radio
    loss_mix_q = co_loss(q(img_mix_bb), gt_label, index_bb, co_lam)
    loss = loss_mix_q + loss_re_q
    if it % 2 == 0:
        loss_mix_k = (-1.0) * beta_radio * loss_mix_k + (1 - beta_radio) * cos_simi_weight
    return loss + loss_mix_k, mask_mb, img_mix_bb


# ------------------------------------------------------------------------------------------- tests


def theirs_of(ours: AdaptiveMask, scale_factor: int = 4) -> TheirAdaptiveMask:
    theirs = TheirAdaptiveMask(ours.channels, ours.reduction, unsampling_mode=ours.upsampling[0],
                               scale_factor=scale_factor).double()  # fmt: skip
    theirs.conv_q[0].load_state_dict(ours.query.state_dict())
    theirs.conv_k[0].load_state_dict(ours.key.state_dict())
    theirs.conv_v.load_state_dict(ours.value.state_dict())
    return theirs


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_the_generator_equals_the_authors_on_the_same_features(mode):
    torch.manual_seed(0)
    ours = AdaptiveMask(32, upsampling=mode).double()
    for p in ours.parameters():  # (N(0, 0.01) makes every share about 0.5: test larger weights)
        p.data.normal_(0, 0.3)
    theirs = theirs_of(ours)
    x = torch.randn(5, 32, 4, 4, dtype=torch.float64)
    index = torch.tensor([3, 0, 4, 1, 2])
    got = ours(x, 0.3, index, (16, 16))
    expected = theirs([x, x[index]], 0.3)["mask"]
    torch.testing.assert_close(got, expected[:, 1:], rtol=1e-12, atol=1e-14)
    assert float(got.detach().std()) > 0.05  # (a mask, not a constant)
    shares = ours.shares([x, x[index]], [0.3, 0.7], (16, 16))
    torch.testing.assert_close(shares.sum(1), torch.ones(5, 16, 16, dtype=torch.float64))


def references(model, mix):
    """Inside ``mix.attach(model)``: its Mix Block in float64 with weights drawn large enough that the mask
    varies, and the authors' twins (the model, the momentum copy, their generator with the same weights)."""
    block = mix.mix_block.double()
    for p in block.parameters():
        p.data.normal_(0, 0.2)
    q_ref, k_ref = copy.deepcopy(model), copy.deepcopy(mix.momentum_model).double()
    block_ref = theirs_of(block)
    mix.momentum_model.double()
    return block, q_ref, k_ref, block_ref


def assert_same_step(model, q_ref, block, block_ref):
    """The model's and the generator's gradients equal the authors' (the generator's not all zero: it is
    trained), and the model's buffers (batch norm's running statistics) too."""
    for (name, p), r in zip(model.named_parameters(), q_ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-13, msg=name)
    grads = [(name, p.grad) for name, p in block.named_parameters()]
    refs = [block_ref.conv_q[0], block_ref.conv_k[0], block_ref.conv_v]
    for (name, grad), r in zip(grads, [p.grad for m in refs for p in m.parameters()], strict=True):
        torch.testing.assert_close(grad, r, rtol=1e-10, atol=1e-13, msg=name)
    assert any(float(grad.abs().max()) > 0 for _, grad in grads)
    for (name, b), r in zip(model.named_buffers(), q_ref.buffers(), strict=True):
        torch.testing.assert_close(b, r, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize(
    ("lam_bb", "norm", "adversarial"),
    [(0.35, "group", True), (0.35, "group", False), (0.02, "group", True), (0.35, "batch", True)],
)  # (0.02: within lam_margin, plain mixup for the model)
def test_one_training_step_equals_the_authors_loss_and_gradients(lam_bb, norm, adversarial):
    """One step equals the authors' forward_train (copied above): the loss, the model's and the generator's
    gradients, the generator's mask and the model's mix, and, with batch norm, the running statistics of
    the model's two forwards."""
    torch.manual_seed(1)
    model = Net(norm=norm).double()
    mix = AdAutoMix("input", "layer3", mix_samples=2)
    img, y = batch()
    index_mb, index_bb = torch.tensor([5, 3, 0, 1, 2, 4]), torch.tensor([1, 2, 3, 4, 5, 0])
    with mix.attach(model):
        block, q_ref, k_ref, block_ref = references(model, mix)
        mix.pin(lam=lam_bb, index=index_bb, lam_mb=0.6, index_mb=index_mb, adversarial=adversarial)
        logits = model(img)
        loss = mix.loss(F.cross_entropy, logits, y)
        loss.backward()
    expected, mask_mb, mixed_bb = their_step(
        q_ref, k_ref, block_ref, img, y, [0.6, lam_bb], index_mb, index_bb, it=0 if adversarial else 1
    )
    expected.backward()
    assert logits.shape == (12, 5)  # the clean rows, then the mixed ones
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    assert_same_step(model, q_ref, block, block_ref)
    assert all(p.grad is None for p in mix.momentum_model.parameters())
    torch.testing.assert_close(
        mix.state_for(logits).loss_inputs["block"][1], mask_mb[:, 1:], rtol=1e-12, atol=1e-14
    )
    own = mix.last.weights[:, None]
    torch.testing.assert_close(own * img + (1 - own) * img[index_bb], mixed_bb, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("lams", "rule", "norm", "adversarial"),
    [
        ((0.5, 0.3, 0.9), "authors", "group", True),
        ((0.5, 0.3, 0.9), "authors", "group", False),
        ((0.5, 0.3, 0.9), "authors", "batch", True),
        ((0.5, 0.3, 0.9), "openmixup", "group", True),  # (its test: plain mixup for the model)
        ((0.02, 0.6, 0.7), "authors", "group", False),  # (the first weight within lam_margin: plain)
    ],
)
def test_a_three_sample_step_equals_the_authors_loss_and_gradients(lams, rule, norm, adversarial):
    """The authors' default, three samples (their co_mix path, copied above): the loss, the model's and the
    generator's gradients, the generator's shares, the model's mix and, with batch norm, the running
    statistics of the model's three forwards (clean, plain three-way mixup, mask mix: one forward of
    ``3B`` rows here, normalised apart)."""
    torch.manual_seed(4)
    model = Net(norm=norm).double()
    mix = AdAutoMix("input", "layer3", margin_rule=rule)
    img, y = batch()
    g = torch.Generator().manual_seed(8)
    block_indices = [torch.randperm(6, generator=g) for _ in range(3)]
    mix_indices = [torch.randperm(6, generator=g) for _ in range(3)]
    with mix.attach(model):
        block, q_ref, k_ref, block_ref = references(model, mix)
        mix.pin(lams=lams, block_indices=block_indices, mix_indices=mix_indices, adversarial=adversarial)
        logits = model(img)
        loss = mix.loss(F.cross_entropy, logits, y)
        loss.backward()
    expected, mask_mb, mixed_bb = their_co_step(
        q_ref, k_ref, block_ref, img, y, lams, block_indices, mix_indices, 0 if adversarial else 1, rule=rule
    )
    expected.backward()
    assert logits.shape == (18, 5) and mix.last.groups == 2  # clean, plain mixup, mask mix
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    assert_same_step(model, q_ref, block, block_ref)  # (batch norm: the three forwards' statistics)
    torch.testing.assert_close(mix.state_for(logits).loss_inputs["block"][1], mask_mb, rtol=1e-12, atol=1e-14)
    shares = mix.last.info["mask"]
    ours = sum(shares[:, i : i + 1] * img[mix_indices[i]] for i in range(3))
    torch.testing.assert_close(ours, mixed_bb, rtol=1e-12, atol=1e-14)
    plain = rule == "openmixup" or lams[0] / sum(lams) <= 0.03
    assert (float(shares.std(dim=(2, 3)).max()) == 0) == plain  # (constant shares: plain mixup)
    with pytest.raises(
        ValueError, match="targets\\(\\): AdAutoMix trains its Mix Block by a loss of its own"
    ):
        mix.targets(y, 5, logits=logits)


def test_random_samples_draws_two_or_three_and_every_draw_repeats():
    """``random_samples`` (the authors' ``is_random``): each forward mixes 2 or 3 samples, drawn from the
    mixer's generator, so two runs from one seed mix alike, and a forward of two mixes 2B rows after the
    clean ones' B, one of three 3B."""
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        model = Net().double()
        mix = AdAutoMix("input", "layer3", random_samples=True, generator=torch.Generator().manual_seed(9))
        img, y = batch()
        seen = []
        with mix.attach(model):
            mix.momentum_model.double()
            mix.mix_block.double()
            for _ in range(8):
                logits = model(img)
                seen.append(
                    (
                        mix.last.info["samples"],
                        logits.shape[0],
                        float(mix.loss(F.cross_entropy, logits, y).detach()),
                    )
                )
        runs.append(seen)
    assert runs[0] == runs[1]
    assert {s for s, _, _ in runs[0]} == {2, 3}
    assert all(rows == 6 * (1 + (2 if s == 3 else 1)) for s, rows, _ in runs[0])


def test_the_turns_alternate_from_the_first_forward_and_resume_where_they_were():
    """The authors' ``self.iter``: adversarial on the first training forward, then every other one; an
    evaluation forward is not counted; the count is in the state, so a resumed run keeps the turn."""
    torch.manual_seed(2)
    model = Net().double()
    mix = AdAutoMix("input", "layer3")
    img, y = batch()
    turns = []
    with mix.attach(model):
        mix.momentum_model.double()
        mix.mix_block.double()
        for step in range(5):
            if step == 2:
                model.eval()
                model(img)
                model.train()
            mix.loss(F.cross_entropy, model(img), y).backward()
            turns.append(mix.last.info["adversarial"])
        state = mix.state_dict()
    assert turns == [True, False, True, False, True]
    resumed = AdAutoMix("input", "layer3")
    resumed.load_state_dict(state)
    with resumed.attach(model):
        resumed.momentum_model.double()
        resumed.mix_block.double()
        model(img)
        assert resumed.last.info["adversarial"] is False and resumed.iteration == 6
    never = AdAutoMix("input", "layer3", adversarial_every=0)
    with never.attach(model):
        never.momentum_model.double()
        never.mix_block.double()
        model(img)
        assert never.last.info["adversarial"] is False


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="mix_samples must be an integer >= 2, got 1"):
        AdAutoMix("input", "layer3", mix_samples=1)
    with pytest.raises(ValueError, match="margin_rule must be one of authors, openmixup, got 'timm'"):
        AdAutoMix("input", "layer3", margin_rule="timm")
    with pytest.raises(ValueError, match="mixup_ratio must be in"):
        AdAutoMix("input", "layer3", mixup_ratio=2.0)
    with pytest.raises(ValueError, match="beta must be in"):
        AdAutoMix("input", "layer3", beta=1.5)
    with pytest.raises(ValueError, match="adversarial_every must be an integer >= 0, got -1"):
        AdAutoMix("input", "layer3", adversarial_every=-1)
    with pytest.raises(ValueError, match="upsampling must be among nearest, bilinear, bicubic"):
        AdAutoMix("input", "layer3", upsampling="area")
    with pytest.raises(ValueError, match="channels must be an integer >= 1"):
        AdaptiveMask(0)


def test_its_signature_is_automixs_less_the_mask_loss_plus_its_own_and_each_value_reaches_its_place():
    """AdAutoMix states only what differs from AutoMix (mixhook.engine.mixer.extending): its signature lists
    every argument with its own defaults, a value given by name reaches AutoMix's constructor or its own, a
    mask loss is neither taken nor kept, and a value by position past ``features`` (where AutoMix's order
    would have taken it for another argument) is refused in one line."""
    import inspect

    from mixhook import AutoMix

    params = inspect.signature(AdAutoMix).parameters
    automix = inspect.signature(AutoMix).parameters
    mask = {"mask_loss", "mask_loss_mode", "mask_margin", "mask_adjust"}
    own = {"beta", "adversarial_every", "mix_samples", "random_samples", "mixup_ratio", "margin_rule"}
    assert set(params) == (set(automix) - mask) | own
    assert [params[k].default for k in ("alpha", "end_momentum", "lam_margin", "beta", "mix_samples")] == [
        1.0, 0.99999, 0.03, 0.3, 3,
    ]  # fmt: skip
    mix = AdAutoMix("input", "conv1", alpha=0.5, momentum=0.9, lam_margin=0.1, beta=0.2, mix_samples=2)
    assert (mix.specs, mix.alpha, mix.lam_margin, mix.beta, mix.mix_samples) == (("input",), 0.5, 0.1, 0.2, 2)
    assert mix.copy.momentum == 0.9 and mix.mask_loss == 0.0 and mix.iteration == 0
    with pytest.raises(
        TypeError, match=r"AdAutoMix\(\) takes layer, features by position and the rest by name"
    ):
        AdAutoMix("input", "conv1", None, 1.0, 0.3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'mask_loss'"):
        AdAutoMix("input", "conv1", mask_loss=0.1)


@pytest.mark.parametrize("samples", [2, 3])
def test_a_per_sample_criterion_gives_the_losses_whose_mean_is_the_loss(samples):
    """With ``reduction="none"`` the cosine term is per sample too: the mean of the per-sample losses is
    the loss of the mean criterion, on an adversarial forward and on the other kind."""
    torch.manual_seed(3)
    model = Net().double()
    mix = AdAutoMix("input", "layer3", mix_samples=samples)
    img, y = batch()
    with mix.attach(model):
        mix.momentum_model.double()
        for p in mix.mix_block.double().parameters():
            p.data.normal_(0, 0.2)
        for adversarial in (True, False):
            mix.pin(lam=0.4, index=torch.tensor([1, 2, 3, 4, 5, 0]), adversarial=adversarial)
            logits = model(img)
            each = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y)
            whole = mix.loss(F.cross_entropy, logits, y)
            assert each.shape == (6,)
            torch.testing.assert_close(each.mean(), whole, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("adversarial", [True, False])
@pytest.mark.parametrize("samples", [2, 3])
def test_a_mix_inside_activation_checkpointing_has_the_unchecked_gradients(adversarial, samples):
    """The mixed layer and the layer after it recomputed in backward (batch norm: the clean rows, the
    plain mixup's with three samples, and the mixed ones normalised apart): the gradients of the forward
    without checkpoints, on both kinds of step."""
    from torch.utils.checkpoint import checkpoint

    class Checked(Net):
        def features(self, x):
            h = self.layer1(self.stem(x))
            return checkpoint(
                self.layer3, checkpoint(self.layer2, h, use_reentrant=False), use_reentrant=False
            )

    grads = []
    for cls in (Net, Checked):
        torch.manual_seed(6)
        model = cls(norm="batch").double()
        mix = AdAutoMix("layer2", "layer1", mix_samples=samples, generator=torch.Generator().manual_seed(2))
        img, y = batch()
        with mix.attach(model):
            mix.mix_block.double()
            mix.momentum_model.double()
            mix.pin(adversarial=adversarial)
            mix.loss(F.cross_entropy, model(img), y).backward()
        grads.append([p.grad for p in [*model.parameters(), *mix.parameters()]])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert all(g is not None for g in grads[0])


def test_rows_before_the_mix_without_the_clean_rows_are_refused_in_one_line():
    """A method's own rows before its mix (``Mixed.before``) follow the clean rows: without them they are
    refused, never dropped (AdAutoMix puts them there only with its clean rows: ``clean_weight=0`` mixes
    three samples with no plain mixup batch, as the authors' code has none without its clean loss)."""
    from mixhook import ManifoldMixup, Mixed

    class Before(ManifoldMixup):
        def mix(self, leaves, draw):
            mixed = super().mix(leaves, draw)
            return Mixed(mixed.tensors, before={leaves[0].path: leaves[0].tensor})

    model = Net()
    with (
        Before("layer2").attach(model),
        pytest.raises(
            RuntimeError, match="put rows before its mix, which follow the clean rows: set clean=True"
        ),
    ):
        model(batch()[0].float())
    mix = AdAutoMix("input", "layer3", clean_weight=0.0)
    with mix.attach(model):
        mix.pin(samples=3)
        assert model(batch()[0].float()).shape == (6, 5) and mix.last.groups == 1


def test_a_loss_policy_is_refused_when_used_with_mixes_of_three():
    from mixhook.policies import DecoupledLoss, Remix

    with pytest.raises(
        TypeError, match="^Remix weighs two labels per row, and AdAutoMix mixes up to 3 samples"
    ):
        AdAutoMix("input", features="0").use(Remix(counts=[5, 3, 2]))
    assert AdAutoMix("input", features="0", mix_samples=2).use(DecoupledLoss()).policies
