"""The policies (mixhook.policies): each against its authors' code on the same draws, or against the paper's
formula written out; at the input and at a hidden layer against a hand-edited forward in float64 (logits and
gradients); under activation checkpointing, pin_last, a copy, on the meta device (no host read); and the
one-line refusals."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import CMixup, CutMix, ManifoldMixup, OneOf, RankMixup, RegMixup
from mixhook.engine.saliency import gaussian_blur
from mixhook.policies import (
    BalancedMixup,
    DecoupledLoss,
    KernelWarping,
    LocalWeights,
    PartnerBatch,
    Remix,
    SaliencyPairing,
    SUMix,
    greedy_cycle,
    remix_lam,
    symmetric_beta_cdf,
)
from mixhook.policies.lam import warp_parameters
from mixhook.policies.partners import gradient_saliency
from tests.guidedmixup_reference import distance_function, onecycle_cover
from tests.helpers import per_sample_ce

scipy_special = pytest.importorskip("scipy.special")
scipy_stats = pytest.importorskip("scipy.stats")


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 4)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        h = torch.tanh(self.block(h))
        return self.head(h.flatten(1))


def grads(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)


def assert_all_close(mine, theirs, **tol):
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, **tol)


# ------------------------------------------------------------------------------------ the Beta CDF


@pytest.mark.slow
def test_the_symmetric_beta_cdf_is_scipys_within_its_stated_error():
    rng = np.random.default_rng(0)
    for log_a in np.linspace(-3, 9, 49):
        a = 10.0**log_a
        x = np.concatenate([rng.random(400), 0.5 + (rng.random(400) - 0.5) * 10 / math.sqrt(a + 1)])
        x = np.clip(np.concatenate([x, [0.0, 1.0, 0.5, 1e-300, 1 - 1e-16]]), 0, 1)
        got = symmetric_beta_cdf(torch.tensor(x), torch.tensor(a)).numpy()
        ref = scipy_special.betainc(a, a, x)
        bound = 1e-10 if a <= 2000 else 3e-8
        assert np.abs(got - ref).max() < bound, (a, np.abs(got - ref).max())
    # monotone in x and in [0, 1]
    x = torch.linspace(0, 1, 2001, dtype=torch.float64)
    for a in (0.01, 1.0, 7.3, 1999.0, 2001.0, 1e6):
        y = symmetric_beta_cdf(x, torch.tensor(a))
        assert (y.diff() >= -1e-12).all() and y.min() >= 0 and y.max() <= 1


def test_the_beta_cdf_reads_nothing_on_the_host():
    x = torch.rand(7, device="meta", dtype=torch.float64)
    a = torch.rand(7, device="meta", dtype=torch.float64)
    assert symmetric_beta_cdf(x, a).device.type == "meta"


# ------------------------------------------------------------------------------------ SK-Mixup


# From qbouniot/sim_kernel_mixup classification/torch_uncertainty/transforms/mixup.py (4fa2237): the kernel,
# the warping and KernelMixup.__call__'s warping="beta_cdf" branch after its draw (lam and index given here
# instead of drawn; its _linear_mixing casts lam to float32, left out so that the comparison is in float64).
def sim_gauss_kernel(dist, tau_max: float = 1.0, tau_std: float = 0.5, inverse_cdf=False) -> float:
    dist_rate = tau_max * np.exp(-(dist - 1) / (2 * tau_std * tau_std))
    if inverse_cdf:
        return dist_rate
    return 1 / (dist_rate + 1e-12)


def beta_warping(x, alpha: float = 1.0, eps: float = 1e-12, inverse_cdf: bool = False) -> float:
    if inverse_cdf:
        return scipy_stats.beta.ppf(x, a=alpha + eps, b=alpha + eps)
    return scipy_stats.beta.cdf(x, a=alpha + eps, b=alpha + eps)


def kernel_mixup(x, y, feats, lam, index, num_classes, tau_max, tau_std):
    dist = (feats - feats[index]).pow(2).sum([i for i in range(len(feats.size())) if i > 0]).cpu().numpy()
    dist = dist / dist.mean()
    warp_param = sim_gauss_kernel(dist, tau_max, tau_std)
    k_lam = torch.tensor(beta_warping(lam, warp_param, inverse_cdf=False), device=x.device)
    kl = k_lam.view(-1, *[1 for _ in range(x.ndim - 1)])
    mixed_x = kl * x + (1 - kl) * x[index, :]
    y1, y2 = F.one_hot(y, num_classes), F.one_hot(y[index], num_classes)
    mixed_y = k_lam.view(-1, 1) * y1 + (1 - k_lam.view(-1, 1)) * y2
    return mixed_x, mixed_y, k_lam, warp_param


# From ENSTA-U2IS-AI/torch-uncertainty src/torch_uncertainty/transforms/mixup.py (0d0df2b2): its port,
# which divides d - 1 by the mean distance (the authors: d, then subtract 1).
def tu_sim_gauss_kernel(dist, tau_max: float = 1.0, tau_std: float = 0.5) -> float:
    dist_rate = tau_max * np.exp(-(dist - 1) / (np.mean(dist) * 2 * tau_std * tau_std))
    return 1 / (dist_rate + 1e-12)


@pytest.mark.parametrize("tau_max,tau_std", [(1.0, 0.5), (1.0, 0.25), (2.0, 1.0)])
def test_kernel_warping_at_the_input_is_the_authors_kernel_mixup(tau_max, tau_std):
    model = mlp()
    x, y = torch.randn(8, 5, dtype=torch.float64) * 3, torch.randint(0, 4, (8,))
    lam, index = 0.37, torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])
    mix = ManifoldMixup("input", alpha=1.0).use(KernelWarping(tau_max, tau_std))
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with mix.attach(model):
        mix.pin(lam=lam, index=index)
        logits = model(x)
        soft = mix.targets(y, 4, dtype=torch.float64, logits=logits)
    mixed_x, mixed_y, k_lam, warp = kernel_mixup(x, y, x, lam, index, 4, tau_max, tau_std)
    assert (k_lam - lam).abs().min() > 0.01  # (the warping changes every lam)
    torch.testing.assert_close(mix.last.lam, k_lam, rtol=0, atol=1e-10)
    torch.testing.assert_close(mix.last.info["warp"], torch.as_tensor(warp), rtol=1e-12, atol=0)
    torch.testing.assert_close(seen[0], mixed_x, rtol=0, atol=1e-9)
    torch.testing.assert_close(soft, mixed_y.double(), rtol=0, atol=1e-10)


def test_kernel_warping_is_torch_uncertaintys_where_the_mean_distance_is_one():
    x = torch.randn(8, 5, dtype=torch.float64)
    index = torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])
    d = (x - x[index]).square().sum(1)
    x = x / d.mean().sqrt()  # the mean squared distance is now 1
    d = (x - x[index]).square().sum(1).numpy()
    mix = ManifoldMixup("input", alpha=1.0).use(KernelWarping(1.0, 0.5))
    with mix.attach(mlp()) as _:
        mix.pin(lam=0.3, index=index)
        mix.model(x)
    torch.testing.assert_close(
        mix.last.info["warp"], torch.as_tensor(tu_sim_gauss_kernel(d)), rtol=1e-12, atol=0
    )


def test_kernel_warping_at_a_hidden_layer_is_the_hand_edited_forward_with_given_or_layer_distances():
    model = mlp()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 4, (8,))
    lam, index = 0.62, torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])
    feats = torch.randn(8, 3, dtype=torch.float64)
    for given in (None, feats):
        mix = ManifoldMixup("1", alpha=1.0).use(KernelWarping())
        with mix.attach(model):
            mix.pin(lam=lam, index=index)
            if given is not None:
                mix.use_features(given)
            logits = model(x)
            loss = mix.loss(per_sample_ce, logits, y).mean()
        mine = grads(model, loss)
        h = model[1](model[0](x))
        f = h if given is None else given
        d = (f - f[index]).square().sum(1)
        d = (d / d.mean()).detach().numpy()
        k = torch.as_tensor(beta_warping(lam, sim_gauss_kernel(d))).view(-1, 1)
        theirs_logits = model[2:](k * h + (1 - k) * h[index])
        k = k.view(-1)
        theirs = (
            k * per_sample_ce(theirs_logits, y) + (1 - k) * per_sample_ce(theirs_logits, y[index])
        ).mean()
        torch.testing.assert_close(logits, theirs_logits, rtol=1e-9, atol=1e-10)
        assert_all_close(mine, grads(model, theirs), rtol=1e-9, atol=1e-10)


def test_warp_parameters_take_the_mean_over_the_batchs_own_rows():
    d = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64)  # the last row: a partner batch's
    expected = 1 / (torch.exp(-(d / 2.0 - 1) / (2 * 0.5 * 0.5)) + 1e-12)  # the mean of the first three: 2
    torch.testing.assert_close(warp_parameters(d, 1.0, 0.5, own=3), expected)


# ------------------------------------------------------------------------------------ Local Mixup


def test_local_weights_are_the_authors_exponential_weights_and_the_papers_threshold():
    model = mlp()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 4, (8,))
    lam, index = 0.3, torch.tensor([4, 5, 6, 7, 0, 1, 2, 3])
    for policy in (LocalWeights(sigma=0.7), LocalWeights(epsilon=2.5)):
        mix = ManifoldMixup("input", alpha=1.0).use(policy)
        with mix.attach(model):
            mix.pin(lam=lam, index=index)
            logits = model(x)
            loss = mix.loss(per_sample_ce, logits, y).mean()
        # raphael-baena/Local-Mixup fashionmnist.py (84ee255): mixup_data's weight and train()'s loss
        dist_l2 = torch.sqrt(((x.flatten(start_dim=1) - x[index, :].flatten(start_dim=1)) ** 2).sum(dim=1))
        if policy.sigma is not None:
            dist = torch.exp(-policy.sigma * dist_l2)
        else:  # the paper's thresholded weight, Eq. 4
            dist = (dist_l2 <= policy.epsilon).double()
        assert 0 < dist.sum() < 8
        out = model(lam * x + (1 - lam) * x[index])
        per = lam * per_sample_ce(out, y) + (1 - lam) * per_sample_ce(out, y[index])
        theirs = (per * dist).sum() / dist.sum()
        torch.testing.assert_close(loss, theirs, rtol=1e-12, atol=1e-14)
        assert_all_close(grads(model, loss), grads(model, theirs), rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mix.last.info["pair_weights"], dist)
        with pytest.raises(ValueError, match="train with loss"):
            mix.targets(y, 4, logits=logits)


def test_a_batch_whose_pairs_are_all_too_far_apart_has_zero_loss_in_float32():
    """Local Mixup's weights all 0 (every pair farther than epsilon): the loss is 0, as documented, with a
    zero gradient; in float32 the normalisation had overflowed (0 * B / tiny is 0 * inf: NaN, which the
    app reported as a NaN loss at the first step of Fashion-MNIST, whose pairs are farther apart than the
    digits' epsilon)."""
    model = mlp().float()
    x, y = torch.randn(8, 5), torch.randint(0, 4, (8,))
    mix = ManifoldMixup("input", alpha=1.0).use(LocalWeights(epsilon=1e-3))
    with mix.attach(model):
        mix.pin(lam=0.3, index=torch.tensor([4, 5, 6, 7, 0, 1, 2, 3]))  # (no row its own partner)
        loss = mix.loss(per_sample_ce, model(x), y).mean()
    assert loss.dtype == torch.float32 and loss.item() == 0.0
    loss.backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


# ------------------------------------------------------------------------------------ Remix


def test_remix_is_the_papers_rule():
    counts = [500, 100, 20, 5]
    lam, index = 0.3, torch.tensor([1, 2, 3, 0, 5, 6, 7, 4])
    y = torch.tensor([0, 1, 2, 3, 0, 3, 1, 2])
    for lam in (0.3, 0.45, 0.7, 0.95):
        got = remix_lam(torch.tensor(lam, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)[y],
                        torch.tensor(counts, dtype=torch.float64)[y[index]], 3.0, 0.5)  # fmt: skip
        for i in range(8):  # Chou et al. 2020, Eq. 3, written out
            n_i, n_j = counts[y[i]], counts[y[index[i]]]
            if n_i / n_j >= 3.0 and lam < 0.5:
                expected = 0.0
            elif n_i / n_j <= 1 / 3.0 and 1 - lam < 0.5:
                expected = 1.0
            else:
                expected = lam
            assert float(got[i]) == expected


@pytest.mark.parametrize("make", [lambda: ManifoldMixup("1", alpha=1.0), lambda: CutMix("input")])
def test_remix_moves_the_label_in_loss_and_targets_for_any_mixer(make):
    conv = isinstance(make(), CutMix)
    model = Conv().double() if conv else mlp()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64) if conv else torch.randn(8, 5, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 0, 3, 1, 2])
    counts = torch.tensor([500, 100, 20, 5])
    mix = make().use(Remix(counts))
    with mix.attach(model):
        mix.pin(lam=0.4, index=[1, 2, 3, 0, 5, 6, 7, 4])
        logits = model(x)
        loss = mix.loss(per_sample_ce, logits, y)
        soft = mix.targets(y, 4, dtype=torch.float64, logits=logits)
    last = mix.last
    w = remix_lam(last.lam, counts.double()[y], counts.double()[y[last.index]], 3.0, 0.5)
    assert ((w == 0) | (w == 1)).any() and (w == last.lam).any()  # some labels moved, some not
    theirs = w * per_sample_ce(logits, y) + (1 - w) * per_sample_ce(logits, y[last.index])
    torch.testing.assert_close(loss, theirs)
    onehot = F.one_hot(y, 4).double()
    torch.testing.assert_close(soft, w.view(-1, 1) * onehot + (1 - w.view(-1, 1)) * onehot[last.index])


