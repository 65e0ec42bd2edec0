"""C-Mixup against its authors' code on the same draws (huaxiuyao/C-Mixup): the kernel rates, the
partners drawn from them, and the mix at a hidden layer with its gradients; what it refuses."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import CMixup
from mixhook.functional import sample_lam
from mixhook.mixers.cmixup import draw_partners, partner_rates
from tests.helpers import Lazy, exact, grads

neighbors = Lazy("sklearn.neighbors")  # imported by the test that uses it, not at collection


# huaxiuyao/C-Mixup, src/algorithm.py: get_mixup_sample_rate's kde branch (args.kde_type "gaussian")
def authors_rates(y_list, bandwidth):
    mix_idx = []
    data_list = torch.tensor(y_list, dtype=torch.float32)
    for i in range(len(data_list)):
        data_i = data_list[i]
        data_i = data_i.reshape(-1, data_i.shape[0])
        kd = neighbors.KernelDensity(kernel="gaussian", bandwidth=bandwidth).fit(data_i)
        each_rate = np.exp(kd.score_samples(data_list))
        each_rate /= np.sum(each_rate)
        mix_idx.append(each_rate)
    return np.array(mix_idx)


@pytest.mark.parametrize("dims", [1, 3])
def test_rates_and_partners_equal_the_authors_kde_sampler_on_the_same_uniforms(dims):
    rng = np.random.RandomState(0)
    y = rng.randn(12, dims).astype(np.float32)  # the authors' labels: float32, 2-D
    rates = partner_rates(torch.from_numpy(y), 0.7)
    exact(rates, torch.from_numpy(authors_rates(y, 0.7)))
    np.random.seed(5)  # the authors' draw: np.random.choice per sample, from the global stream
    theirs = [np.random.choice(np.arange(12), p=authors_rates(y, 0.7)[i]) for i in range(12)]
    uniforms = torch.from_numpy(np.random.RandomState(5).random_sample(12))  # the uniforms choice() used
    assert draw_partners(rates, uniforms).tolist() == theirs


def test_the_mixer_draws_its_partners_by_label_and_mixes_a_hidden_layer_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double().train()
    x = torch.randn(10, 4, dtype=torch.double)
    y = torch.tensor([0.0, 0.1, 0.2, 5.0, 5.1, 5.2, 9.0, 9.1, 9.2, 9.3], dtype=torch.double)
    mix = CMixup("1", alpha=2.0, bandwidth=0.5, generator=torch.Generator().manual_seed(7))
    with mix.attach(model):
        mix.use_targets(y)
        pred = model(x)
        loss = F.mse_loss(pred.squeeze(1), mix.targets(y, dtype=pred.dtype, logits=pred))
        loss.backward()
    got = grads(model)
    g = torch.Generator().manual_seed(7)  # the same draws: the partners' uniforms, then lam
    index = draw_partners(partner_rates(y, 0.5), torch.rand(10, generator=g, dtype=torch.float64))
    lam = float(sample_lam(2.0, g))
    assert torch.equal(mix.last.index, index) and float(mix.last.lam) == lam
    assert (y[index] - y).abs().max() < 1.0  # partners come from the sample's own cluster
    assert len(set(index.tolist())) < 10  # drawn with replacement
    model.zero_grad()
    h = model[1](model[0](x))
    hand = model[2](lam * h + (1 - lam) * h[index])
    exact(pred, hand)
    F.mse_loss(hand.squeeze(1), lam * y + (1 - lam) * y[index]).backward()
    for name, grad in grads(model).items():  # a repeated partner gets the sum of its gradients
        exact(got[name], grad)


def test_a_wide_bandwidth_draws_partners_uniformly_and_a_narrow_one_keeps_each_sample_to_itself():
    y = torch.arange(6, dtype=torch.float64)
    wide, narrow = partner_rates(y, 1e8), partner_rates(y, 1e-3)
    exact(wide, torch.full((6, 6), 1 / 6, dtype=torch.float64))
    exact(narrow, torch.eye(6, dtype=torch.float64))
    counts = torch.zeros(6)
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):
        counts[draw_partners(partner_rates(y, 1.0)[:1], torch.rand(1, generator=g, dtype=torch.float64))] += 1
    expected = partner_rates(y, 1.0)[0] * 3000
    assert float(((counts - expected).square() / expected.clamp(min=1)).sum()) < 25  # chi-square, 5 dof


def test_cmixup_refuses_what_it_cannot_pair_in_one_line():
    model = nn.Sequential(nn.Linear(4, 1)).double().train()
    x = torch.randn(4, 4, dtype=torch.double)
    mix = CMixup("input")
    with mix.attach(model):
        with pytest.raises(RuntimeError, match=r"call cMixup.use_targets\(y\) before every training forward"):
            model(x)
        mix.use_targets(torch.tensor([0, 1, 2, 3]))
        with pytest.raises(ValueError, match="class indices: use ManifoldMixup"):
            model(x)
        mix.use_targets(torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.double))
        with pytest.raises(ValueError, match="NaN"):
            model(x)
        mix.use_targets(torch.zeros(3, dtype=torch.double))
        with pytest.raises(ValueError, match="does not index the batch of 4"):
            model(x)
        mix.pin(index=[1, 0, 3, 2])  # a pinned pairing needs no labels
        assert model(x).shape == (4, 1) and mix.last.index.tolist() == [1, 0, 3, 2]
    with pytest.raises(ValueError, match="bandwidth must be"):
        CMixup("input", bandwidth=0)


def test_check_targets_refuses_class_labels_before_training_through_one_of_too():
    from mixhook import ManifoldMixup, OneOf

    ManifoldMixup("input").check_targets(torch.tensor([0, 1]))  # the others take any labels
    CMixup("input").check_targets(torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match="mixes regression targets"):
        OneOf([ManifoldMixup("input"), CMixup("input")]).check_targets(torch.tensor([0, 1]))
