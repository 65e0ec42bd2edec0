"""PuzzleMix: the labelling's terms, their quantisation, the transport and the mixed batch against the
authors' code on the same draws; the labelling's energy against the exact optimum by enumeration over many
problems; the gradient saliency against theirs; a hand-edited forward with gradients at a hidden map;
checkpoint replay and pin_last; the refusals."""

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import PuzzleMix
from mixhook.mixers.puzzlemix import puzzle_terms, quantized
from mixhook.solvers.graphcut import energy, min_labelling
from tests.helpers import SmallCNN, gen

# The reference: snu-mllab/PuzzleMix (e2dbf3a), mixup.py: cost_matrix, graphcut_multi, neigh_penalty,
# mixup_graph (without the adversarial noise), mask_transport, transport_image; on the CPU, in the input's
# dtype. GCO's cut_grid_graph (research-only) cannot run here: ref_cut_grid_graph stands in for it with
# the exact solver on the same integer energy GCO is given (its float pairwise cost scaled, as gco-wrapper
# scales it, to whole numbers), so everything around the labelling is the authors' own code.
SOLVED = []


def ref_cut_grid_graph(unary_cost, pairwise_cost, pw_x, pw_y, algorithm="swap"):
    scale = round(1 / pairwise_cost[0, 1])  # (n_labels - 1) ** 2: the pairwise cost in whole numbers
    labels = min_labelling((unary_cost * scale)[None], pw_x[None], pw_y[None])[0]
    SOLVED.append((unary_cost, pairwise_cost, pw_x, pw_y))
    return labels.reshape(-1)


def ref_cost_matrix(width):
    C = np.zeros([width**2, width**2], dtype=np.float32)
    for m_i in range(width**2):
        i1 = m_i // width
        j1 = m_i % width
        for m_j in range(width**2):
            i2 = m_j // width
            j2 = m_j % width
            C[m_i, m_j] = abs(i1 - i2) ** 2 + abs(j1 - j2) ** 2
    C = C / (width - 1) ** 2
    return torch.tensor(C)


ref_cost_matrix_dict = {str(n): ref_cost_matrix(n).unsqueeze(0) for n in (2, 4, 8, 16)}


def ref_graphcut_multi(unary1, unary2, pw_x, pw_y, alpha, beta, eta, n_labels=2, eps=1e-8):
    block_num = unary1.shape[0]
    large_val = 1000 * block_num**2
    if n_labels == 2:
        prior = np.array([-np.log(alpha + eps), -np.log(1 - alpha + eps)])
    elif n_labels == 3:
        prior = np.array(
            [-np.log(alpha**2 + eps), -np.log(2 * alpha * (1 - alpha) + eps), -np.log((1 - alpha) ** 2 + eps)]
        )
    prior = eta * prior / block_num**2
    unary_cost = (
        large_val
        * np.stack(
            [
                (1 - lam) * unary1 + lam * unary2 + prior[i]
                for i, lam in enumerate(np.linspace(0, 1, n_labels))
            ],
            axis=-1,
        )
    ).astype(np.int32)
    pairwise_cost = np.zeros(shape=[n_labels, n_labels], dtype=np.float32)
    for i in range(n_labels):
        for j in range(n_labels):
            pairwise_cost[i, j] = (i - j) ** 2 / (n_labels - 1) ** 2
    pw_x = (large_val * (pw_x + beta)).astype(np.int32)
    pw_y = (large_val * (pw_y + beta)).astype(np.int32)
    labels = 1.0 - ref_cut_grid_graph(unary_cost, pairwise_cost, pw_x, pw_y, algorithm="swap") / (
        n_labels - 1
    )
    mask = labels.reshape(block_num, block_num)
    return mask


def ref_neigh_penalty(input1, input2, k):
    pw_x = input1[:, :, :-1, :] - input2[:, :, 1:, :]
    pw_y = input1[:, :, :, :-1] - input2[:, :, :, 1:]
    pw_x = pw_x[:, :, k - 1 :: k, :]
    pw_y = pw_y[:, :, :, k - 1 :: k]
    pw_x = F.avg_pool2d(pw_x.abs().mean(1), kernel_size=(1, k))
    pw_y = F.avg_pool2d(pw_y.abs().mean(1), kernel_size=(k, 1))
    return pw_x, pw_y


