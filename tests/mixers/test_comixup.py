"""Co-Mixup: the swap against GCO's labels (recorded, and live where gco-wrapper is installed); the labelling,
the mixed batch, the label weights and the compatibility against the authors' code on the same saliency and
draws; the loss and every gradient against a hand-written computation in float64 (the authors' loss too);
a hidden map with gradients; checkpoint replay and pin_last; the refusals."""

import copy
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness import comixup_reference as ref
from mixhook import CoMixup, CutMix
from mixhook.mixers.comixup import compatibility, labelling
from mixhook.policies import LocalWeights, SaliencyPairing
from mixhook.solvers.swap import swap_labelling
from tests.helpers import assert_same_step, gen

RECORDED = Path(__file__).resolve().parent.parent / "recorded" / "gco_swap.npz"


def recorded_problems():
    """The problems tools/record_gco.py gave GCO, and GCO's labels."""
    with np.load(RECORDED) as npz:
        data = dict(npz)  # (each read of an npz member decompresses it: once)
    at = dict.fromkeys(("unary", "smooth", "w_v", "w_h", "labels"), 0)
    for h, w, n_labels in data["shapes"]:
        sizes = {"unary": h * w * n_labels, "smooth": n_labels**2, "w_v": (h - 1) * w, "w_h": h * (w - 1)}
        sizes["labels"] = h * w
        shapes = {"unary": (h, w, n_labels), "smooth": (n_labels, n_labels), "w_v": (h - 1, w)}
        shapes.update(w_h=(h, w - 1), labels=(h, w))
        problem = {}
        for name, size in sizes.items():
            problem[name] = data[name][at[name] : at[name] + size].reshape(shapes[name])
            at[name] += size
        yield problem


# ------------------------------------------------------------------------------------ the swap


def test_the_swap_ends_with_gcos_labels_on_the_recorded_problems():
    """tools/record_gco.py's problems: the graph cuts of the authors' labelling (their soft labels' extra
    labels and quarter costs included) and small-integer ones full of ties, which only GCO's own way of
    breaking them decides."""
    count = ties = 0
    for p in recorded_problems():
        labels = swap_labelling(p["unary"], p["smooth"], p["w_v"], p["w_h"])
        np.testing.assert_array_equal(labels, p["labels"])
        count += 1
        ties += int(p["unary"].shape[-1] <= 8)
    assert count == 596 and ties >= 400


def test_the_swap_ends_with_gcos_labels_live():
    gco = pytest.importorskip("gco", reason="gco-wrapper (GCO, research-only) is not a dependency")
    rng = np.random.default_rng(7)
    for _ in range(300):
        h, w, n_labels = int(rng.integers(2, 6)), int(rng.integers(2, 6)), int(rng.integers(2, 24))
        unary = rng.normal(0, 1, (h, w, n_labels)).astype(np.float32) * float(rng.choice([0.01, 1.0]))
        if rng.random() < 0.5:
            unary = np.round(unary * 20) / 20  # (ties)
        pairwise = np.ones((n_labels, n_labels), np.float32) - np.eye(n_labels, dtype=np.float32)
        beta = float(rng.choice([0.32, 1.0])) / h / w
        cost_v, cost_h = beta * np.ones((h - 1, w), np.float32), beta * np.ones((h, w - 1), np.float32)
        expected = gco.cut_grid_graph(unary, pairwise, cost_v, cost_h, algorithm="swap")
        np.testing.assert_array_equal(ref.stand_in(unary, pairwise, cost_v, cost_h), expected)


def test_the_swap_refuses_what_gco_cannot_solve_as_a_swap():
    u = np.zeros((2, 2, 3), np.int64)
    with pytest.raises(ValueError, match="symmetric 3x3"):
        swap_labelling(u, np.array([[0, 1, 2], [2, 0, 1], [1, 1, 0]]), np.ones((1, 2)), np.ones((2, 1)))
    with pytest.raises(ValueError, match="not submodular"):
        swap_labelling(u, np.array([[5, 1, 1], [1, 5, 1], [1, 1, 0]]), np.ones((1, 2)), np.ones((2, 1)))
    with pytest.raises(ValueError, match="negative edge weight"):
        swap_labelling(u, 1 - np.eye(3, dtype=np.int64), -np.ones((1, 2)), np.ones((2, 1)))
    with pytest.raises(ValueError, match="GCO needs 2 of each"):
        swap_labelling(np.zeros((1, 1, 3)), 1 - np.eye(3, dtype=np.int64), np.ones((0, 1)), np.ones((1, 0)))


