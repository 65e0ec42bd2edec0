"""AutoMix and SAMix against OpenMixup's code on the same draws (float64): the Mix Block's mask, the mask
loss, one training step's loss and gradients (the model's and the Mix Block's), the momentum update and its
schedule; the state, and bad input in one line.

The reference lines are copied from Westlake-AI/openmixup (``openmixup/models/heads/pmix_block.py``:
``PixelMixBlock.forward``, ``embedded_gaussian``, ``rescale_lam_mult``, ``mask_loss``;
``openmixup/models/classifiers/automix.py``: ``AutoMixup.pixel_mixup``, ``forward_train``, ``forward_k``,
``forward_q``, ``momentum_update``; ``openmixup/core/hooks/momentum_hook.py``: ``CosineScheduleHook``), with
mmcv's ``ConvModule`` written as the ``nn.Conv2d`` it builds there (no norm, no activation), SAMix's
``ConvNeck`` value as its layers, the classifier heads as the model's own, and their casts to float32 made
to the features' dtype so that both sides compare in float64.
"""

import copy
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import AdAutoMix, AutoMix, SAMix
from mixhook.engine.card import METHODS, methods_with
from mixhook.mixers.mixblock import MixBlock


class Net(nn.Module):
    """A CIFAR-style CNN with group norm, or batch norm (``norm="batch"``: OpenMixup's ResNets'; the clean
    and the mixed batch then give another function together than apart, as OpenMixup runs them);
    ``layer3``'s 4x4 maps are the features, as OpenMixup's ResNet's third stage on 32x32 inputs (here
    16x16: a factor 4 to the input)."""

    def __init__(self, classes: int = 5, norm: str = "group"):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)

        def stage(i, o, stride):
            normed = nn.GroupNorm(2, o) if norm == "group" else nn.BatchNorm2d(o)
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1), normed, nn.ReLU())

        self.layer1, self.layer2, self.layer3 = stage(8, 8, 1), stage(8, 16, 2), stage(16, 32, 2)
        self.fc = nn.Linear(32, classes)

    def features(self, x):
        return self.layer3(self.layer2(self.layer1(self.stem(x))))

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


# ---------------------------------------------------------------- openmixup/models/heads/pmix_block.py