def test_remix_on_classes_of_like_sizes_is_the_plain_mix():
    model = mlp()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 3, 1, 2])
    losses = []
    for mix in (ManifoldMixup("1"), ManifoldMixup("1").use(Remix([140, 146, 143, 142]))):
        with mix.attach(model):
            mix.pin(lam=0.3, index=[1, 2, 3, 0, 5, 6, 7, 4])
            losses.append(mix.loss(per_sample_ce, model(x), y).mean())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-15, atol=0)
    assert_all_close(grads(model, losses[1]), grads(model, losses[0]), rtol=1e-14, atol=1e-16)


def test_a_clean_method_that_refuses_targets_still_refuses_them_with_a_target_policy():
    model = mlp()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    for eta, refused in ((0.5, True), (1.0, False)):
        mix = RegMixup("1", eta=eta).use(Remix([4, 3, 2, 1]))
        with mix.attach(model):
            logits = model(x)
            if refused:
                with pytest.raises(ValueError, match="weighs its mixed rows by eta=0.5"):
                    mix.targets(y, 4, logits=logits)
            else:
                assert mix.targets(y, 4, logits=logits).shape == (8, 4)  # the clean rows, then the mixed


def test_remix_counts_are_counted_and_checked():
    remix = Remix().count(torch.tensor([0, 0, 0, 1, 2]), 4)
    assert remix.counts.tolist() == [3.0, 1.0, 1.0, 0.0]
    model = mlp()
    mix = ManifoldMixup("input").use(Remix([3, 1, 1]))
    with mix.attach(model):
        logits = model(torch.randn(4, 5, dtype=torch.float64))
        with pytest.raises(ValueError, match="Remix has counts for 3 classes, but the logits have 4"):
            mix.loss(per_sample_ce, logits, torch.tensor([0, 1, 2, 0]))
    mix = ManifoldMixup("input").use(Remix())
    with mix.attach(model):
        logits = model(torch.randn(4, 5, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="Remix needs the class counts"):
            mix.loss(per_sample_ce, logits, torch.tensor([0, 1, 2, 0]))
    with pytest.raises(ValueError, match="one non-negative number per class"):
        Remix([3, -1])
    with pytest.raises(ValueError, match="ManifoldMixup with Remix needs class indices"):
        ManifoldMixup("input").use(Remix([1, 1])).check_targets(torch.randn(4))


# ------------------------------------------------------------------------------------ DecoupleMix


# From Westlake-AI/openmixup openmixup/models/losses/cross_entropy_loss.py (37e1372), soft_mix_cross_entropy
# without its label-smoothing and weight branches, with utils.weight_reduce_loss's mean over avg_factor.
def openmixup_soft_mix_cross_entropy(pred, label, eta_weight, avg_factor):
    _eps = 1e-3
    mask_one = (label > _eps).sum(dim=-1)
    mix_num = max(mask_one)
    mask_one = mask_one >= mix_num
    if mask_one.sum() < label.size(0):
        pred_one = pred[mask_one == False, :]  # noqa: E712
        label_one = label[mask_one == False, :]  # noqa: E712
        pred = pred[mask_one, :]
        label = label[mask_one, :]
    else:
        pred_one, label_one = None, None
    bs, cls_num = label.size()
    mask_lam_k = label > _eps
    lam_k = label[0, label[0, :] > _eps]
    loss = -label * F.log_softmax(pred, dim=-1)
    loss = loss.sum(dim=-1)
    if len(set(lam_k.cpu().numpy())) == lam_k.size(0) and lam_k.size(0) > 1:
        for i in range(lam_k.size(0)):
            mask_lam_i = (label == lam_k[i]) | ~mask_lam_k
            pred_lam_i = pred.reshape([1, bs, -1])[:, mask_lam_i].reshape([-1, cls_num + 1 - lam_k.size(0)])
            label_lam_i = label.reshape([1, bs, -1])[:, mask_lam_i].reshape([-1, cls_num + 1 - lam_k.size(0)])
            label_lam_i = (label_lam_i > 0).type(torch.float)
            loss_global = -label_lam_i * F.log_softmax(pred_lam_i, dim=-1)
            loss += eta_weight[i] * loss_global.sum(dim=-1)
    loss = loss.sum() / avg_factor
    if label_one is not None:
        loss_one = -label_one * F.log_softmax(pred_one, dim=-1)
        loss_one = loss_one.sum(dim=-1)
        loss_one = loss_one.sum() / avg_factor
        loss += loss_one
    return loss


@pytest.mark.parametrize("eta", [0.1, 1.0])
def test_the_decoupled_loss_is_openmixups_soft_mix_cross_entropy(eta):
    model = mlp()
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 3, 2, 1, 0, 3])
    index = torch.tensor([2, 4, 0, 7, 1, 6, 5, 3])  # row 0 pairs class 0 with 1: OpenMixup's order is ours
    lam = 0.35
    mix = ManifoldMixup("1", alpha=1.0).use(DecoupledLoss(eta))
    with mix.attach(model):
        mix.pin(lam=lam, index=index)
        logits = model(x)
        loss = mix.loss(F.cross_entropy, logits, y)  # a mean criterion: the term's mean is added
        mix.pin(lam=lam, index=index)
        per = mix.loss(per_sample_ce, model(x), y)  # per-sample: one term each
    label = lam * F.one_hot(y, 4).double() + (1 - lam) * F.one_hot(y[index], 4).double()
    assert y[0] < y[index[0]] and (y == y[index]).any()  # a one-class pair too
    # ClsMixupHead with eta_weight=dict(eta=eta, mode="both") and linear lam: [eta * lam, eta * (1 - lam)]
    theirs = openmixup_soft_mix_cross_entropy(logits, label, [eta * lam, eta * (1 - lam)], avg_factor=8)
    torch.testing.assert_close(loss, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(per.mean(), theirs, rtol=1e-12, atol=1e-14)
    assert_all_close(grads(model, loss), grads(model, theirs), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="train with loss"):
        mix.targets(y, 4, logits=logits)


# ------------------------------------------------------------------------------------ Balanced-MixUp


@pytest.mark.parametrize("layer", ["input", "1"])
def test_balanced_mixup_is_the_authors_mix_at_the_input_and_the_hand_edited_one_at_a_layer(layer):
    model = mlp()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 0, 0, 1, 0, 0])
    xb, yb = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 1, 2])
    gamma = 0.2  # the partner's weight, the authors' lam ~ Beta(alpha, 1)
    mix = ManifoldMixup(layer, alpha=1.0).use(BalancedMixup(alpha=0.2))
    with mix.attach(model):
        mix.pin(lam=1 - gamma)
        mix.use_partners(xb, yb)
        logits = model(x)
        loss = mix.loss(per_sample_ce, logits, y).mean()
        soft = mix.targets(y, 4, dtype=torch.float64, logits=logits)
    assert mix.last.index.tolist() == list(range(6)) and mix.last.info["partners"] == "batch"
    if layer == "input":  # agaldran/balanced_mixup train_lt_mxp.py (c9e053b), run_one_epoch
        inputs = (1 - gamma) * x + gamma * xb  # (one-hot labels in float64 here: int64 * float is float32)
        mixed_labels = (1 - gamma) * F.one_hot(y, 4).double() + gamma * F.one_hot(yb, 4).double()
        out = model(inputs)
        theirs = -(out.log_softmax(dim=-1) * mixed_labels).sum(dim=-1).mean()  # cross_entropy_loss
        torch.testing.assert_close(soft, mixed_labels.double())
    else:  # the hand-edited forward: both batches through the layers before the mix, one after
        h = model[:2](torch.cat([x, xb]))
        out = model[2:]((1 - gamma) * h[:6] + gamma * h[6:])
        theirs = ((1 - gamma) * per_sample_ce(out, y) + gamma * per_sample_ce(out, yb)).mean()
    torch.testing.assert_close(logits, out, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, theirs, rtol=1e-12, atol=1e-14)
    assert_all_close(grads(model, loss), grads(model, theirs), rtol=1e-10, atol=1e-12)