# ------------------------------------------------------------------------------------ against the authors


def part_problem(seed, n, side):
    g = gen(seed)
    sc = torch.rand(n, side, side, generator=g) ** 3
    cost = -(sc / sc.reshape(n, -1).sum(1).reshape(n, 1, 1))
    dist = torch.randint(0, 30, (n, n), generator=g).float()
    dist = dist + dist.T
    a = 0.999 * torch.eye(n) + 0.001 * (dist / dist.sum() * n)
    prior = torch._sample_dirichlet(torch.full((n,), 2.0), generator=g)
    return cost, a, prior, torch.randint(n, (n, side, side), generator=g)


@pytest.mark.parametrize("solver", sorted(ref.SOLVERS))
@pytest.mark.parametrize(
    "n, side, thres_type, niter, resolve",
    [(20, 4, "hard", 4, True), (13, 8, "soft", 4, True), (5, 2, "hard", 3, False), (2, 4, "hard", 4, True)],
)
def test_the_labelling_equals_the_authors_get_onehot_matrix(solver, n, side, thres_type, niter, resolve):
    ref.SOLVER[0] = ref.SOLVERS[solver]
    found_soft = False
    for seed in range(3):
        cost, a, prior, init = part_problem(seed, n, side)
        expected = ref.get_onehot_matrix(
            cost.clone(), a, n, prior, init, 0.32, 1.0, 0.05, 0.83, thres_type, resolve, niter
        )
        mask = labelling(cost.clone(), a, prior, init, 0.32, 1.0, 0.05, 0.83, thres_type, resolve, niter)
        assert torch.equal(mask, expected)
        found_soft |= bool((mask == 0.5).any())
    assert found_soft or n < 5  # (the halves of the later iterations are exercised)


def authors_args(grid, part):
    return SimpleNamespace(
        m_block_num=grid, m_part=part, m_beta=0.32, m_gamma=1.0, m_thres=0.83, m_thres_type="hard",
        m_eta=0.05, m_omega=0.001, set_resolve=True, m_niter=4,
    )  # fmt: skip


class Square(nn.Module):
    def __init__(self, channels=3, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1)
        self.head = nn.Linear(5, classes)

    def forward(self, x):
        return self.head(self.conv2(torch.relu(self.conv1(x))).mean((2, 3)))