def ref_mixup_graph(
    input1, grad1, indices, block_num=2, alpha=0.5, beta=0.0, gamma=0.0, eta=0.2, neigh_size=2, n_labels=2,
    mean=None, std=None, transport=False, t_eps=10.0, t_size=16,
):  # fmt: skip
    dtype = input1.dtype
    input2 = input1[indices].clone()
    batch_size, _, _, width = input1.shape
    block_size = width // block_num
    neigh_size = min(neigh_size, block_size)
    t_size = min(t_size, block_size)
    beta = beta / block_num / 16
    grad1_pool = F.avg_pool2d(grad1, block_size)
    unary1_torch = grad1_pool / grad1_pool.reshape(batch_size, -1).sum(1).reshape(batch_size, 1, 1)
    unary2_torch = unary1_torch[indices]
    input1_pool = F.avg_pool2d(input1 * std + mean, neigh_size)
    input2_pool = input1_pool[indices]
    pw_x = torch.zeros([batch_size, 2, 2, block_num - 1, block_num], dtype=dtype)
    pw_y = torch.zeros([batch_size, 2, 2, block_num, block_num - 1], dtype=dtype)
    k = block_size // neigh_size
    pw_x[:, 0, 0], pw_y[:, 0, 0] = ref_neigh_penalty(input2_pool, input2_pool, k)
    pw_x[:, 0, 1], pw_y[:, 0, 1] = ref_neigh_penalty(input2_pool, input1_pool, k)
    pw_x[:, 1, 0], pw_y[:, 1, 0] = ref_neigh_penalty(input1_pool, input2_pool, k)
    pw_x[:, 1, 1], pw_y[:, 1, 1] = ref_neigh_penalty(input1_pool, input1_pool, k)
    pw_x = beta * gamma * pw_x
    pw_y = beta * gamma * pw_y
    unary1 = unary1_torch.clone()
    unary2 = unary2_torch.clone()
    unary2[:, :-1, :] += (pw_x[:, 1, 0] + pw_x[:, 1, 1]) / 2.0
    unary1[:, :-1, :] += (pw_x[:, 0, 1] + pw_x[:, 0, 0]) / 2.0
    unary2[:, 1:, :] += (pw_x[:, 0, 1] + pw_x[:, 1, 1]) / 2.0
    unary1[:, 1:, :] += (pw_x[:, 1, 0] + pw_x[:, 0, 0]) / 2.0
    unary2[:, :, :-1] += (pw_y[:, 1, 0] + pw_y[:, 1, 1]) / 2.0
    unary1[:, :, :-1] += (pw_y[:, 0, 1] + pw_y[:, 0, 0]) / 2.0
    unary2[:, :, 1:] += (pw_y[:, 0, 1] + pw_y[:, 1, 1]) / 2.0
    unary1[:, :, 1:] += (pw_y[:, 1, 0] + pw_y[:, 0, 0]) / 2.0
    pw_x = (pw_x[:, 1, 0] + pw_x[:, 0, 1] - pw_x[:, 1, 1] - pw_x[:, 0, 0]) / 2
    pw_y = (pw_y[:, 1, 0] + pw_y[:, 0, 1] - pw_y[:, 1, 1] - pw_y[:, 0, 0]) / 2
    unary1 = unary1.detach().cpu().numpy()
    unary2 = unary2.detach().cpu().numpy()
    pw_x = pw_x.detach().cpu().numpy()
    pw_y = pw_y.detach().cpu().numpy()
    mask = []
    for i in range(batch_size):
        mask.append(ref_graphcut_multi(unary2[i], unary1[i], pw_x[i], pw_y[i], alpha, beta, eta, n_labels))
    mask = torch.tensor(np.array(mask), dtype=dtype)
    mask = mask.unsqueeze(1)
    if transport:
        if t_size == -1:
            t_block_num = block_num
            t_size = block_size
        elif t_size < block_size:
            t_block_num = width // t_size
            mask = F.interpolate(mask, size=t_block_num)
            grad1_pool = F.avg_pool2d(grad1, t_size)
            unary1_torch = grad1_pool / grad1_pool.reshape(batch_size, -1).sum(1).reshape(batch_size, 1, 1)
            unary2_torch = unary1_torch[indices]
        else:
            t_block_num = block_num
        plan = ref_mask_transport(mask, unary1_torch, eps=t_eps)
        input1 = ref_transport_image(input1, plan, batch_size, t_block_num, t_size)
        plan = ref_mask_transport(1 - mask, unary2_torch, eps=t_eps)
        input2 = ref_transport_image(input2, plan, batch_size, t_block_num, t_size)
    mask = F.interpolate(mask, size=width)
    ratio = mask.reshape(batch_size, -1).mean(-1)
    return mask * input1 + (1 - mask) * input2, ratio


