"""Co-Mixup: each output a mix of several samples of its part of the batch, labelled block by block to keep
their saliency and to differ from the other outputs.

Paper: Kim, Choo, Jeong, Song. "Co-Mixup: Saliency Guided Joint Mixup with Supermodular Diversity." ICLR
2021. https://arxiv.org/abs/2102.03065. Authors' code: github.com/snu-mllab/Co-Mixup (``match.py``:
``get_onehot_matrix``, ``graphcut_wrapper``, ``graphcut_multi``, ``obj_fn``, ``resolve_label``,
``mix_input``; ``mixup.py``: ``mixup_process``; ``main.py``: the saliency and the compatibility
``A_dist``), with the values of its README's CIFAR-100 command. Their labelling calls GCO (research-only
license) through ``gco-wrapper``; :mod:`mixhook.solvers.swap` runs GCO's alpha-beta swap move for move.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..engine.card import Card
from ..engine.checks import check_non_negative, check_positive, check_spatial
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..engine.saliency import Saliency, SaliencyGuided, pinned_saliency
from ..functional import without_autocast
from ..sites import Leaf
from ..solvers.swap import swap_labelling

THRES_TYPES = ("hard", "soft")
# gco-wrapper's conversion of float energies to GCO's integers (pygco.py: _UNARY_FLOAT_PRECISION,
# _PAIRWISE_FLOAT_PRECISION, _SMOOTH_COST_PRECISION), truncated by astype(np.intc) as there
UNARY, PAIRWISE, SMOOTH = 100000, 1000, 100
SOFT = ((0.5, 0.5, 0.0), (0.5, 0.0, 0.5), (0.0, 0.5, 0.5))  # graphcut_wrapper's soft_label


# ------------------------------------------------------------------------------------ the authors' lines


def compatibility(saliency: torch.Tensor, size: int) -> torch.Tensor:
    """The authors' ``A_dist`` (``main.py``): the L1 distances between the samples' most salient
    ``size x size`` windows (``avg_pool2d(sc, size, stride=1)``'s argmax), float32; ``size`` is cut to the
    map's side (the authors' 8 on 32x32 images)."""
    side = min(size, *saliency.shape[-2:])
    z = F.avg_pool2d(saliency[:, None].float(), kernel_size=side, stride=1)[:, 0]
    flat = z.reshape(z.shape[0], -1).argmax(1)
    where = torch.stack([flat // z.shape[-1], flat % z.shape[-1]], 1).float()
    return (where[:, None] - where[None]).abs().sum(-1)


def obj_fn(cost_matrix, mask_onehot, beta, gamma):
    """The objective without thresholding (``match.py``'s ``obj_fn``), whose change ends the iterations."""
    n_output, height, width, n_input = mask_onehot.shape
    mask_idx_sum = mask_onehot.reshape(n_output, height * width, n_input).sum(1)
    loss = 0
    loss += torch.sum(cost_matrix.permute(1, 2, 0).unsqueeze(0) * mask_onehot)
    loss += (
        beta
        / 2
        * (
            ((mask_onehot[:, :-1, :, :] - mask_onehot[:, 1:, :, :]) ** 2).sum()
            + ((mask_onehot[:, :, :-1, :] - mask_onehot[:, :, 1:, :]) ** 2).sum()
        )
    )
    loss += gamma * (torch.sum(mask_idx_sum.sum(0) ** 2) - torch.sum(mask_idx_sum**2))
    return loss


def resolve_label(assigned: torch.Tensor) -> torch.Tensor:
    """``match.py``'s ``resolve_label``: for each pair of outputs with the same set of inputs, a unit cost
    on one input of each (the first for the first, the second for the second), so that they part."""
    add_cost = torch.zeros_like(assigned)
    dist = torch.min((assigned[:, None] - assigned[None]).abs().sum(-1), torch.tensor(1.0))
    coincide = torch.triu(1.0 - dist, diagonal=1)
    for i1, i2 in coincide.nonzero().tolist():
        nonzeros = assigned[i1].nonzero()
        if len(nonzeros) > 1:
            add_cost[i1][nonzeros[0]] = 1.0
            add_cost[i2][nonzeros[1]] = 1.0
    return add_cost


def graphcut(cost: torch.Tensor, beta: float, n_label: int = 0, add_idx=None) -> torch.Tensor:
    """``graphcut_multi``: the labels ``(H, W)`` of the ``(H, W, L)`` costs under the Potts smoothness
    ``beta`` (the extra labels of ``n_label`` 2 or 3, halves of two inputs ``add_idx``, a quarter of it to
    those inputs), as GCO's swap ends with them from gco-wrapper's integers (:mod:`~mixhook.solvers.swap`)."""
    import numpy as np

    height, width, n_input = cost.shape
    unary = np.ascontiguousarray(cost.numpy())
    pairwise = np.ones(shape=(n_input, n_input), dtype=np.float32) - np.eye(n_input, dtype=np.float32)
    if n_label == 2:
        pairwise[-1, :-1][add_idx] = 0.25
        pairwise[:-1, -1][add_idx] = 0.25
    elif n_label == 3:
        quarters = np.array([[0.25, 0.25, 1], [0.25, 1, 0.25], [1, 0.25, 0.25]])
        pairwise[-3:, :-3][:, add_idx] = quarters
        pairwise[:-3, -3:][add_idx, :] = quarters
    cost_v = beta * np.ones(shape=[height - 1, width], dtype=np.float32)
    cost_h = beta * np.ones(shape=[height, width - 1], dtype=np.float32)
    if np.abs(unary).max() * UNARY * 2 + beta * PAIRWISE * SMOOTH * 8 >= 2**31:
        raise ValueError(
            f"CoMixup: its graph cut's costs reach {np.abs(unary).max():.4g}, beyond the 32-bit integers GCO "
            "takes them as (x 100000); lower gamma, tau's share or beta"
        )
    labels = swap_labelling(
        (unary * UNARY).astype(np.intc),
        (pairwise * SMOOTH).astype(np.intc),
        (cost_v * PAIRWISE).astype(np.intc),
        (cost_h * PAIRWISE).astype(np.intc),
    )
    return torch.from_numpy(labels)


def graphcut_row(cost_penalty: torch.Tensor, label_count: torch.Tensor, beta: float, iter_idx: int):
    """``graphcut_wrapper``: one output's ``(H, W, N)`` labelling; after the first iteration an output of
    two or more inputs may also take half of each of two of them (its three most used, by ``topk``)."""
    height, width, n_input = cost_penalty.shape
    assigned = label_count > 0
    n_label = int(assigned.float().sum()) if iter_idx > 0 else 0
    if n_label == 2:
        cost_add = cost_penalty[:, :, assigned].mean(-1, keepdim=True) - 5e-4
        labels = graphcut(torch.cat([cost_penalty, cost_add], -1), beta, 2, assigned.numpy())
        onehot = F.one_hot(labels, n_input + 1).float()
        halves = torch.zeros([1, 1, n_input])
        halves[:, :, assigned] = 0.5
        return onehot[:, :, :n_input] + onehot[:, :, n_input:] * halves
    if n_label >= 3:
        soft = torch.tensor(SOFT)
        _, indices = torch.topk(label_count, k=3)
        assigned = torch.zeros_like(assigned)
        assigned[indices] = True
        cost_add = torch.matmul(cost_penalty[:, :, assigned], soft) - 5e-4
        labels = graphcut(torch.cat([cost_penalty, cost_add], -1), beta, 3, assigned.numpy())
        onehot = F.one_hot(labels, n_input + 3).float()
        halves = torch.zeros([3, n_input])
        halves[:, assigned] = soft
        return onehot[:, :, :n_input] + torch.matmul(onehot[:, :, n_input:], halves)
    labels = graphcut(cost_penalty, beta)
    return F.one_hot(labels, n_input).float().reshape(height, width, n_input)


def labelling(cost_matrix, A, prior, init, beta, gamma, eta, thres, thres_type, resolve, niter):
    """``get_onehot_matrix`` on the host: the ``(N, H, W, N)`` own-content weights of each of the ``N``
    outputs of one part from its ``N`` inputs' costs ``(N, H, W)`` (their negative normalised saliency),
    compatibility ``A``, Dirichlet draw ``prior`` and initial labels ``init`` ``(N, H, W)``: each output in
    turn labelled by a graph cut with the others' use of each input as a modular penalty, ``niter`` times
    or until the objective stops changing. float32, as the authors'."""
    n_input, height, width = cost_matrix.shape
    thres = thres * height * width
    beta, gamma, eta = beta / height / width, gamma / height / width, eta / height / width
    add_cost = None
    cost_matrix = cost_matrix - eta * torch.log(prior.reshape(n_input, 1, 1) + 1e-8)
    mask_onehot = F.one_hot(init.reshape(-1), n_input).float().reshape([n_input, height, width, n_input])
    loss_prev = obj_fn(cost_matrix, mask_onehot, beta, gamma)
    penalty = F.one_hot(init.reshape(-1), n_input).float().sum(0).reshape(-1, 1, 1)
    for iter_idx in range(niter):
        for i in range(n_input):
            label_count = mask_onehot[i].reshape([height * width, n_input]).sum(0)
            penalty -= label_count.reshape(-1, 1, 1)
            p = penalty.squeeze()
            if thres_type == "hard":  # (the authors' precedence: ((A @ p > thres) * A) @ p)
                modular_penalty = (2 * gamma * ((A @ p > thres).float() * A @ p)).reshape(-1, 1, 1)
            else:
                modular_penalty = (2 * gamma * ((A @ p > thres).float() * (A @ p - thres))).reshape(-1, 1, 1)
            if add_cost is not None:
                cost_penalty = (
                    cost_matrix + modular_penalty + gamma * add_cost[i].reshape(-1, 1, 1)
                ).permute(1, 2, 0)
            else:
                cost_penalty = (cost_matrix + modular_penalty).permute(1, 2, 0)
            mask_onehot[i] = graphcut_row(cost_penalty, label_count, beta, iter_idx)
            penalty += mask_onehot[i].reshape([height * width, n_input]).sum(0).reshape(-1, 1, 1)
        if iter_idx == niter - 2 and resolve:
            add_cost = resolve_label((mask_onehot.reshape(n_input, -1, n_input).sum(1) > 0).float())
        loss = obj_fn(cost_matrix, mask_onehot, beta, gamma)
        if (loss_prev - loss).abs() / loss.abs() < 1e-6:
            break
        loss_prev = loss
    return mask_onehot


# ------------------------------------------------------------------------------------ the mixer


class CoMixup(SaliencyGuided, RegionMixer):
    """Co-Mixup (Kim et al. 2021) at the input (the paper) or at any layer whose output is a square
    ``(B, C, W, W)`` map: each mixed row a mix of several samples of its part of the batch.

    On each training forward, with probability ``prob``: the batch is cut into parts of ``part``
    consecutive samples; in each part of ``N``, the ``N`` outputs' ``n x n`` blocks (``n`` drawn from
    ``grids``) are labelled with the input they show (or half of each of two) by minimising, over all the
    part's outputs at once,

        ``sum_outputs [ -saliency kept - eta * log prior + beta * label changes between blocks ]
        + gamma * (each input's use by the other outputs, above tau: the supermodular diversity)``

    (the saliency each input's share of its own, ``prior ~ Dirichlet(alpha)``, the diversity weighted by
    the compatibility ``A = (1 - omega) I + omega * A_dist`` of the samples' most salient windows), by the
    authors' iterations: each output in turn by a multi-label graph cut with the others fixed, ``niter``
    times (:func:`labelling`). Then output ``o`` is ``sum_i M[o, i] * h_i`` block by block and its labels
    are the inputs' shares of its blocks: a mixture of up to ``N`` samples per row
    (:attr:`~mixhook.MixState.mixture`; ``loss`` and ``targets`` take it: a per-sample criterion,
    ``reduction="none"``). ``.last.info``: ``"grid"``, ``"sources"`` (``(B, n, n, N)`` weights of
    the part's inputs), ``"saliency"``, ``"prior"``, ``"init"``.

    **Equal to the authors' code** on the same saliency and draws (tested: the labels, the mixed batch
    and the label weights, float32 as theirs, and the loss and gradients through it in float64). Their
    graph cuts call GCO's alpha-beta swap (research-only); :mod:`mixhook.solvers.swap` runs the same moves
    and ends with GCO's labels, checked against GCO on recorded and, where ``gco-wrapper`` is installed,
    live problems. The labelling runs on the host in float32 whatever the model's dtype and device: it
    equals the authors' code run on the CPU (theirs runs its float32 ops on the model's device, where a
    GPU's last bits, or its ties in ``topk``, may move a cost across an integer of GCO's and so a label);
    one copy of the saliency to the host and of the weights back per step. Costs beyond the 32-bit
    integers GCO takes are refused in one line (an extreme ``gamma``), as is a saliency that is not finite;
    a sample whose saliency is zero everywhere (a saturated loss's gradient) is taken as equally salient
    everywhere, where the authors' costs are NaN; where a part's most salient windows are all at one place
    (maps of at most ``compat_size``) the compatibility is left out (``A = (1 - omega) I``), where theirs
    is NaN.

    **Saliency**: at the input, as the authors, the gradient of the label loss (``saliency="gradient"``:
    one more forward and backward in eval mode, ``use_targets(y)`` before each forward); at a hidden layer
    the map's own ``"activation"`` (no extra pass) or its ``"gradient"``. Not built: the authors' clean
    term, the cross-entropy of that extra forward run in training mode and trained on (their
    ``clean_lam``); ``clean=True`` trains on the clean rows beside the mixed ones instead. Their loss is
    the binary cross-entropy of the softmax against the mixed labels (pass it as the criterion to match).

    Args:
        layer: ``"input"`` (the paper) or a layer with a square ``(B, C, W, W)`` output; each grid side
            must divide ``W``.
        alpha: the Dirichlet concentration of the prior over a part's inputs, > 0 (the authors': 2.0).
        grids: the grid side ``n``, or the sides drawn from uniformly, one per batch (the authors: 4; their
            ``-1``: 2, 4, 8, 16, one per batch, or per part in their parallel workers).
        part: the samples labelled together, > 1 (the authors' ``m_part``: 20; the last part takes what
            is left, and a part of one sample stays as it is).
        beta: label smoothness (0.32); gamma: the diversity's weight (1.0); tau: the share of blocks above
            which another output's use of an input is penalised (``m_thres``: 0.83); thres_type:
            ``"hard"`` (the authors') or ``"soft"``; eta: the prior's weight (0.05); omega: the
            compatibility's weight (0.001); compat_size: its window's side (8, cut to the map's side);
            niter: the outer iterations (4); resolve: part outputs made of the same inputs before the last
            iteration (True).
        saliency: ``"gradient"`` (default) or ``"activation"`` (hidden layers).
        prob, generator, batch_dim, padding, layout: as :class:`~mixhook.CutMix`.

    ``pin`` also takes ``grid``, ``saliency`` (``(B, W, W)``), ``prior`` (``(B,)``: each part's Dirichlet
    draw) and ``init`` (``(B, n, n)``: the initial labels, each part's inputs counted from 0).
    """

    card = Card(
        paper="Kim et al. 2021",
        mixes="each output from several samples of its part, its blocks labelled by graph cuts",
        where="input, square maps (+ a gradient pass)",
        family="saliency",
        traits=("several",),
        signature=(
            "CoMixup(layer, alpha=2.0, grids=4, part=20, beta=0.32, gamma=1.0, tau=0.83, eta=0.05, "
            'omega=0.001, niter=4, saliency="gradient")'
        ),
        hook='forward, square `(B,C,W,W)` outputs (+ one forward/backward for `"gradient"`)',
        commands="`mixup=comixup`",
        details=(
            "Parts of `part` samples; in each, every output's `n×n` blocks labelled with the input they show "
            "(or half of each of two) by the authors' iterations: each output in turn by a multi-label graph "
            "cut of its saliency kept, a Dirichlet prior, label smoothness and the supermodular diversity "
            "(the others' use of each input above `tau`, weighted by the compatibility of the most salient "
            "windows); `h'_o = Σ_i M[o,i]·h_i` block by block, its labels the inputs' shares (a mixture of up"
            " to `part` samples per row). Their graph cuts call GCO's alpha-beta swap (research-only); here "
            "the same moves, GCO's labels exactly (checked against GCO). Equal to the authors' code on the "
            "same saliency and draws: labels, mixed batch, label weights, loss and gradients"
        ),
        example={"layer": "input", "grids": 2, "part": 4},
        drawn={"parts": True, "seed": 1},
    )

    pin_keys = ("grid", "saliency", "prior", "init")
    index_is_permutation = False  # (the second source of each row: inputs are taken more than once)
    dense_targets = "mixes up to `part` samples per block: no per-position targets (not built)"

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        grids: int | Sequence[int] = 4,
        part: int = 20,
        beta: float = 0.32,
        gamma: float = 1.0,
        tau: float = 0.83,
        thres_type: str = "hard",
        eta: float = 0.05,
        omega: float = 0.001,
        compat_size: int = 8,
        niter: int = 4,
        resolve: bool = True,
        saliency: str = "gradient",
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout)
        self.saliency = Saliency("CoMixup", saliency, None, self.layers)
        grids = tuple(grids) if isinstance(grids, (list, tuple)) else (grids,)
        if not grids or any(isinstance(g, bool) or not isinstance(g, int) or g < 2 for g in grids):
            raise ValueError(f"grids must be grid sides >= 2 (the authors': 4), got {grids!r}")
        for name, value, low in (("part", part, 2), ("niter", niter, 1), ("compat_size", compat_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if thres_type not in THRES_TYPES:
            raise ValueError(f"thres_type must be one of {', '.join(THRES_TYPES)}, got {thres_type!r}")
        check_positive("alpha", alpha)
        self.grids, self.part, self.niter, self.compat_size = grids, part, niter, compat_size
        self.beta, self.gamma = check_non_negative("beta", beta), check_non_negative("gamma", gamma)
        self.tau, self.eta = check_non_negative("tau", tau), check_non_negative("eta", eta)
        self.omega = check_non_negative("omega", omega)
        self.thres_type, self.resolve = thres_type, bool(resolve)
        self.samples_per_row = part

    def __repr__(self) -> str:
        return (
            f"CoMixup(layer={self._layer_spec!r}, alpha={self.alpha}, grids={self.grids}, part={self.part}, "
            f"beta={self.beta}, gamma={self.gamma}, tau={self.tau}, eta={self.eta}, omega={self.omega}, "
            f"niter={self.niter}, {self.saliency!r}, prob={self.prob})"
        )

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        if len(leaves) == 1 and leaves[0].tensor.ndim == 3:
            raise TypeError(
                f"CoMixup at {spec!r} needs a (B, C, H, W) map, got {tuple(leaves[0].tensor.shape)}: it does "
                "not mix ViT tokens; choose a convolutional layer or the input"
            )
        h = check_spatial("CoMixup", spec, leaves)
        height, width = h.shape[-2:]
        if height != width:
            raise ValueError(
                f"CoMixup at {spec!r}: its {height}x{width} map is not square (its grid is n x n blocks of "
                "equal sides); choose a square layer"
            )
        for g in self.grids:
            if g > width or width % g:
                fits = [s for s in range(2, width + 1) if width % s == 0]
                raise ValueError(
                    f"CoMixup at {spec!r}: grid side {g} does not fit its {width}x{width} map (a grid side "
                    f"must divide {width}: {fits}); choose grids among those"
                )

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.ones((), dtype=torch.float64)  # (unused: the weights are the labelling's)

    def draw_index(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.arange(n, device=generator.device)  # (unused: the labelling chooses the sources)

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, width = h.shape[0], h.shape[-1]
        grid = draw.pinned.get("grid")
        if grid is None and len(self.grids) == 1:
            grid = self.grids[0]  # (nothing drawn: the prior is the generator's first draw, as theirs)
        elif grid is None:
            pick = torch.randint(len(self.grids), (), generator=draw.generator, device=draw.generator.device)
            grid = self.grids[int(pick)]
        elif grid not in self.grids:
            raise ValueError(f"pinned grid {grid!r} is not one of grids={self.grids}")
        saliency = pinned_saliency("CoMixup", draw.pinned, n, width, width, torch.device("cpu")).float()
        prior, init = self._draws(draw, n, grid)
        mask = self.masks(saliency, prior, init, grid)  # (B, n, n, part) on the host
        with without_autocast(h):
            mixed, weights = self._apply(h, mask.to(h.device), grid)
        order = weights.argsort(dim=1, descending=True, stable=True)
        k = max(2, int((weights > 0).sum(1).max()))
        starts = torch.arange(0, n, self.part)[torch.arange(n) // self.part]
        shares = weights.gather(1, order[:, :k])
        rows = order[:, :k] + starts[:, None]  # (the batch's rows; a term of no weight: the first's)
        indices = torch.where(shares > 0, rows, rows[:, :1]).T.contiguous()  # (K, B)
        shares = shares.T.contiguous()
        info = {"grid": grid, "sources": mask, "saliency": saliency, "prior": prior, "init": init}
        return Mixed(
            {path: mixed}, lam=shares[0], index=indices[1], info=info, mixture=(indices, shares)
        )  # fmt: skip

    def _draws(self, draw: Draw, n: int, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each part's Dirichlet draw ``(B,)`` and initial labels ``(B, n, n)`` on the host: drawn (the
        authors' order: the prior, then the labels, part by part), each replaced by its pinned value where
        one is pinned (checked: one line where it does not fit)."""
        gen, device = draw.generator, draw.generator.device
        priors, inits, sizes = [], [], []
        for start in range(0, n, self.part):
            size = min(self.part, n - start)
            concentration = torch.full((size,), float(self.alpha), device=device)
            priors.append(torch._sample_dirichlet(concentration, generator=gen))
            inits.append(torch.randint(size, (size, grid, grid), generator=gen, device=device))
            sizes += [size] * size
        prior, init = torch.cat(priors).float().cpu(), torch.cat(inits).cpu()
        pinned = draw.pinned.get("prior")
        if pinned is not None:
            prior = torch.as_tensor(pinned).detach().float().cpu()
            if prior.shape != (n,) or not (torch.isfinite(prior) & (prior > 0)).all():
                raise ValueError(
                    f"pinned prior of shape {tuple(prior.shape)}: it must be ({n},) positive weights (each "
                    "part's Dirichlet draw)"
                )
        pinned = draw.pinned.get("init")
        if pinned is not None:
            init = torch.as_tensor(pinned).detach().cpu()
            limit = torch.tensor(sizes).view(-1, 1, 1)
            if (
                init.shape != (n, grid, grid)
                or init.is_floating_point()
                or ((init < 0) | (init >= limit)).any()
            ):
                raise ValueError(
                    f"pinned init of shape {tuple(init.shape)}: it must be ({n}, {grid}, {grid}) labels, "
                    f"each row's counted from 0 within its part of at most part={self.part} samples"
                )
            init = init.long()
        return prior, init

    def masks(
        self, saliency: torch.Tensor, prior: torch.Tensor, init: torch.Tensor, grid: int
    ) -> torch.Tensor:
        """The ``(B, n, n, part)`` weights of each row's part's inputs (``mixup_process``'s partition,
        with the authors' ``A_dist`` from ``saliency`` ``(B, W, W)``), float32 on the host. A part of one
        sample keeps it whole."""
        n, width = saliency.shape[0], saliency.shape[-1]
        if not torch.isfinite(saliency).all():
            raise ValueError("CoMixup: the saliency is not finite (a NaN or inf gradient or activation)")
        sc = F.avg_pool2d(saliency, width // grid)
        flat = (sc.reshape(n, -1).sum(1) == 0)[:, None, None]  # (no saliency at all: a saturated loss)
        sc = torch.where(flat, torch.ones_like(sc), sc)  # (each block alike, where theirs would be NaN)
        distance = compatibility(saliency, self.compat_size)
        out = torch.zeros(n, grid, grid, self.part)
        for start in range(0, n, self.part):
            stop = min(start + self.part, n)
            size = stop - start
            if size == 1:
                out[start, ..., 0] = 1.0
                continue
            sc_part = sc[start:stop]
            cost_matrix = -(sc_part / sc_part.reshape(size, -1).sum(1).reshape(size, 1, 1))
            a_dist = distance[start:stop, start:stop]
            total = torch.sum(a_dist)  # (all windows at one place: no compatibility, where theirs is NaN)
            a_dist = a_dist / total * size if total > 0 else a_dist
            A = (1 - self.omega) * torch.eye(size) + self.omega * a_dist
            out[start:stop, ..., :size] = labelling(
                cost_matrix, A, prior[start:stop], init[start:stop], self.beta, self.gamma, self.eta,
                self.tau, self.thres_type, self.resolve, self.niter,
            )  # fmt: skip
        return out

    def _apply(self, h: torch.Tensor, mask: torch.Tensor, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``mix_input``: each output ``sum_i M[o, i] * h_i`` over its part, the mask upsampled to the map
        (nearest), and the label weights ``(B, part)`` float64: each input's share of the output's blocks.
        A part of one sample keeps it."""
        n, width = h.shape[0], h.shape[-1]
        mixed = []
        for start in range(0, n, self.part):
            stop = min(start + self.part, n)
            m = mask[start:stop, ..., : stop - start].permute(0, 3, 1, 2)
            m = F.interpolate(m, size=width, mode="nearest").to(h.dtype)
            if stop - start == 1:
                mixed.append(h[start:stop] * m)
                continue
            # at most two inputs share a block (one, or halves of two): their two products and one sum, as
            # exact as the authors' sum over every input (no matmul, whose TF32 would round the map)
            shares, which = m.topk(2, dim=1)  # (outputs, 2, W, W)
            inputs = h[start:stop].unsqueeze(0).expand(stop - start, -1, -1, -1, -1)
            first, second = (
                inputs.gather(1, which[:, k, None, None].expand(-1, 1, h.shape[1], -1, -1))[:, 0]
                for k in (0, 1)
            )
            mixed.append(shares[:, :1] * first + shares[:, 1:] * second)
        weights = mask.to("cpu", torch.float64).sum((1, 2)) / (grid * grid)
        return torch.cat(mixed), weights