@pytest.mark.parametrize("solver", sorted(ref.SOLVERS))
def test_the_mixed_batch_label_weights_and_compatibility_equal_the_authors_mixup_process(solver):
    """CIFAR's 32x32 images, a batch of 23 in parts of 10 (the last of 3), their grid 4, on the same
    saliency and draws; the mixed batch bit for bit (at most two inputs share a block: no rounding)."""
    ref.SOLVER[0] = ref.SOLVERS[solver]
    torch.manual_seed(0)
    x, y = torch.rand(23, 3, 32, 32), torch.randint(0, 5, (23,))
    sc = torch.rand(23, 32, 32) ** 3
    mix = CoMixup("input", grids=4, part=10, generator=gen(3))
    model, seen = Square().train(), {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    with mix.attach(model):
        mix.pin(saliency=sc)
        model(x)
    info = mix.last.info
    distance = ref.a_dist(sc, 23)
    torch.testing.assert_close(compatibility(sc, 8), distance, rtol=0, atol=0)
    parts = [slice(0, 10), slice(10, 20), slice(20, 23)]
    expected, target = ref.mixup_process(
        x, F.one_hot(y, 5).float(), authors_args(4, 10), sc, distance,
        [info["prior"][p] for p in parts], [info["init"][p] for p in parts],
    )  # fmt: skip
    assert torch.equal(seen["x"], expected)
    assert not torch.equal(seen["x"], x)  # (it mixes)
    indices, weights = mix.last.mixture
    soft = sum(w[:, None] * F.one_hot(y[i], 5).double() for i, w in zip(indices, weights, strict=True))
    torch.testing.assert_close(soft, target.double(), rtol=0, atol=1e-7)
    assert indices.shape[0] == int((target > 0).sum(1).max()) or indices.shape[0] == 2
    assert (weights.sum(0) == 1).all() and (weights[:-1] >= weights[1:]).all()


def test_the_draws_come_from_the_generator_as_the_authors_draw_them():
    """Each part's Dirichlet draw (their Dirichlet(mixup_alpha).sample()) then its initial labels: a
    generator seeded alike gives their prior; the same seed twice gives the same mix."""
    model = Square().train()
    x = torch.rand(12, 3, 8, 8)
    sc = torch.rand(12, 8, 8)
    mixes = []
    for _ in range(2):
        mix = CoMixup("input", grids=2, part=8, generator=gen(5))
        with mix.attach(model):
            mix.pin(saliency=sc)
            model(x)
        mixes.append(mix.last)
    assert torch.equal(mixes[0].info["sources"], mixes[1].info["sources"])
    torch.manual_seed(5)  # (the mixer's generator seeded as the authors' global one)
    theirs = torch.distributions.dirichlet.Dirichlet(2.0 * torch.ones(8)).sample()
    torch.testing.assert_close(mixes[0].info["prior"][:8], theirs, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ the loss and gradients


def by_hand(h, mask, part):
    """Each output ``sum_i M[o, i] * h_i`` over its part, the mask upsampled nearest, written as a loop."""
    rows = []
    n, width = h.shape[0], h.shape[-1]
    for o in range(n):
        start = o // part * part
        size = min(part, n - start)
        m = F.interpolate(mask[o : o + 1, ..., :size].permute(0, 3, 1, 2).double(), size=width)[0]
        rows.append(sum(m[i] * h[start + i] for i in range(size)))
    return torch.stack(rows)


def test_the_loss_and_every_gradient_equal_a_hand_written_step_in_float64():
    torch.manual_seed(0)
    model = Square().double().train()
    hand = copy.deepcopy(model)
    x, y = torch.rand(9, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (9,))
    mix = CoMixup("input", grids=4, part=4, generator=gen(1))  # (parts of 4, 4 and 1)

    def bce(o, t):  # the authors' loss: BCE of the softmax, as a per-sample criterion
        return F.binary_cross_entropy(o.softmax(1), F.one_hot(t, 5).double(), reduction="none").mean(1)

    with mix.attach(model):
        mix.use_targets(y)
        logits = model(x)
        loss = mix.loss(bce, logits, y).mean()
        loss.backward()
    mask, (indices, weights) = mix.last.info["sources"], mix.last.mixture
    assert mask.shape == (9, 4, 4, 4) and (weights[0, 8] == 1) and (indices[0, 8] == 8)  # (one left whole)
    expected_logits = hand(by_hand(x, mask, 4))
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-15)
    target = mask.double().sum((1, 2)) / 16  # each input's share, per output
    soft = torch.zeros(9, 5, dtype=torch.float64)
    for o in range(9):
        start = o // 4 * 4
        for i in range(min(4, 9 - start)):
            soft[o] += target[o, i] * F.one_hot(y[start + i], 5).double()
    expected = F.binary_cross_entropy(expected_logits.softmax(1), soft)  # (theirs: nn.BCELoss())
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=1e-15)
    for p, q in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15)


def test_the_gradient_saliency_is_the_authors_up_to_their_scale():
    """main.py's sc (the clean loss's batch mean, times 2 * clean_lam / classes, in train mode), on a
    model whose train and eval forwards agree: equal once each sample's is normalised, as it is used."""
    torch.manual_seed(0)
    model = Square().double().train()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    mix = CoMixup("input", grids=2)
    with mix.attach(model):
        mix.use_targets(y)
        model(x)
    ref_model = copy.deepcopy(model)
    x_var = x.clone().requires_grad_()
    (2 * 1.0 * F.cross_entropy(ref_model(x_var), y, reduction="none") / 5).mean(0).backward()
    sc = torch.sqrt(torch.mean(x_var.grad**2, dim=1))
    ours = mix.last.info["saliency"].double()
    torch.testing.assert_close(ours / ours.sum((1, 2), keepdim=True), sc / sc.sum((1, 2), keepdim=True))