def ref_mask_transport(mask, grad_pool, eps=0.01):
    block_num = mask.shape[-1]
    n_iter = int(block_num)
    C = ref_cost_matrix_dict[str(block_num)]
    z = (mask > 0).float()
    cost = eps * C - grad_pool.reshape(-1, block_num**2, 1) * z.reshape(-1, 1, block_num**2)
    for _ in range(n_iter):
        row_best = cost.min(-1)[1]
        plan = torch.zeros_like(cost).scatter_(-1, row_best.unsqueeze(-1), 1)
        cost_fight = plan * cost
        col_best = cost_fight.min(-2)[1]
        plan_win = torch.zeros_like(cost).scatter_(-2, col_best.unsqueeze(-2), 1) * plan
        plan_lose = (1 - plan_win) * plan
        cost += plan_lose
    return plan_win


def ref_transport_image(img, plan, batch_size, block_num, block_size):
    input_patch = img.reshape([batch_size, 3, block_num, block_size, block_num * block_size]).transpose(
        -2, -1
    )
    input_patch = input_patch.reshape(
        [batch_size, 3, block_num, block_num, block_size, block_size]
    ).transpose(-2, -1)
    input_patch = (
        input_patch.reshape([batch_size, 3, block_num**2, block_size, block_size])
        .permute(0, 1, 3, 4, 2)
        .unsqueeze(-1)
    )
    input_transport = (
        plan.transpose(-2, -1)
        .unsqueeze(1)
        .unsqueeze(1)
        .unsqueeze(1)
        .matmul(input_patch)
        .squeeze(-1)
        .permute(0, 1, 4, 2, 3)
    )
    input_transport = input_transport.reshape([batch_size, 3, block_num, block_num, block_size, block_size])
    input_transport = input_transport.transpose(-2, -1).reshape(
        [batch_size, 3, block_num, block_num * block_size, block_size]
    )
    input_transport = input_transport.transpose(-2, -1).reshape(
        [batch_size, 3, block_num * block_size, block_num * block_size]
    )
    return input_transport


CIFAR = {"beta": 1.2, "gamma": 0.5, "eta": 0.2, "neigh_size": 4, "n_labels": 3}  # the authors' CIFAR runs


@pytest.mark.parametrize("grid", [2, 4, 8, 16])
def test_the_terms_and_their_quantisation_equal_the_authors(grid):
    torch.manual_seed(grid)
    x = torch.rand(6, 3, 32, 32, dtype=torch.float64)
    saliency = torch.rand(6, 32, 32, dtype=torch.float64) ** 3
    index = torch.randperm(6)
    for n_labels in (2, 3):
        for lam in (0.13, 0.5, 0.91):
            SOLVED.clear()
            ref_mixup_graph(
                x, saliency, index, grid, lam, 1.2, 0.5, 0.2, 4, n_labels, mean=0.0, std=1.0
            )  # fmt: skip
            own_u, partner_u, w_v, w_h, _, beta = puzzle_terms(saliency, x, index, grid, 1.2, 0.5, 4)
            terms = (own_u, partner_u, w_v, w_h)
            unary, q_v, q_h = (t.numpy() for t in quantized(*terms, lam, beta, 0.2, n_labels, grid))
            for i, (u, _, pw_x, pw_y) in enumerate(SOLVED):
                np.testing.assert_array_equal(unary[i], u.astype(np.int64) * (n_labels - 1) ** 2)
                np.testing.assert_array_equal(q_v[i], pw_x)
                np.testing.assert_array_equal(q_h[i], pw_y)