def test_a_shuffled_partner_batch_picks_distinct_partners_and_batch_norm_sees_both_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).double()
    hand = copy.deepcopy(model)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    xb, yb = torch.randn(7, 5, dtype=torch.float64), torch.tensor([3, 2, 1, 0, 1, 2, 3])
    mix = ManifoldMixup("1", alpha=1.0).use(PartnerBatch("shuffled"))
    with mix.attach(model):
        mix.use_partners(xb, yb)
        logits = model(x)
        loss = mix.loss(per_sample_ce, logits, y).mean()
    index, lam = mix.last.index, float(mix.last.lam)
    assert len(set(index.tolist())) == 4 and 0 <= index.min() and index.max() < 7
    h = hand[:2](torch.cat([x, xb]))
    out = hand[2](lam * h[:4] + (1 - lam) * h[4:][index])
    theirs = (lam * per_sample_ce(out, y) + (1 - lam) * per_sample_ce(out, yb[index])).mean()
    torch.testing.assert_close(logits, out)
    torch.testing.assert_close(model[1].running_mean, hand[1].running_mean)  # (both batches' statistics)
    assert_all_close(grads(model, loss), grads(hand, theirs), rtol=1e-10, atol=1e-12)


def test_a_memory_bank_of_rows_at_the_layer_is_mixed_in_as_constants():
    model = mlp()
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    bank, labels = torch.randn(9, 8, dtype=torch.float64), torch.tensor([3, 2, 1, 0, 1, 2, 3, 0, 1])
    mix = ManifoldMixup("1", alpha=1.0).use(PartnerBatch("shuffled", at="layer"))
    with mix.attach(model):
        mix.use_partners(bank.clone().requires_grad_(), labels)  # (no gradient reaches the bank)
        logits = model(x)
        loss = mix.loss(per_sample_ce, logits, y).mean()
        soft = mix.targets(y, 4, dtype=torch.float64, logits=logits)
    index, lam = mix.last.index, float(mix.last.lam)
    assert len(set(index.tolist())) == 4 and index.max() < 9
    h = model[:2](x)
    out = model[2:](lam * h + (1 - lam) * bank[index])
    theirs = (lam * per_sample_ce(out, y) + (1 - lam) * per_sample_ce(out, labels[index])).mean()
    torch.testing.assert_close(logits, out)
    torch.testing.assert_close(
        soft, lam * F.one_hot(y, 4).double() + (1 - lam) * F.one_hot(labels[index], 4).double()
    )
    assert_all_close(grads(model, loss), grads(model, theirs), rtol=1e-10, atol=1e-12)
    with mix.attach(model):
        mix.use_partners(torch.randn(9, 7, dtype=torch.float64), labels)
        with pytest.raises(
            ValueError, match="the partner rows have shape \\(9, 7\\), but '1' returns \\(4, 8\\)"
        ):
            model(x)
        mix.use_partners(torch.randn(9, 8, dtype=torch.float64, device="meta"), labels)
        with pytest.raises(ValueError, match="the partner rows are on meta, '1''s output on cpu"):
            model(x)
        mix.use_partners(torch.randn(3, 8, dtype=torch.float64), labels[:3])
        with pytest.raises(ValueError, match="3 partner rows for a batch of 4; give 4 or more"):
            model(x)