class PixelMixBlock(nn.Module):
    def __init__(self, in_channels, reduction=2, use_scale=True, unsampling_mode="nearest", lam_mul=0.0,
                 lam_mul_k=-1, lam_residual=False, value_neck=False, x_qk_concat=False,
                 mask_loss_mode="L1", mask_loss_margin=0):  # fmt: skip
        super().__init__()
        self.in_channels, self.reduction, self.use_scale = in_channels, reduction, use_scale
        self.inter_channels = max(in_channels // reduction, 1)
        self.unsampling_mode = [unsampling_mode]
        self.lam_concat = self.lam_concat_v = self.x_v_concat = False
        self.lam_mul = float(lam_mul) if float(lam_mul) > 0 else 0
        self.lam_mul_k = [lam_mul_k]
        self.lam_residual, self.x_qk_concat = lam_residual, x_qk_concat
        self.mask_loss_mode, self.mask_loss_margin = mask_loss_mode, max(mask_loss_margin, 0.0)
        for i in range(len(self.lam_mul_k)):
            self.lam_mul_k[i] = min(self.lam_mul_k[i], 10) if self.lam_mul_k[i] >= 0 else -1
        self.qk_in_channels = 2 * in_channels if x_qk_concat else in_channels
        if value_neck:  # ConvNeck(in, hid=in // 2, out=1, num_layers=2, kernel_size=1): conv-BN-ELU, conv
            self.value = nn.Sequential(
                nn.Conv2d(in_channels, in_channels // 2, 1, bias=False), nn.BatchNorm2d(in_channels // 2),
                nn.ELU(), nn.Conv2d(in_channels // 2, 1, 1, bias=False),
            )  # fmt: skip
        else:
            self.value = nn.Conv2d(in_channels, 1, kernel_size=1, stride=1)
        self.key = nn.Conv2d(self.qk_in_channels, self.inter_channels, 1) if x_qk_concat else None
        self.query = nn.Conv2d(self.qk_in_channels, self.inter_channels, 1)

    def embedded_gaussian(self, q_x, k_x):
        pairwise_weight = torch.matmul(q_x.type(q_x.dtype), k_x.type(q_x.dtype)).type(q_x.dtype)
        if self.use_scale:
            pairwise_weight /= q_x.shape[-1] ** 0.5
        pairwise_weight = pairwise_weight.type(q_x.dtype).softmax(dim=-1)
        return pairwise_weight

    def rescale_lam_mult(self, lam, k=1):
        assert k >= 0
        k += 1
        lam = float(lam)
        return 1 / (k - 2 / 3) * (4 / 3 * math.pow(lam, 3) - 2 * lam**2 + k * lam)

    def forward(self, x, lam, index, scale_factor, debug=False, unsampling_override=None):
        results = dict()
        n, _, h, w = x.size()
        x_lam = x
        x_lam_ = x[index, :]
        results = dict(x_lam=x_lam, x_lam_=x_lam_)
        if self.lam_mul > 0:
            _lam_mul_k = random.choices(self.lam_mul_k, k=1)[0]
            if _lam_mul_k >= 0:
                lam_rescale = self.rescale_lam_mult(lam, _lam_mul_k)
            else:
                lam_rescale = lam
            if self.lam_residual:
                x_lam = x_lam * (1 + lam_rescale * self.lam_mul)
                x_lam_ = x_lam_ * (1 + (1 - lam_rescale) * self.lam_mul)
            else:
                x_lam = x_lam * lam_rescale
                x_lam_ = x_lam_ * (1 - lam_rescale)
        v_ = x_lam_
        v_ = self.value(v_).view(n, 1, -1)
        v_ = v_.permute(0, 2, 1)
        if self.x_qk_concat:
            x_lam = torch.cat([x_lam, x_lam_], dim=1)
            x_lam_ = x_lam
        q_x = self.query(x_lam).view(n, self.inter_channels, -1).permute(0, 2, 1)
        if self.key is not None:
            k_x = self.key(x_lam_).view(n, self.inter_channels, -1)
        else:
            k_x = self.query(x_lam_).view(n, self.inter_channels, -1)
        pairwise_weight = self.embedded_gaussian(q_x, k_x)
        up_mode = random.choices(self.unsampling_mode, k=1)[0]
        mask_lam_ = torch.matmul(pairwise_weight.type(x.dtype), v_.type(x.dtype)).view(n, 1, h, w)
        mask_lam_ = F.interpolate(mask_lam_, scale_factor=scale_factor, mode=up_mode)
        mask_lam_ = torch.sigmoid(mask_lam_.type(x.dtype))
        mask = torch.cat([1 - mask_lam_, mask_lam_], dim=1)
        results["mask"] = mask
        return results

    def mask_loss(self, mask, lam):
        losses = dict()
        n, k, h, w = mask.size()
        if k > 1:
            mask = mask[:, 1, :, :].unsqueeze(1)
        m_mean = mask.sum() / (n * h * w)
        if self.mask_loss_mode == "L1":
            losses["loss"] = torch.clamp(torch.abs(1 - m_mean - lam) - self.mask_loss_margin, min=0.0).mean()
        elif self.mask_loss_mode == "L1+Variance":
            losses["loss"] = torch.clamp(
                torch.abs(1 - m_mean - lam) - self.mask_loss_margin, min=0.0
            ).mean() - 2 * torch.clamp((torch.sum((mask - m_mean) ** 2) / (n * h * w)), min=0.0)
        return losses


# ------------------------------------------------- openmixup/models/classifiers/automix.py (AutoMixup)


def openmixup_step(q, k, block, img, gt_label, lam, index_mb, index_bb, lam_margin=0.08, mask_loss=0.1):
    """forward_train with mix_shuffle_no_repeat=False, mask_adjust=0, debug off, head weights 1: the
    loss (one classifier: head_one_q, head_mix_q and head_mix_k are the models' own fc)."""
    indices = [index_mb, index_bb]
    feature = k.features(img)  # backbone_k(img)[0]
    # pixel_mixup
    lam_mb, lam_bb = lam[0], lam[1]
    scale_factor = 2**2  # CIFAR version, mask_layer=2
    mask_mb = block(feature, lam_mb, indices[0], scale_factor=scale_factor)["mask"]
    mask_bb = block(feature, lam_bb, indices[1], scale_factor=scale_factor)["mask"]
    mask_bb = mask_bb.clone().detach()
    if lam_margin >= lam_bb or lam_margin >= 1 - lam_bb:
        mask_bb[:, 0, :, :] = lam_bb
        mask_bb[:, 1, :, :] = 1 - lam_bb
    results = {"mask_loss": block.mask_loss(mask_mb, lam_mb)["loss"] * mask_loss}
    results["img_mix_mb"] = img * mask_mb[:, 0, :, :].unsqueeze(1) + img[indices[0], :] * mask_mb[
        :, 1, :, :
    ].unsqueeze(1)
    results["img_mix_bb"] = img * mask_bb[:, 0, :, :].unsqueeze(1) + img[indices[1], :] * mask_bb[
        :, 1, :, :
    ].unsqueeze(1)
    # forward_k (ClsMixupHead, CE: criterion(score, y_a) * lam + criterion(score, y_b) * (1 - lam))
    pred_mix_k = k(results["img_mix_mb"])
    loss_mix_k = F.cross_entropy(pred_mix_k, gt_label) * lam_mb + F.cross_entropy(
        pred_mix_k, gt_label[index_mb]
    ) * (1 - lam_mb)
    # forward_q
    loss_one_q = F.cross_entropy(q(img), gt_label)
    pred_mix_q = q(results["img_mix_bb"])
    loss_mix_q = F.cross_entropy(pred_mix_q, gt_label) * lam_bb + F.cross_entropy(
        pred_mix_q, gt_label[index_bb]
    ) * (1 - lam_bb)
    loss = loss_mix_q + loss_one_q + loss_mix_k + results["mask_loss"]
    return loss, mask_mb, results["img_mix_bb"]


def openmixup_mask_adjust(mask_bb, lam):
    """forward_train's ``if self.mask_adjust > np.random.rand()`` branch (``lam[0]``: the Mix Block's lam),
    on a copy of ``mask_bb`` ``(N, 2, H, W)``."""
    mask_bb = mask_bb.clone()
    epsilon = 1e-8
    _mask = mask_bb[:, 0, :, :].squeeze()  # [N, H, W], _mask for lam
    _mask = _mask.clamp(min=epsilon, max=1 - epsilon)
    _mean = _mask.mean(dim=[1, 2]).squeeze()  # [N, 1, 1] -> [N]
    idx_larg = _mean[:] > lam[0] + epsilon  # index of mean > lam_bb
    idx_less = _mean[:] < lam[0] - epsilon  # index of mean < lam_bb
    # if mean > lam_bb
    mask_bb[idx_larg == True, 0, :, :] = _mask[idx_larg == True, :, :] * (  # noqa: E712
        lam[0] / _mean[idx_larg == True].view(-1, 1, 1)  # noqa: E712
    )
    mask_bb[idx_larg == True, 1, :, :] = 1 - mask_bb[idx_larg == True, 0, :, :]  # noqa: E712
    # elif mean < lam_bb
    mask_bb[idx_less == True, 1, :, :] = (1 - _mask[idx_less == True, :, :]) * (  # noqa: E712
        (1 - lam[0]) / (1 - _mean[idx_less == True].view(-1, 1, 1))  # noqa: E712
    )
    mask_bb[idx_less == True, 0, :, :] = 1 - mask_bb[idx_less == True, 1, :, :]  # noqa: E712
    return mask_bb


@torch.no_grad()
def momentum_update(q, k, momentum):
    for param_q, param_k in zip(q.parameters(), k.parameters(), strict=True):
        param_k.data = param_k.data * momentum + param_q.data * (1.0 - momentum)


def cosine_schedule(cur_iter, max_iters, base_m=0.999, end_momentum=0.999999, adjust_scope=(0.1, 1.0)):
    """CosineScheduleHook.before_train_iter with warming_up="constant", restart_step never; the momentum
    set (None: left as it was)."""
    max_iter = int(max_iters * adjust_scope[1]) if adjust_scope[1] < 1 else max_iters
    min_iter = int(max_iters * adjust_scope[0]) if adjust_scope[0] > 0 else 0
    if min_iter <= cur_iter and cur_iter <= max_iter:
        return (
            end_momentum - (end_momentum - base_m) * (math.cos(math.pi * cur_iter / float(max_iter)) + 1) / 2
        )
    if cur_iter < min_iter:
        return base_m
    return None


# ------------------------------------------------------------------------------------------- tests


def reference_block(ours: MixBlock, samix: bool) -> PixelMixBlock:
    theirs = PixelMixBlock(
        ours.channels, unsampling_mode=ours.upsampling[0], lam_mul=1.0 if samix else 0.0,
        lam_mul_k=0.25 if samix else -1, lam_residual=samix, value_neck=samix, x_qk_concat=samix,
        mask_loss_mode="L1+Variance" if samix else "L1", mask_loss_margin=0.1,
    ).double()  # fmt: skip
    theirs.load_state_dict(ours.state_dict())
    return theirs


def batch(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 0][:n])


@pytest.mark.parametrize("cls", [AutoMix, SAMix])
def test_the_mix_block_equals_openmixups_on_the_same_features(cls):
    torch.manual_seed(0)
    mix = cls("input", "layer3", channels=32)
    ours = mix.mix_block.double()
    for p in ours.parameters():  # (OpenMixup's N(0, 0.01) makes every mask about 0.5: test larger weights)
        p.data.normal_(0, 0.3)
    theirs = reference_block(ours, cls is SAMix)
    x = torch.randn(5, 32, 4, 4, dtype=torch.float64)
    index = torch.tensor([3, 0, 4, 1, 2])
    got = ours(x, 0.3, index, (16, 16))
    expected = theirs(x, 0.3, index, scale_factor=4)["mask"]
    torch.testing.assert_close(got, expected[:, 1:], rtol=1e-12, atol=1e-14)
    assert float(got.detach().std()) > 0.05  # (a mask, not a constant)
    from mixhook.mixers.mixblock import mask_loss

    ours_loss = mask_loss(got, 0.3, mix.mask_loss_mode, mix.mask_margin)
    torch.testing.assert_close(ours_loss, theirs.mask_loss(expected, 0.3)["loss"], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls", [AutoMix, SAMix])
@pytest.mark.parametrize(
    ("lam_bb", "norm"), [(0.35, "group"), (0.05, "group"), (0.35, "batch")]
)  # (0.05: within lam_margin, plain mixup for the model)
def test_one_training_step_equals_openmixups_loss_and_gradients(cls, lam_bb, norm):
    """One step equals OpenMixup's forward_train (copied below): the loss, the model's and the Mix Block's
    gradients and, with batch norm, the running statistics of its two forwards (the clean batch, then its
    mix: normalised apart, though mixhook runs them as one forward of 2B rows)."""
    torch.manual_seed(1)
    model = Net(norm=norm).double()
    mix = cls("input", "layer3")
    img, y = batch()
    index_mb, index_bb = torch.tensor([5, 3, 0, 1, 2, 4]), torch.tensor([1, 2, 3, 4, 5, 0])
    with mix.attach(model):
        block = mix.mix_block.double()
        for p in block.parameters():
            p.data.normal_(0, 0.2)
        q_ref, k_ref = copy.deepcopy(model), copy.deepcopy(mix.momentum_model).double()
        block_ref = reference_block(block, cls is SAMix)
        mix.momentum_model.double()
        mix.pin(lam=lam_bb, index=index_bb, lam_mb=0.6, index_mb=index_mb)
        logits = model(img)
        loss = mix.loss(F.cross_entropy, logits, y)
        loss.backward()
    expected, mask_mb, mixed_bb = openmixup_step(
        q_ref, k_ref, block_ref, img, y, [0.6, lam_bb], index_mb, index_bb
    )
    expected.backward()
    assert logits.shape == (12, 5)  # the clean rows, then the mixed ones
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    for (name, p), r in zip(model.named_parameters(), q_ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-13, msg=name)
    for (name, p), r in zip(block.named_parameters(), block_ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-13, msg=name)
    assert all(p.grad is None for p in mix.momentum_model.parameters())
    for (name, b), r in zip(model.named_buffers(), q_ref.buffers(), strict=True):
        torch.testing.assert_close(b, r, rtol=1e-12, atol=1e-14, msg=name)  # (batch norm's, two forwards')
    torch.testing.assert_close(
        mix.state_for(logits).loss_inputs["block"][1], mask_mb[:, 1:], rtol=1e-12, atol=1e-14
    )
    own = mix.last.weights[:, None]
    torch.testing.assert_close(own * img + (1 - own) * img[index_bb], mixed_bb, rtol=1e-12, atol=1e-14)


def test_the_momentum_copy_follows_openmixups_update_and_schedule():
    torch.manual_seed(2)
    model = Net().double()
    mix = AutoMix("input", "layer3", total_steps=40)
    img, y = batch()
    with mix.attach(model):
        mix.momentum_model.double()
        mix.mix_block.double()
        k_ref, q = copy.deepcopy(mix.momentum_model), model
        opt = torch.optim.SGD([*model.parameters(), *mix.parameters()], lr=0.5)
        for step in range(3):
            mix.loss(F.cross_entropy, model(img), y).backward()  # (the update of step - 1 ran first)
            if step:
                for a, b in zip(mix.momentum_model.parameters(), k_ref.parameters(), strict=True):
                    assert torch.equal(a, b)
            opt.step()
            opt.zero_grad()
            momentum_update(q, k_ref, cosine_schedule(step, 40))
        assert mix.updates == 2
        mix.catch_up()  # (state_dict does it: a checkpoint holds the copy after the last step)
        assert mix.updates == 3
        assert all(
            torch.equal(a, b)
            for a, b in zip(mix.momentum_model.parameters(), k_ref.parameters(), strict=True)
        )
        assert not torch.equal(next(mix.momentum_model.parameters()), next(model.parameters()))
    moments = [cosine_schedule(t, 40) for t in range(41)]
    assert [mix.momentum_at(t) for t in range(41)] == moments
    assert moments[0] == moments[3] == 0.999 and moments[40] == pytest.approx(0.999999)


def test_a_step_that_leaves_the_mix_block_out_is_refused_in_one_line():
    model = Net().double()
    mix = AutoMix("input", "layer3")
    img, y = batch()
    with mix.attach(model):
        mix.momentum_model.double()
        mix.mix_block.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mix.loss(F.cross_entropy, model(img), y).backward()
        opt.step()
        with pytest.raises(
            RuntimeError, match=r"stepped the model but not the Mix Block.*mix.parameters\(\)"
        ):
            model(img)


@pytest.mark.parametrize("cls", [AutoMix, AdAutoMix])  # (AdAutoMix: its adversarial turn too)
def test_state_dict_resumes_the_mix_block_the_copy_and_the_draws(cls):
    def run(resume_at=None):
        torch.manual_seed(3)
        model = Net().double()
        mix = cls("input", "layer3", generator=torch.Generator().manual_seed(4), total_steps=10)
        img, y = batch()
        losses = []
        with mix.attach(model):
            mix.momentum_model.double()
            mix.mix_block.double()
            opt = torch.optim.SGD([*model.parameters(), *mix.parameters()], lr=0.2, momentum=0.9)
            for step in range(4):
                if step == resume_at:
                    saved = copy.deepcopy(
                        {"m": model.state_dict(), "o": opt.state_dict(), "x": mix.state_dict()}
                    )
                    mix.remove()
                    model, mix = Net().double(), cls("input", "layer3", total_steps=10)
                    model.load_state_dict(saved["m"])
                    mix.attach(model)
                    mix.momentum_model.double()
                    mix.mix_block.double()
                    mix.load_state_dict(saved["x"])
                    opt = torch.optim.SGD([*model.parameters(), *mix.parameters()], lr=0.2, momentum=0.9)
                    opt.load_state_dict(saved["o"])
                loss = mix.loss(F.cross_entropy, model(img), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
        return losses

    assert run() == run(resume_at=3)  # (an odd step: AdAutoMix resumes off its turn unless kept)


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="mask_loss_mode must be one of L1, L1\\+Variance"):
        AutoMix("input", "layer3", mask_loss_mode="L3")
    with pytest.raises(ValueError, match="upsampling must be among nearest, bilinear, bicubic"):
        AutoMix("input", "layer3", upsampling="area")
    with pytest.raises(RuntimeError, match="attach first, or pass channels="):
        AutoMix("input", "layer3").parameters()
    from mixhook.layers import UnknownLayerError

    with pytest.raises(UnknownLayerError):
        AutoMix("input", "layer9").attach(Net())
    model, x = Net(), batch()[0].float()
    with AutoMix("input", "layer3", channels=16).attach(model):
        with pytest.raises(
            ValueError, match="has 32 channels but the Mix Block was built for 16; pass channels=32"
        ):
            model(x)
    with AutoMix("fc", "layer3").attach(model), pytest.raises(TypeError, match=r"needs a \(B, C, H, W\) map"):
        model(x)


def test_masks_gives_the_mask_a_training_forward_mixes_with():
    torch.manual_seed(5)
    model = Net().double()
    mix = AutoMix("input", "layer3")
    img, y = batch()
    index = torch.tensor([1, 2, 3, 4, 5, 0])
    with mix.attach(model):
        for p in mix.mix_block.parameters():
            p.data.normal_(0, 0.2)
        mix.pin(lam=0.4, index=index)
        model(img)
        pictured = mix.masks(img, 0.4, index)
        assert model.training and mix.momentum_model.training  # (modes restored)
    torch.testing.assert_close(pictured, mix.last.info["mask"], rtol=0, atol=0)
    assert pictured.shape == (6, 1, 16, 16) and float(pictured.std()) > 0.01
    with pytest.raises(RuntimeError, match="attach it to the model first"):
        AutoMix("input", "layer3").masks(img, 0.4, index)


@pytest.mark.parametrize("cls", [METHODS[name] for name in methods_with(family="learned")])
def test_pin_last_repeats_the_mix_and_its_record_keeps_no_features_and_no_graph(cls):
    """pin_last repeats a forward's draws (lam, partners, the Mix Block's own), and its mix where the model
    and the copy did not change; what it keeps for that (between steps) holds neither the copy's features
    nor the Mix Block's forward, which a repeat computes anew (computed_each_forward), nor any grad_fn."""
    torch.manual_seed(5)
    model = Net().double()
    mix = cls("input", "layer3", generator=torch.Generator().manual_seed(3))
    img, y = batch()
    with mix.attach(model):
        logits = model(img)
        mix.loss(F.cross_entropy, logits, y).backward()  # (no optimizer step: the same model, the same copy)
        first, values = mix.last, mix.last_forward.pins.values
        assert not {"features", "mb", "k_clean"} & values.keys()
        assert not any(isinstance(v, torch.Tensor) and v.grad_fn is not None for v in values.values())
        mix.pin_last()
        again = model(img)
    torch.testing.assert_close(again, logits, rtol=0, atol=0)
    assert torch.equal(mix.last.info["mask"], first.info["mask"]) and torch.equal(mix.last.index, first.index)


@pytest.mark.parametrize("norm", ["group", "batch"])
def test_a_mix_inside_activation_checkpointing_has_the_unchecked_gradients(norm):
    """The mixed layer and (batch norm: normalising the clean and the mixed rows apart) the layer after it
    recomputed in backward: the gradients of the forward without checkpoints."""
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
        model = cls(norm=norm).double()
        mix = SAMix("layer2", "layer1", generator=torch.Generator().manual_seed(2))
        img, y = batch()
        with mix.attach(model):
            mix.mix_block.double()
            mix.momentum_model.double()
            mix.loss(F.cross_entropy, model(img), y).backward()
        grads.append([p.grad for p in [*model.parameters(), *mix.parameters()]])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_two_forwards_before_their_backward_with_the_copy_checkpointed_are_refused_in_one_line():
    from torch.utils.checkpoint import checkpoint

    class Checked(Net):
        def features(self, x):
            return self.layer3(checkpoint(self.layer2, self.layer1(self.stem(x)), use_reentrant=False))

    model, (img, y) = Checked().double(), batch()
    mix = AutoMix("layer2", "layer1")
    with mix.attach(model):
        mix.mix_block.double()
        mix.momentum_model.double()
        first = mix.loss(F.cross_entropy, model(img), y)
        with pytest.raises(RuntimeError, match="two training forwards before their backward") as err:
            model(img)
        assert "\n" not in str(err.value)
        first.backward()  # (the first one's recomputation still finds its mix)
        mix.loss(F.cross_entropy, model(img), y).backward()


@pytest.mark.parametrize("schedule", ["cosine", "lambda", "sequential"])
def test_the_mix_block_joins_a_trainers_optimizer_and_follows_its_schedule(schedule):
    """What the trainer adapters do (integrations/draws.py: join_optimizer): the Mix Block as one more
    group with the first group's options, scheduled as the first group at every step; a second join, or a
    mixer without parameters, adds nothing."""
    from torch.optim import lr_scheduler

    from mixhook import ManifoldMixup
    from mixhook.integrations.draws import join_optimizer

    model = Net()
    mix = AutoMix("input", "layer3")
    with mix.attach(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9, weight_decay=1e-4)
        made = {
            "cosine": lambda: lr_scheduler.CosineAnnealingLR(opt, T_max=5),
            "lambda": lambda: lr_scheduler.LambdaLR(opt, lambda step: 0.5**step),
            "sequential": lambda: lr_scheduler.SequentialLR(
                opt,
                [lr_scheduler.ConstantLR(opt, 0.5, total_iters=2), lr_scheduler.ExponentialLR(opt, 0.7)],
                [2],
            ),
        }[schedule]()
        assert join_optimizer(mix, opt, [made]) and not join_optimizer(mix, opt, [made])
        assert not join_optimizer(ManifoldMixup("input"), opt)
        group = opt.param_groups[1]
        assert {id(p) for p in group["params"]} == {id(p) for p in mix.parameters()}
        assert group["momentum"] == 0.9 and group["weight_decay"] == 1e-4
        for _ in range(6):
            opt.step()
            made.step()
            assert opt.param_groups[1]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["group", "batch"])
def test_a_compiled_model_trains_as_the_eager_one(norm):
    """Under torch.compile the mixer's hooks run between graphs (its momentum copy's forwards are eager),
    batch norm's clean and mixed rows apart as eagerly: the same losses, step after step."""
    losses = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model, (img, y) = Net(norm=norm).double(), batch()
        mix = AutoMix("input", "layer3", generator=torch.Generator().manual_seed(1))
        with mix.attach(model):
            forward = torch.compile(model, backend="aot_eager") if compiled else model
            opt = torch.optim.SGD([*model.parameters(), *mix.parameters()], lr=0.1)
            for _ in range(3):
                loss = mix.loss(F.cross_entropy, forward(img), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(float(loss.detach()))
    assert losses[:3] == losses[3:]


def test_the_momentum_copy_follows_its_own_model_across_attachments():
    first, other = Net(), Net()
    mix = AutoMix("input", "layer3")
    with mix.attach(first):
        copied = mix.momentum_model
        with torch.no_grad():
            next(copied.parameters()).add_(1.0)  # (an EMA that has moved)
    with mix.attach(first):  # detached and attached again: the same copy continues
        assert mix.momentum_model is copied
    with mix.attach(other):  # another model: a copy of it
        assert mix.momentum_model is not copied
        assert all(
            torch.equal(a, b)
            for a, b in zip(mix.momentum_model.parameters(), other.parameters(), strict=True)
        )


def test_the_mix_block_may_have_its_own_learning_rate_in_any_optimizer():
    """block_lr and block_momentum (OpenMixup's WRN config: 0.03 and 0): the adapters' group and the app's
    optimizer take them; a cosine schedule scales both groups alike."""
    from torch.optim import lr_scheduler

    from harness.app_runs import config
    from mixhook.integrations.draws import join_optimizer

    model = Net()
    mix = AutoMix("input", "layer3", block_lr=0.03, block_momentum=0.0)
    assert mix.parameter_options() == {"lr": 0.03, "momentum": 0.0}
    with mix.attach(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        cosine = lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        join_optimizer(mix, opt, [cosine])
        assert opt.param_groups[1]["lr"] == 0.03 and opt.param_groups[1]["momentum"] == 0.0
        for _ in range(4):
            opt.step()
            cosine.step()
            assert opt.param_groups[1]["lr"] / opt.param_groups[0]["lr"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="block_lr must be"):
        AutoMix("input", "layer3", block_lr=0)
    from mixhook.app.build import build

    run = build(config("mixup=automix", "model=resnet32", "trainer.epochs=3"))  # (its config's own rate)
    try:
        groups = run.optimizer.param_groups
        assert (
            len(groups) == 2 and groups[1]["lr"] == 0.005 and groups[0]["lr"] == run.optimizer.defaults["lr"]
        )
        assert groups[1]["momentum"] == 0.0 and groups[0]["momentum"] == 0.9
        assert {id(p) for p in groups[1]["params"]} == {id(p) for p in run.mixup.parameters()}
        # the momentum schedule spans the run (span(): the app's epochs times an epoch's steps)
        assert run.mixup.total_steps == 3 * len(run.data.train) > 0
    finally:
        for handle in run.handles:
            handle.remove()
    run = build(config("mixup=automix", "model=resnet32", "+mixup.total_steps=7"))
    try:
        assert run.mixup.total_steps == 7  # (given: kept)
    finally:
        for handle in run.handles:
            handle.remove()


def _resnet_tv():
    import torchvision

    return torchvision.models.resnet18(num_classes=3)


@pytest.mark.parametrize(
    ("build", "layer", "features", "channels"),
    [
        (_resnet_tv, "layer2", "layer3", None),  # torchvision's ResNet: NCHW stages
        ("convnext_timm", "stages.1", "stages.2", None),  # timm's ConvNeXt: NCHW stages (NHWC inside)
        ("swin_timm", "layers.1", "layers.0", 8),  # timm's Swin: (B, H, W, C) stages, no conv to read
    ],
    ids=["torchvision-resnet18", "timm-convnext", "timm-swin"],
)
def test_on_real_architectures_the_mix_at_its_layer_is_the_hand_edited_one(build, layer, features, channels):
    """The zoo's oracle at the mask's layer: the logits of a mixed forward equal the model's with its
    layer's output replaced by hand, ``h (1 - m) + h[index] m`` with the mask the mix recorded (in the
    map's own layout), in float64; the mask varies over the map."""
    from tests.core import test_layouts

    make = getattr(test_layouts, build) if isinstance(build, str) else build
    torch.manual_seed(0)
    model = make().double().train()
    for m in model.modules():  # (stochastic layers off: the two forwards must see the same network)
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    index = torch.tensor([2, 3, 1, 0])
    nhwc = channels is not None  # (the Swin case: its channels stated, its maps channels-last)
    mix = AutoMix(
        layer,
        features,
        channels,
        clean_weight=0.0,
        lam_margin=0.0,
        generator=torch.Generator().manual_seed(3),
    )
    with mix.attach(model):
        for p in mix.mix_block.parameters():
            p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
        mix.pin(lam=0.4, index=index)
        got = model(x)
        m = mix.last.info["mask"]  # (B, 1, H, W): the partner's share, channels first
    assert float(m.std()) > 1e-3

    def hand(module, args, h):
        share = m.permute(0, 2, 3, 1) if nhwc else m
        return h * (1 - share) + h[index] * share

    handle = model.get_submodule(layer).register_forward_hook(hand)
    try:
        expected = model(x)
    finally:
        handle.remove()
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_mask_adjust_equals_openmixups_bit_for_bit():
    """``mask_adjust``'s rescaling of the model's mask toward the Mix Block's lam: rows whose own share is
    above it, below it, and at it (left as they are), equal to OpenMixup's lines to the last bit."""
    from mixhook.mixers.automix import _adjusted

    g = torch.Generator().manual_seed(3)
    m = torch.rand(5, 1, 4, 4, generator=g, dtype=torch.float64)
    m[0] *= 0.1  # (own share high: above lam)
    m[1] = 0.3 + 0.7 * m[1]  # (own share low: below lam)
    wiggle = 0.1 * torch.rand(4, 4, generator=g, dtype=torch.float64)
    m[2, 0] = 0.2 + wiggle - wiggle.mean()  # (own share at lam on average: kept as it is)
    assert not torch.equal(1 - (1 - m[2]), m[2])  # (a row whose mask 1 - (1 - m) would not give back)
    own, partner = _adjusted(m, 0.8)
    expected = openmixup_mask_adjust(torch.cat([1 - m, m], dim=1), [0.8, 0.3])
    assert torch.equal(own[:, 0], expected[:, 0]) and torch.equal(partner[:, 0], expected[:, 1])
    assert not torch.equal(own[:, 0], 1 - m[:, 0])  # (it rescaled some rows)


@pytest.mark.parametrize("tokens", ["auto", (4, 4)])
def test_a_vits_tokens_are_read_as_the_map_of_their_patch_tokens(tokens):
    """``features`` at a ViT block (timm's, a class token and a 4x4 grid): the Mix Block reads the
    ``(B, D, 4, 4)`` map of the copy's patch tokens at that block, its width read from the block; the
    mask it made from that map by hand is the one the model's input was mixed with, and the logits are
    the hand-mixed input's. Without ``feature_tokens`` the tokens are refused in one line naming it."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=3, depth=2
    ).double()
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    index = torch.tensor([2, 3, 1, 0])
    mix = AutoMix("input", "blocks.0", feature_tokens=tokens, clean_weight=0.0, lam_margin=0.0)
    with mix.attach(model):
        for p in mix.mix_block.parameters():
            p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(4))
        mix.pin(lam=0.4, index=index)
        got = model(x)
        m = mix.last.info["mask"]
        seen = []
        handle = mix.momentum_model.blocks[0].register_forward_hook(lambda mod, a, out: seen.append(out))
        with torch.no_grad():
            mix.momentum_model.eval()(x)
        handle.remove()
        grid = seen[0][:, 1:].transpose(1, 2).reshape(4, 192, 4, 4)  # (the class token left out)
        with torch.no_grad():
            expected_m = mix.mix_block(grid, 0.4, index, (32, 32), "nearest", -1)
    assert mix.mix_block.channels == 192 and float(m.std()) > 1e-3
    torch.testing.assert_close(m, expected_m, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, model(x * (1 - m) + x[index] * m), rtol=1e-10, atol=1e-12)
    with pytest.raises(TypeError) as error, AutoMix("input", "blocks.0", channels=192).attach(model):
        model(x)
    assert "feature_tokens=" in str(error.value) and "\n" not in str(error.value)