@pytest.mark.slow
@pytest.mark.parametrize("t_size", [None, 4])
def test_the_mixed_batch_and_its_label_weights_equal_the_authors_on_the_same_draws(t_size):
    model = SmallCNN().double().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mean, std = (
        torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1),
        torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1),
    )
    for seed, grid in itertools.product(range(3), (2, 4, 8, 16)):
        torch.manual_seed(seed)
        x = ((torch.rand(5, 3, 32, 32) - mean) / std).double()
        saliency = torch.rand(5, 32, 32, dtype=torch.float64) ** 2
        index = torch.randperm(5)
        lam = float(np.random.RandomState(seed).beta(1.0, 1.0))
        expected, ratio = ref_mixup_graph(
            x.clone(), saliency, index, grid, lam, **CIFAR, mean=mean.double(), std=std.double(),
            transport=True, t_eps=0.8, t_size=-1 if t_size is None else t_size,
        )  # fmt: skip
        mix = PuzzleMix("input", t_size=t_size, mean=mean.flatten().tolist(), std=std.flatten().tolist())
        with mix.attach(model):
            mix.pin(lam=lam, index=index, grid=grid, saliency=saliency)
            model(x)
        torch.testing.assert_close(seen["x"], expected, rtol=0, atol=1e-15)
        torch.testing.assert_close(mix.last.lam, ratio, rtol=0, atol=1e-15)
        assert mix.last.info["grid"] == grid and mix.last.info["clipped"] == 0


@pytest.mark.slow
def test_the_labelling_energy_is_the_exact_optimum_over_many_problems():
    """On the grids small enough to enumerate (2x2 with 2 or 3 labels, 4x4 with 2), the terms PuzzleMix
    builds from random images and saliency: the solver's labelling has the least energy of all."""
    rng = torch.Generator().manual_seed(0)
    checked = 0
    every = {  # every labelling of each grid, once
        (grid, n_labels): np.array(list(itertools.product(range(n_labels), repeat=grid * grid))).reshape(
            -1, grid, grid
        )
        for grid, n_labels in ((2, 2), (2, 3), (4, 2))
    }
    for _ in range(40):
        x = torch.rand(4, 3, 16, 16, generator=rng, dtype=torch.float64)
        saliency = torch.rand(4, 16, 16, generator=rng, dtype=torch.float64) ** 4
        index = torch.randperm(4, generator=rng)
        lam = float(torch.rand((), generator=rng))
        for grid, n_labels in ((2, 2), (2, 3), (4, 2)):
            # a strong smoothness (beta 30) so that the pairwise terms matter beside the unaries
            own_u, partner_u, w_v, w_h, _, beta = puzzle_terms(saliency, x, index, grid, 30.0, 0.9, 2)
            terms = (own_u, partner_u, w_v, w_h)
            unary, q_v, q_h = (t.numpy() for t in quantized(*terms, lam, beta, 0.2, n_labels, grid))
            labels = min_labelling(unary, q_v, q_h)
            found = energy(unary, q_v, q_h, labels)
            labellings = every[grid, n_labels]
            k = len(labellings)
            for b in range(4):
                all_energies = energy(
                    np.broadcast_to(unary[b], (k, *unary.shape[1:])),
                    np.broadcast_to(q_v[b], (k, *q_v.shape[1:])),
                    np.broadcast_to(q_h[b], (k, *q_h.shape[1:])),
                    labellings,
                )
                assert found[b] == all_energies.min()
                checked += 1
    assert checked == 40 * 3 * 4