def test_a_forward_that_does_not_mix_runs_on_the_batch_alone_and_an_eval_forward_drops_the_partners():
    model = mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    mix = ManifoldMixup("1", alpha=1.0, prob=0.0).use(BalancedMixup())
    with mix.attach(model):
        mix.use_partners(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))
        assert model(x).shape == (4, 4) and mix.last is None
    mix = ManifoldMixup("1", alpha=1.0).use(BalancedMixup())
    with mix.attach(model):
        mix.use_partners(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))
        model.eval()
        model(x)
        model.train()
        with pytest.raises(RuntimeError, match="call mixer.use_partners"):
            model(x)


def test_a_partner_batch_of_the_wrong_size_device_or_shape_is_refused_in_one_line():
    model = mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    mix = ManifoldMixup("1").use(BalancedMixup())
    cases = [
        (torch.randn(3, 5, dtype=torch.float64), "the partner batch has 3 rows, the batch 4"),
        (torch.randn(4, 6, dtype=torch.float64), "must differ in the batch dimension"),
        (torch.randn(4, 5, device="meta", dtype=torch.float64), "on meta, the batch torch.float64 on cpu"),
        (torch.randn(4, 5), "float32 on cpu, the batch torch.float64"),
    ]
    with mix.attach(model):
        for partners, message in cases:
            mix.use_partners(partners, torch.zeros(partners.shape[0], dtype=torch.int64))
            with pytest.raises(ValueError, match=message) as err:
                model(x)
            assert "\n" not in str(err.value)
        mix.use_partners(torch.randn(4, 5, dtype=torch.float64), torch.zeros(3, dtype=torch.int64))
        with pytest.raises(ValueError, match="4 rows but \\(3,\\) labels"):
            model(x)
    with pytest.raises(RuntimeError, match="give it a PartnerBatch policy first"):
        ManifoldMixup("1").use_partners(x)
    with pytest.raises(ValueError, match="clean=True"):
        RegMixup("1").use(BalancedMixup())
    with pytest.raises(TypeError, match="chooses its own"):
        CMixup("input").use(PartnerBatch())
    with pytest.raises(ValueError, match="Balanced"):
        ManifoldMixup("input").use(BalancedMixup()).check_targets(torch.randn(4))