def test_at_a_hidden_map_it_equals_a_hand_edited_forward_with_gradients_into_earlier_layers():
    torch.manual_seed(0)
    model = Square().double().train()
    hand = copy.deepcopy(model)
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 4, 3])
    mix = CoMixup("conv1", grids=(2, 4), part=3, saliency="activation", generator=gen(4))
    ce = lambda o, t: F.cross_entropy(o, t, reduction="none")  # noqa: E731
    with mix.attach(model):
        logits = model(x)
        mix.loss(ce, logits, y).sum().backward()
    mask, (indices, weights) = mix.last.info["sources"], mix.last.mixture
    h = hand.conv1(x)
    torch.testing.assert_close(mix.last.info["saliency"], h.detach().abs().mean(1).float())
    expected = hand.head(hand.conv2(torch.relu(by_hand(h, mask, 3))).mean((2, 3)))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-15)
    assert not torch.allclose(logits, hand(x))  # (it mixes)
    sum(w * ce(expected, y[i]) for i, w in zip(indices, weights, strict=True)).sum().backward()
    for p, q in zip(model.parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    assert hand.conv1.weight.grad.abs().sum() > 0


def test_checkpoint_replay_and_pin_last_repeat_the_mix():
    torch.manual_seed(0)
    model = Square().double().train()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 3, 8, 8, dtype=torch.float64)
    mix = CoMixup("conv1", grids=(2, 4), part=4, saliency="activation", generator=gen(2))
    with mix.attach(model):
        out = checkpoint(model, x, use_reentrant=False)
        out.sum().backward()
        first = mix.last
        mix.pin_last()
        again = model(x)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert torch.equal(mix.last.info["sources"], first.info["sources"])
    same = CoMixup("conv1", grids=(2, 4), part=4, saliency="activation")
    with same.attach(plain):
        info = first.info
        same.pin(grid=info["grid"], prior=info["prior"], init=info["init"])
        loss = plain(x).sum()
        loss.backward()
        assert torch.equal(same.last.info["sources"], info["sources"])
    recomputed = (out.sum(), [p.grad for p in model.parameters()])
    assert_same_step((loss, [p.grad for p in plain.parameters()]), recomputed)


def test_a_copy_and_a_pickle_of_the_mixer_mix_alike_and_keep_no_model():
    model = Square().train()
    x, sc = torch.rand(6, 3, 8, 8), torch.rand(6, 8, 8)
    mix = CoMixup("input", grids=2, part=3, generator=gen(0))
    with mix.attach(model):
        pass
    twins = [copy.deepcopy(mix), pickle.loads(pickle.dumps(mix))]
    masks = []
    for m in (mix, *twins):
        with m.attach(model):
            m.pin(saliency=sc)
            model(x)
        masks.append(m.last.info["sources"])
    assert all(torch.equal(masks[0], k) for k in masks[1:])
    assert b"Square" not in pickle.dumps(mix)


# ------------------------------------------------------------------------------------ refusals


def test_bad_arguments_maps_and_policies_are_refused_in_one_line():
    for kwargs, message in (
        ({"grids": (1, 2)}, "grids must be grid sides >= 2"),
        ({"part": 1}, "part must be an int >= 2"),
        ({"niter": 0}, "niter must be an int >= 1"),
        ({"thres_type": "hinge"}, "thres_type must be one of hard, soft"),
        ({"alpha": 0.0}, "alpha"),
        ({"saliency": "activation"}, "the input is mixed before any layer runs"),
    ):
        with pytest.raises(ValueError, match=message):
            CoMixup("input", **kwargs)
    model = Square().train()
    misfit = r"3 does not fit its 8x8 .*\[2, 4, 8\]"
    for mix, shape, message in (
        (CoMixup("conv1", grids=3, saliency="activation"), (2, 3, 8, 8), misfit),
        (CoMixup("conv1", grids=2, saliency="activation"), (2, 3, 8, 6), "8x6 map is not square"),
    ):
        with mix.attach(model), pytest.raises(ValueError, match=message) as e:
            model(torch.randn(*shape))
        assert "\n" not in str(e.value)
    for policy in (LocalWeights(sigma=1.0), SaliencyPairing()):
        with pytest.raises((TypeError, ValueError)) as e:
            CoMixup("input").use(policy)
        assert "\n" not in str(e.value) and "CoMixup" in str(e.value)
    assert CutMix("input").use(LocalWeights(sigma=1.0))  # (the policies themselves are fine)


def test_vit_tokens_are_refused_in_one_line():
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            return self.head(self.embed(x).mean(1))

    mix = CoMixup("embed", saliency="activation")
    model = Tokens().train()
    with mix.attach(model), pytest.raises(TypeError, match="does not mix ViT tokens"):
        model(torch.randn(2, 5, 4))