@pytest.mark.slow
def test_the_solver_is_exact_on_random_grids_of_any_size_and_label_count():
    rng = np.random.default_rng(1)
    for h, w, n_labels in [(2, 2, 2), (2, 2, 3), (3, 3, 3), (2, 3, 4), (3, 4, 2)]:
        for _ in range(20):
            unary = rng.integers(0, 60, (2, h, w, n_labels))
            w_v, w_h = rng.integers(0, 40, (2, h - 1, w)), rng.integers(0, 40, (2, h, w - 1))
            found = energy(unary, w_v, w_h, min_labelling(unary, w_v, w_h))
            every = np.array(list(itertools.product(range(n_labels), repeat=h * w))).reshape(-1, h, w)
            for b in range(2):
                k = len(every)
                rest = [np.broadcast_to(a[b], (k, *a.shape[1:])) for a in (unary, w_v, w_h)]
                assert found[b] == energy(*rest, every).min()


def test_the_gradient_saliency_is_the_authors_up_to_their_batch_mean():
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    mix = PuzzleMix("input", grids=(2, 4))
    with mix.attach(model):
        mix.use_targets(y)
        model(x)
    # main.py: model.eval(); the per-sample loss's batch mean backward; sqrt(mean_c grad**2)
    ref = copy.deepcopy(model).eval()
    x_var = x.clone().requires_grad_()
    F.cross_entropy(ref(x_var), y, reduction="none").mean(0).backward()
    unary = torch.sqrt(torch.mean(x_var.grad**2, dim=1))
    torch.testing.assert_close(mix.last.info["saliency"], 4 * unary)  # a sum, not a mean: x B
    assert model.training


class Square(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.conv2(torch.relu(self.conv1(x))).mean((2, 3)))