def test_a_recomputation_of_the_whole_model_with_a_partner_batch_is_refused():
    model = mlp()
    mix = ManifoldMixup("1").use(BalancedMixup())
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    with mix.attach(model):
        mix.use_partners(torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))
        logits = checkpoint(model, x, use_reentrant=False)
        with pytest.raises(RuntimeError, match="checkpoint the layers inside the model"):
            mix.loss(per_sample_ce, logits, torch.zeros(4, dtype=torch.int64)).mean().backward()


# ------------------------------------------------------------------------------------ GuidedMixup


def test_the_greedy_cycle_is_the_authors_onecycle_cover():
    rng = np.random.default_rng(0)
    for n in [1, 2, 3, 5, 16, 64, *rng.integers(4, 40, 40).tolist()]:
        d = rng.random((n, n)).astype(np.float32)
        d = d + d.T
        mine = greedy_cycle(torch.from_numpy(d))
        assert mine.tolist() == onecycle_cover(d.copy()).tolist()
        assert sorted(mine.tolist()) == list(range(n))
    assert greedy_cycle(torch.rand(6, 6, device="meta")).device.type == "meta"


def test_the_pairing_compares_the_authors_blurred_normalised_saliency_maps():
    tv = pytest.importorskip("torchvision.transforms")
    torch.manual_seed(0)
    maps = torch.rand(10, 12, 12)
    blur = tv.GaussianBlur((7, 7), sigma=(3.0, 3.0))  # GuidedMixup's blur=7, blur_sigma=3
    theirs = blur(maps)
    torch.testing.assert_close(gaussian_blur(maps, 7, 3.0), theirs)
    theirs = theirs / theirs.sum(dim=[-1, -2], keepdim=True)  # _saliency_normalization('sumto1')
    policy = SaliencyPairing()
    flat = policy.maps(maps)
    mine = greedy_cycle(torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist"))
    assert mine.tolist() == onecycle_cover(distance_function(theirs, theirs).numpy()).tolist()


@pytest.mark.parametrize(
    "saliency,layer", [("gradient", "input"), ("gradient", "block"), ("activation", "block")]
)
def test_saliency_pairing_mixes_the_pairs_it_chose_as_a_hand_edited_forward(saliency, layer):
    model = Conv().double()
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 1])
    mix = ManifoldMixup(layer, alpha=1.0).use(SaliencyPairing(saliency))
    with mix.attach(model):
        mix.use_targets(y)
        mix.pin(lam=0.3)
        logits = model(x)
        loss = mix.loss(per_sample_ce, logits, y).mean()
    index = mix.last.index
    assert sorted(index.tolist()) == list(range(6)) and (index != torch.arange(6)).all()
    # the pairs, from the saliency the policy reads: the gradient of the summed cross-entropy in eval mode
    if saliency == "gradient":
        inp = x.clone().requires_grad_() if layer == "input" else None
        if layer == "input":
            F.cross_entropy(model(inp), y, reduction="sum").backward()
            grad = inp.grad
        else:  # (the mixed layer is the convolution, before its tanh)
            h = model.block(torch.tanh(model.stem(x))).detach().requires_grad_()
            F.cross_entropy(model.head(torch.tanh(h).flatten(1)), y, reduction="sum").backward()
            grad = h.grad
        s = gradient_saliency(grad)
    else:
        s = model.block(torch.tanh(model.stem(x))).abs().mean(1)
    flat = SaliencyPairing().maps(s.detach())
    assert index.tolist() == greedy_cycle(torch.cdist(flat, flat)).tolist()
    if layer == "input":
        out = model(0.3 * x + 0.7 * x[index])
    else:
        h = model.block(torch.tanh(model.stem(x)))
        out = model.head(torch.tanh(0.3 * h + 0.7 * h[index]).flatten(1))
    theirs = (0.3 * per_sample_ce(out, y) + 0.7 * per_sample_ce(out, y[index])).mean()
    torch.testing.assert_close(logits, out)
    assert_all_close(grads(model, loss), grads(model, theirs), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("saliency", ["activation", "gradient"])
def test_saliency_pairing_reads_a_channels_last_map_over_its_channels(saliency):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, num_classes=3, img_size=32, embed_dim=8,
        depths=(1, 1), num_heads=(1, 1), window_size=4, drop_path_rate=0.0,
    ).double()  # fmt: skip
    x, y = torch.randn(8, 3, 32, 32, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    # what the policy reads, by hand (in eval mode, as its gradient pass): the first stage's map, or the
    # gradient of the summed cross-entropy there
    model.eval()
    h = model.layers[0](model.patch_embed(x))
    assert h.shape == (8, 8, 8, 8)  # (B, H, W, C) with H == C: the shapes cannot tell the axes apart
    if saliency == "gradient":
        logits = model.forward_head(model.norm(model.layers[1](h)))
        (h,) = torch.autograd.grad(F.cross_entropy(logits, y, reduction="sum"), [h])
    mix = ManifoldMixup("layers.0", alpha=1.0).use(SaliencyPairing(saliency))
    with mix.attach(model.train()):
        mix.use_targets(y)
        model(x)
    pairings = []
    for reading in (h.permute(0, 3, 1, 2), h):  # over its channels; over its height (the wrong axis)
        s = reading.abs().mean(1) if saliency == "activation" else gradient_saliency(reading)
        flat = SaliencyPairing().maps(s.detach())
        pairings.append(greedy_cycle(torch.cdist(flat, flat)).tolist())
    assert mix.last.index.tolist() == pairings[0] != pairings[1]


def test_a_partner_batch_goes_to_a_keyword_input_as_to_a_positional_one():
    """The HuggingFace Trainer calls ``model(pixel_values=x)``: the partner batch is appended to the first
    keyword argument of a forward without positional ones, the same mix as ``model(x)``; another keyword
    argument with a row per sample (a mask the partners would lack) is refused in one line."""

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()

        def forward(self, pixel_values=None, mask=None):
            return self.net(pixel_values)

    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    xp = torch.randn(6, 5, generator=g, dtype=torch.float64)
    y, yp = torch.tensor([0, 1, 2, 0, 1, 2]), torch.tensor([2, 2, 1, 1, 0, 0])
    outs = []
    for call in (lambda m: m(x), lambda m: m(pixel_values=x)):
        model = Keyword()
        mix = ManifoldMixup("net.1", alpha=1.0, generator=torch.Generator().manual_seed(1))
        mix.use(BalancedMixup())
        with mix.attach(model):
            mix.use_partners(xp, yp)
            logits = call(model)
            outs.append((logits, mix.loss(per_sample_ce, logits, y), mix.last.lam))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=0)
    model, mix = Keyword(), ManifoldMixup("net.1", alpha=1.0).use(BalancedMixup())
    with mix.attach(model), pytest.raises(ValueError, match="also passes 'mask' with a row per sample") as e:
        mix.use_partners(xp, yp)
        model(pixel_values=x, mask=torch.ones(6, 5))
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------ every policy