def test_a_sample_without_saliency_is_salient_everywhere_alike_and_a_non_finite_one_is_refused():
    """A saturated loss's gradient is zero: the authors' costs are then NaN (0 / 0), here those of a
    saliency equal everywhere."""
    model = Square().train()
    x = torch.rand(6, 3, 8, 8)
    sc = torch.rand(6, 8, 8)
    masks = []
    for row in (torch.zeros(8, 8), torch.full((8, 8), 0.25)):
        sc[2] = row
        mix = CoMixup("input", grids=2, part=6, generator=gen(1))
        with mix.attach(model):
            mix.pin(saliency=sc)
            model(x)
        masks.append(mix.last.info["sources"])
    assert torch.equal(masks[0], masks[1])
    sc[2, 0, 0] = float("nan")
    mix = CoMixup("input", grids=2, part=6)
    with mix.attach(model), pytest.raises(ValueError, match="saliency is not finite"):
        mix.pin(saliency=sc)
        model(x)


def test_with_the_clean_rows_kept_the_mixed_rows_are_the_same_mix():
    torch.manual_seed(0)
    model = Square().double().train()
    x, y = torch.rand(5, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4])
    sc = torch.rand(5, 8, 8)
    logits = {}
    for clean in (False, True):
        mix = CoMixup("input", grids=2, part=3, generator=gen(2))
        mix.clean = clean
        with mix.attach(model):
            mix.pin(saliency=sc)
            logits[clean] = model(x)
            loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits[clean], y)
    torch.testing.assert_close(logits[True][5:], logits[False], rtol=0, atol=1e-15)
    torch.testing.assert_close(logits[True][:5], model(x), rtol=0, atol=1e-15)
    indices, weights = mix.last.mixture
    mixed = sum(
        w * F.cross_entropy(logits[True][5:], y[i], reduction="none")
        for i, w in zip(indices, weights, strict=True)
    )
    expected = torch.cat([F.cross_entropy(logits[True][:5], y, reduction="none"), mixed])
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=1e-15)


def test_a_prior_or_init_pinned_alone_is_used_and_the_other_drawn_as_usual():
    model = Square().train()
    x, sc = torch.rand(6, 3, 8, 8), torch.rand(6, 8, 8)
    runs = {}
    for pins in ({}, {"prior": torch.tensor([0.7, 0.1, 0.1, 0.1, 0.5, 0.5])}, {"init": torch.zeros(6, 2, 2)}):
        mix = CoMixup("input", grids=2, part=4, generator=gen(3))
        with mix.attach(model):
            mix.pin(saliency=sc, **{k: v.long() if k == "init" else v for k, v in pins.items()})
            model(x)
        runs[tuple(pins)] = mix.last.info
    drawn, prior, init = runs[()], runs[("prior",)], runs[("init",)]
    assert torch.equal(prior["prior"], torch.tensor([0.7, 0.1, 0.1, 0.1, 0.5, 0.5]))
    assert torch.equal(prior["init"], drawn["init"])  # (the other: the draw it would have been)
    assert torch.equal(init["init"], torch.zeros(6, 2, 2, dtype=torch.long))
    assert torch.equal(init["prior"], drawn["prior"])
    mix = CoMixup("input", grids=2, part=4)
    bad = torch.zeros(6, 2, 2, dtype=torch.long)
    bad[5, 0, 0] = 2  # (row 5 is in the last part, of two samples: labels 0 and 1)
    with mix.attach(model), pytest.raises(ValueError, match="pinned init of shape") as e:
        mix.pin(saliency=sc, init=bad)
        model(x)
    assert "\n" not in str(e.value)
    with mix.attach(model), pytest.raises(ValueError, match="pinned prior of shape"):
        mix.pin(saliency=sc, prior=torch.zeros(6))
        model(x)


def test_costs_beyond_gcos_integers_are_refused_and_the_swaps_bound_cannot_wrap():
    cost, a, prior, init = part_problem(0, 6, 4)
    with pytest.raises(ValueError, match="beyond the 32-bit integers GCO takes"):
        labelling(cost * 1e5, a, prior, init, 0.32, 1.0, 0.05, 0.83, "hard", True, 2)
    huge = np.full((2, 2, 2), 2**61, np.int64)
    with pytest.raises(ValueError, match="could overflow 64-bit energies"):
        swap_labelling(huge, 1 - np.eye(2, dtype=np.int64), np.ones((1, 2)), np.ones((2, 1)))