def test_puzzlemix_at_a_hidden_map_equals_a_hand_edited_forward_with_gradients():
    torch.manual_seed(0)
    model = Square().double().train()
    by_hand = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    mix = PuzzleMix("conv1", grids=(2, 4), saliency="activation", t_size=None, generator=gen(4))
    with mix.attach(model):
        logits = model(x)
        mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y).sum().backward()
    last = mix.last
    grid, mask, index, lam = last.info["grid"], last.info["mask"], last.index, last.lam
    m = by_hand
    h = m.conv1(x)
    values = (h.detach() - h.detach().min()) / (h.detach().max() - h.detach().min())
    _, _, _, _, own, _ = puzzle_terms(h.detach().abs().mean(1), values, index, grid, 1.2, 0.5, 4)
    expected_h = mix.puzzle(h, index, mask[:, None], own, grid, h.detach().abs().mean(1))
    expected = m.head(m.conv2(torch.relu(expected_h)).mean((2, 3)))
    assert torch.equal(logits, expected)
    ce = lambda t: F.cross_entropy(expected, t, reduction="none")  # noqa: E731
    (lam * ce(y) + (1 - lam) * ce(y[index])).sum().backward()
    for p, q in zip(model.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
    # the hand-edited blend, written out: the transported own blocks where M, the partner's elsewhere
    assert torch.equal(lam, F.interpolate(mask[:, None], size=8).reshape(4, -1).mean(1))


def test_checkpoint_replay_and_pin_last_repeat_the_puzzle():
    torch.manual_seed(0)
    model = Square().double().train()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    mix = PuzzleMix("conv1", grids=(2, 4), saliency="activation", generator=gen(2))
    with mix.attach(model):
        out = checkpoint(model, x, use_reentrant=False)
        out.sum().backward()
        first = mix.last
        mix.pin_last()
        again = model(x)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert torch.equal(mix.last.info["mask"], first.info["mask"])
    # the checkpointed forward's gradients are those of an unchecked forward with the same draws
    same = PuzzleMix("conv1", grids=(2, 4), saliency="activation")
    with same.attach(plain):
        same.pin(lam=first.info["drawn_lam"], index=first.index, grid=first.info["grid"])
        plain(x).sum().backward()
        assert torch.equal(same.last.info["mask"], first.info["mask"])
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_bad_arguments_and_maps_are_refused_in_one_line():
    with pytest.raises(ValueError, match="n_labels must be 2 or 3"):
        PuzzleMix("input", n_labels=4)
    with pytest.raises(ValueError, match="grids must be grid sides >= 2"):
        PuzzleMix("input", grids=(1, 2))
    model = Square().train()
    mix = PuzzleMix("conv1", grids=(2, 16), saliency="activation")
    with mix.attach(model), pytest.raises(ValueError) as e:
        model(torch.randn(2, 3, 8, 8))
    assert "grid side 16 does not fit its 8x8 map" in str(e.value) and "[2, 4, 8]" in str(e.value)
    assert "\n" not in str(e.value)
    mix = PuzzleMix("conv1", grids=(2,), saliency="activation")
    with mix.attach(model), pytest.raises(ValueError, match="8x6 map is not square"):
        model(torch.randn(2, 3, 8, 6))
    mix = PuzzleMix("conv1", grids=(2, 4), saliency="activation")
    with mix.attach(model):
        model(torch.randn(2, 3, 8, 8))
        mix.grids = (2, 16)  # changed after a forward on the same map: checked again, not kept
        with pytest.raises(ValueError, match="grid side 16 does not fit its 8x8 map"):
            model(torch.randn(2, 3, 8, 8))
    mix = PuzzleMix("conv1", grids=(2,), t_size=3, saliency="activation")
    with mix.attach(model), pytest.raises(ValueError, match="t_size 3 does not divide the 4-position blocks"):
        model(torch.randn(2, 3, 8, 8))
    # a 28x28 map (Fashion-MNIST's): blocks of 14 and 7, which the default neigh_size 4 does not tile (its
    # data smoothness would pool 7x7 cells against a 4x4 grid: a shape error mid-step, before this check)
    mix = PuzzleMix("conv1", grids=(4,), t_size=7, saliency="activation")
    with (
        mix.attach(model),
        pytest.raises(ValueError, match="neigh_size 4 does not divide the 7-position blocks"),
    ):
        model(torch.randn(2, 3, 28, 28))
    mix = PuzzleMix("conv1", grids=(2, 4), t_size=7, neigh_size=7, saliency="activation")
    with mix.attach(model):
        model(torch.randn(2, 3, 28, 28))
    assert mix.last.info["grid"] in (2, 4)
    with pytest.raises(ValueError, match="saliency='activation': the input is mixed before any layer"):
        PuzzleMix("input", saliency="activation")


def test_grids_auto_draws_from_the_authors_sides_that_fit_each_map_and_says_so(caplog):
    model = Square().train()
    mix = PuzzleMix("conv1", grids="auto", saliency="activation", generator=torch.Generator().manual_seed(0))
    drawn = {}
    with mix.attach(model), caplog.at_level("INFO", logger="mixhook"):
        for side in (8, 32, 12):
            for _ in range(12):
                model(torch.randn(2, 3, side, side))
                drawn.setdefault(side, set()).add(mix.last.info["grid"])
        with pytest.raises(ValueError, match="none of the grid sides .* fits its 5x5 map"):
            model(torch.randn(2, 3, 5, 5))
    assert mix.grids_for("conv1", 8) == (2, 4, 8) and drawn[8] <= {2, 4, 8} and len(drawn[8]) > 1
    assert mix.grids_for("conv1", 32) == (2, 4, 8, 16) and drawn[32] <= {2, 4, 8, 16} and len(drawn[32]) > 1
    assert mix.grids_for("conv1", 12) == (4,)  # 2: blocks of 6, which t_size 4 does not divide
    assert "PuzzleMix at 'conv1': grids auto -> (2, 4, 8) on its 8x8 map" in caplog.text
    assert caplog.text.count("on its 8x8 map") == 1  # once per side
    with pytest.raises(ValueError, match="grids must be grid sides >= 2 .* or 'auto'"):
        PuzzleMix("input", grids="all")