POLICIES = {
    "kernel_warping": lambda: [KernelWarping()],
    "local_weights": lambda: [LocalWeights(sigma=0.3)],
    "remix": lambda: [Remix([40, 10, 3, 1])],
    "decoupled": lambda: [DecoupledLoss(0.5)],
    "sumix": lambda: [SUMix("head")],
    "balanced": lambda: [BalancedMixup(0.3)],
    "shuffled_batch": lambda: [PartnerBatch("shuffled")],
    "memory_bank": lambda: [PartnerBatch("shuffled", at="layer"), KernelWarping()],
    "pairing_gradient": lambda: [SaliencyPairing("gradient")],
    "pairing_activation": lambda: [SaliencyPairing("activation")],
    "all_knobs": lambda: [
        BalancedMixup(0.3),
        KernelWarping(),
        LocalWeights(epsilon=50.0),
        Remix([40, 10, 3, 1]),
        DecoupledLoss(0.2),
    ],  # fmt: skip
}


class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, h):
        return checkpoint(self.inner, h, use_reentrant=False)


def _step(model, mix, x, y, partners):
    if partners:
        g = torch.Generator(device="cpu").manual_seed(1)
        rows = x.shape[0] + (2 if partners != "aligned" else 0)
        shape = (4, 8, 8) if partners == "bank" else x.shape[1:]  # (the Conv's block's output)
        xb = torch.randn((rows, *shape), generator=g, dtype=x.dtype).to(x.device)
        mix.use_partners(xb, torch.randint(0, 4, (rows,), generator=g).to(x.device))
    mix.use_targets(y)
    logits = model(x)
    return mix.loss(per_sample_ce, logits, y).mean()


def _partners(policies):
    batch = next((p for p in policies if isinstance(p, PartnerBatch)), None)
    return None if batch is None else "bank" if batch.at == "layer" else batch.pairing


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_a_checkpointed_layer_replays_the_same_mix_and_pin_last_repeats_it(kind):
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0, 1])
    partners = _partners(POLICIES[kind]())
    results = []
    for checkpointed in (False, True):
        model = Conv().double()
        if checkpointed:
            model.block = Checkpointed(model.block)
        mix = ManifoldMixup("block" if not checkpointed else "block.inner", alpha=1.0,
                            generator=torch.Generator().manual_seed(3)).use(*POLICIES[kind]())  # fmt: skip
        with mix.attach(model):
            loss = _step(model, mix, x, y, partners)
            results.append((loss.detach(), grads(model, loss), mix.last))
            mix.pin_last()
            again = _step(model, mix, x, y, partners)
            torch.testing.assert_close(again, loss)
            torch.testing.assert_close(mix.last.lam, results[-1][2].lam)
            assert mix.last.index.tolist() == results[-1][2].index.tolist()
    (loss_a, grads_a, _), (loss_b, grads_b, _) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert_all_close(grads_a, grads_b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_no_value_of_a_device_tensor_is_read_on_the_host_with_a_policy(kind):
    """On the meta device (values do not exist) a step with every policy runs through: on a GPU none waits."""
    torch.manual_seed(0)
    model = Conv().to("meta").train()
    x, y = torch.randn(6, 3, 8, 8, device="meta"), torch.randint(0, 4, (6,), device="meta")
    policies = POLICIES[kind]()
    layers = ["block"] if kind in ("pairing_activation", "memory_bank") else ["input", "block"]
    for layer in layers:
        mix = ManifoldMixup(layer, alpha=1.0).use(*policies)
        with mix.attach(model):
            for _ in range(2):
                _step(model, mix, x, y, _partners(policies)).backward()


def test_a_copy_keeps_its_policies_and_use_replaces_them():
    mix = ManifoldMixup("1").use(Remix([1, 2]), KernelWarping())
    assert [type(p).__name__ for p in copy.deepcopy(mix).policies] == ["KernelWarping", "Remix"]
    assert "policies=[KernelWarping" in repr(mix)
    assert mix.use().policies == ()
    with pytest.raises(ValueError, match="both set the target"):
        mix.use(Remix(), Remix())
    with pytest.raises(TypeError, match="takes policies"):
        mix.use("remix")
    model = mlp()
    with mix.attach(model):
        with pytest.raises(RuntimeError, match="before attach"):
            mix.use(Remix())


def test_a_policy_a_mixer_cannot_take_is_refused_in_one_line():
    with pytest.raises(TypeError, match="KernelWarping changes lam for each pair, which CutMix cannot take"):
        CutMix("input").use(KernelWarping())
    with pytest.raises(TypeError, match="RankMixup's own loss does not use"):
        RankMixup("input").use(Remix([1, 1]))
    with pytest.raises(ValueError, match="saliency='activation'\\) at 'input'"):
        ManifoldMixup(["input", "1"]).use(SaliencyPairing("activation"))
    with pytest.raises(TypeError, match="draw_for"):
        ManifoldMixup("input").use(KernelWarping()).draw_for("input", 4)
    with pytest.raises(ValueError, match="exactly one of epsilon"):
        LocalWeights()
    with pytest.raises(ValueError, match="kappa must be"):
        Remix(kappa=0.5)


def test_distances_where_padding_makes_them_meaningless_or_of_the_wrong_rows_are_refused():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().train()
    x = torch.randn(3, 5, 8, dtype=torch.double)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    for policy in (KernelWarping(), LocalWeights(sigma=1.0)):
        mix = ManifoldMixup("layers.0").use(policy)
        with mix.attach(model):
            with pytest.raises(ValueError, match="takes padding masks, so the rows mixed there hold padded"):
                model(x, src_key_padding_mask=pad)
            mix.use_features(torch.randn(3, 4, dtype=torch.double))  # given features: taken
            assert model(x, src_key_padding_mask=pad).shape == (3, 5, 8)
            mix.use_features(torch.randn(2, 4))
            with pytest.raises(
                ValueError, match="use_features\\(\\) gave \\(2, 4\\), but the mix at 'layers.0' has 3"
            ):
                model(x, src_key_padding_mask=pad)


def test_oneof_passes_its_policies_to_every_mixer():
    mix = OneOf([ManifoldMixup("1"), CutMix("input")]).use(Remix([1, 2, 3, 4]))
    assert all(type(m.policies[0]).__name__ == "Remix" for m in mix.mixers)
