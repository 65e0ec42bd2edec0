"""PuzzleMix: each sample's blocks labelled own / mixed / partner by a graph cut on saliency and smoothness,
then each side's salient blocks moved by a discrete transport into the region it keeps.

Paper: Kim, Choo, Song. "Puzzle Mix: Exploiting Saliency and Local Statistics for Optimal Mixup." ICML
2020. https://arxiv.org/abs/2009.06962. Authors' code: github.com/snu-mllab/PuzzleMix (``mixup.py``:
``mixup_graph``, ``graphcut_multi``, ``neigh_penalty``, ``mask_transport``, ``transport_image``; the
saliency in ``main.py``). Their labelling calls GCO (research-only license) through ``gco-wrapper``; this
one is solved exactly by :mod:`mixhook.solvers.graphcut` (one minimum cut, SciPy's maximum flow).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..engine.card import Card
from ..engine.checks import (
    check_non_negative,
    check_normalisation,
    check_spatial,
    per_channel,
)
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..engine.saliency import Saliency, SaliencyGuided, pinned_saliency
from ..functional import without_autocast
from ..sites import INPUT, Leaf
from ..solvers.graphcut import min_labelling
from ..transfer import to_device

GRIDS = (2, 4, 8, 16)  # the authors' 2 ** np.random.randint(1, 5)
AUTO = "auto"
log = logging.getLogger("mixhook")


def priors(lam: float, n_labels: int, eps: float = 1e-8) -> list[float]:
    """``-log`` of each label's binomial weight under ``lam`` (the authors' ``prior``, before ``eta``)."""
    if n_labels == 2:
        return [-math.log(lam + eps), -math.log(1 - lam + eps)]
    return [-math.log(lam**2 + eps), -math.log(2 * lam * (1 - lam) + eps), -math.log((1 - lam) ** 2 + eps)]


def neigh_penalty(input1: torch.Tensor, input2: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data smoothness between vertically and horizontally adjacent blocks of ``k x k`` pooled cells
    when the upper/left one comes from ``input1`` and the lower/right one from ``input2`` (the authors'
    ``neigh_penalty``)."""
    pw_x = input1[:, :, :-1, :] - input2[:, :, 1:, :]
    pw_y = input1[:, :, :, :-1] - input2[:, :, :, 1:]
    pw_x = pw_x[:, :, k - 1 :: k, :]
    pw_y = pw_y[:, :, :, k - 1 :: k]
    pw_x = F.avg_pool2d(pw_x.abs().mean(1), kernel_size=(1, k))
    pw_y = F.avg_pool2d(pw_y.abs().mean(1), kernel_size=(k, 1))
    return pw_x, pw_y


def puzzle_terms(saliency, values, index, grid, beta, gamma, neigh_size):
    """The labelling's terms of a batch as the authors' ``mixup_graph`` builds them, on the device: each
    sample's normalised block saliency and its partner's, each with the smoothness terms folded in, and the
    edges' pairwise weights (before ``beta`` is added), ``(B, n, n)``, ``(B, n, n)``, ``(B, n-1, n)``,
    ``(B, n, n-1)``; and the unfolded normalised saliencies (for the transport)."""
    n_samples, width = saliency.shape[0], saliency.shape[-1]
    block = width // grid
    neigh = min(neigh_size, block)
    beta = beta / grid / 16
    pooled = F.avg_pool2d(saliency, block)
    own = pooled / pooled.reshape(n_samples, -1).sum(1).reshape(n_samples, 1, 1)
    partner = own[index]
    in1 = F.avg_pool2d(values, neigh)
    in2 = in1[index]
    k = block // neigh
    pw = {}
    for a, first in ((0, in2), (1, in1)):
        for b, second in ((0, in2), (1, in1)):
            pw[a, b] = tuple(beta * gamma * t for t in neigh_penalty(first, second, k))
    own_u, partner_u = own.clone(), partner.clone()
    for axis, d in ((1, 0), (2, 1)):  # rows (pw_x), then columns (pw_y)
        head = (slice(None), slice(None, -1)) if axis == 1 else (slice(None), slice(None), slice(None, -1))
        tail = (slice(None), slice(1, None)) if axis == 1 else (slice(None), slice(None), slice(1, None))
        partner_u[head] += (pw[1, 0][d] + pw[1, 1][d]) / 2.0
        own_u[head] += (pw[0, 1][d] + pw[0, 0][d]) / 2.0
        partner_u[tail] += (pw[0, 1][d] + pw[1, 1][d]) / 2.0
        own_u[tail] += (pw[1, 0][d] + pw[0, 0][d]) / 2.0
    w_v, w_h = ((pw[1, 0][d] + pw[0, 1][d] - pw[1, 1][d] - pw[0, 0][d]) / 2 for d in (0, 1))
    return own_u, partner_u, w_v, w_h, own, beta


def quantized(own_u, partner_u, w_v, w_h, lam, beta, eta, n_labels, grid):
    """The integer energy the authors give GCO (``graphcut_multi``'s ``large_val`` scaling, truncated),
    times ``(n_labels - 1)**2``, in :func:`~mixhook.solvers.graphcut.min_labelling`'s form (int64 CPU
    tensors, from float64 ones): label ``i`` of a block gives it the own-content weight
    ``1 - i / (n_labels - 1)``."""
    large = 1000 * grid**2
    prior = [eta * p / grid**2 for p in priors(lam, n_labels)]
    levels = torch.linspace(0, 1, n_labels, dtype=torch.float64).tolist()  # (numpy's linspace values)
    cost = torch.stack([(1 - t) * partner_u + t * own_u + prior[i] for i, t in enumerate(levels)], dim=-1)
    unary = (large * cost).to(torch.int64) * (n_labels - 1) ** 2  # (truncated, as numpy's astype)
    return unary, (large * (w_v + beta)).to(torch.int64), (large * (w_h + beta)).to(torch.int64)


_COSTS: dict[int, torch.Tensor] = {}


def cost_matrix(grid: int) -> torch.Tensor:
    """The squared distance between every two blocks of a ``grid x grid`` grid over ``(grid - 1)**2`` (the
    authors' ``cost_matrix``), float32 on the CPU, ``(grid**2, grid**2)``."""
    if grid not in _COSTS:
        i, j = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
        i, j = i.reshape(-1), j.reshape(-1)
        c = (i[:, None] - i[None]) ** 2 + (j[:, None] - j[None]) ** 2
        _COSTS[grid] = c.float() / (grid - 1) ** 2
    return _COSTS[grid]


def mask_transport(mask: torch.Tensor, grad_pool: torch.Tensor, eps: float) -> torch.Tensor:
    """The authors' ``mask_transport``: each block of the kept region (``mask > 0``) takes a salient block
    of the sample, close by, each at most once (``grid`` rounds of row choices and column conflicts)."""
    block_num = mask.shape[-1]
    c = cost_matrix(block_num).to(mask.device, mask.dtype).unsqueeze(0)
    z = (mask > 0).to(mask.dtype)
    cost = eps * c - grad_pool.reshape(-1, block_num**2, 1) * z.reshape(-1, 1, block_num**2)
    for _ in range(block_num):
        row_best = cost.min(-1)[1]
        plan = torch.zeros_like(cost).scatter_(-1, row_best.unsqueeze(-1), 1)
        cost_fight = plan * cost
        col_best = cost_fight.min(-2)[1]
        plan_win = torch.zeros_like(cost).scatter_(-2, col_best.unsqueeze(-2), 1) * plan
        plan_lose = (1 - plan_win) * plan
        cost = cost + plan_lose
    return plan_win


def transport_image(img: torch.Tensor, plan: torch.Tensor, block_num: int, block_size: int) -> torch.Tensor:
    """The authors' ``transport_image`` (any number of channels): block ``j`` of the result is the block
    ``i`` of ``img`` with ``plan[i, j] = 1`` (zero where none)."""
    b, c = img.shape[:2]
    patches = img.reshape(b, c, block_num, block_size, block_num * block_size).transpose(-2, -1)
    patches = patches.reshape(b, c, block_num, block_num, block_size, block_size).transpose(-2, -1)
    patches = patches.reshape(b, c, block_num**2, block_size, block_size).permute(0, 1, 3, 4, 2).unsqueeze(-1)
    moved = plan.transpose(-2, -1)[:, None, None, None].matmul(patches).squeeze(-1).permute(0, 1, 4, 2, 3)
    moved = moved.reshape(b, c, block_num, block_num, block_size, block_size)
    moved = moved.transpose(-2, -1).reshape(b, c, block_num, block_num * block_size, block_size)
    return moved.transpose(-2, -1).reshape(b, c, block_num * block_size, block_num * block_size)


class PuzzleMix(SaliencyGuided, RegionMixer):
    """PuzzleMix (Kim et al. 2020) at the input (the paper) or at any layer whose output is a square
    ``(B, C, W, W)`` map.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``, ``lam ~
    Beta(alpha, alpha)``, a permutation ``index``, a grid side ``n`` from ``grids`` and the saliency ``S``
    of every sample's map. The map is cut into ``n x n`` blocks, and each sample's blocks are labelled with
    one of ``n_labels`` own-content weights (``1, 0`` or ``1, 1/2, 0``) by minimising

        ``sum_blocks [ m * s_partner + (1 - m) * s_own + eta * prior(m; lam) / n**2 ]
        + sum_adjacent [ beta' + smoothness ] * (m_p - m_q)**2``

    (``s`` each block's share of its image's saliency, ``prior`` the binomial ``-log`` weight of the label
    under ``lam``, ``beta' = beta / n / 16``, the smoothness ``gamma * beta'`` times how much the content
    jumps across the edge for each pair of sources: the authors' ``mixup_graph`` and ``graphcut_multi``).
    Then (``transport=True``) each side's salient blocks are moved by the authors' discrete transport
    (``t_eps``, at ``t_size`` cells) into the blocks it keeps, and

        ``h' = M * T_own(h) + (1 - M) * T_partner(h[index])``,   ``lam_i = mean(M_i)``

    (one lam per sample: ``loss`` needs a per-sample criterion, ``reduction="none"``).
    ``.last.info``: ``"grid"``, ``"mask"`` (``(B, n, n)`` own-content weights), ``"saliency"``,
    ``"drawn_lam"`` (the Beta draw; ``.last.lam`` is the mask's mean), ``"clipped"`` (see below).

    **The labelling is solved exactly**, by one minimum cut of the whole batch (Ishikawa's construction
    for ordered labels and a convex pairwise term; SciPy's maximum flow on the host: one copy of the
    terms there and of the masks back per step, none per sample): :mod:`mixhook.solvers.graphcut`. The
    authors run GCO's alpha-beta swap, whose local minimum can be worse; on the same terms, the masks
    agree wherever the swap finds the optimum. Their energy is quantised to integers as theirs.

    **Saliency**: at the input, as the authors, the gradient of the label loss (``saliency="gradient"``:
    one more forward and backward in eval mode, ``use_targets(y)`` before each forward). At a hidden
    layer (the authors do plain Manifold Mixup there, not PuzzleMix) the map's own ``"activation"``
    (no extra pass) or its ``"gradient"``. The smoothness reads the map's values: at the input the
    images un-normalised with ``mean``/``std`` when given (the authors' ``input * std + mean``, pixels in
    [0, 1]), else as they come; at a hidden layer the map scaled to [0, 1] over the batch. A pairwise
    weight the smoothness makes negative (``gamma > 1``, or values outside [0, 1]) would make the
    labelling non-submodular: it is set to 0 and counted in ``.last.info["clipped"]``.

    Equal to the authors' code on the same draws for the deterministic parts (tested): the unary and
    pairwise terms, their quantisation, the transport plans and images, the mixed batch and its label
    weights given a labelling; the labelling's energy equals the exact optimum found by enumeration.
    Not built: the authors' adversarial noise (``adv_p``) and clean-input loss (``clean_lam``).

    Args:
        layer: ``"input"`` (the paper) or a layer with a square ``(B, C, W, W)`` output; each grid side
            must divide ``W``.
        alpha: Beta concentration of lam, > 0 (the authors' CIFAR runs: 1.0).
        grids: the grid sides drawn from, uniformly (the authors: 2, 4, 8, 16), each dividing the map's side;
            ``"auto"``: those of the authors' that fit the map (and ``t_size``), found per map side and
            logged once (``mixhook`` logger): 2, 4, 8 on digits' 8x8 images, all four on CIFAR's 32x32.
        n_labels: 2 or 3 (the authors' CIFAR runs: 3).
        beta, gamma, eta: label smoothness, data smoothness, prior weight (theirs: 1.2, 0.5, 0.2).
        neigh_size: the cell size of the data smoothness (theirs: 4; at most the block size).
        transport: move the salient blocks (theirs: True); ``t_eps``: the transport's distance cost
            (theirs: 0.8); ``t_size``: the transport's cell size (their CIFAR runs: 4; ``None``: the
            block size, their ``-1``).
        saliency: ``"gradient"`` (default) or ``"activation"`` (hidden layers).
        mean, std: the input's normalisation, per channel, to un-normalise it for the smoothness.
        prob, generator, batch_dim, padding, layout: as :class:`~mixhook.CutMix`.

    ``pin`` also takes ``grid`` and ``saliency`` (``(B, W, W)``).
    """

    card = Card(
        paper="Kim et al. 2020",
        mixes="blocks labelled by a graph cut on saliency, then moved",
        where="input, square maps (+ a gradient pass)",
        family="saliency",
        traits=("pixels",),
        signature=(
            "PuzzleMix(layer, alpha=1.0, grids=(2, 4, 8, 16), n_labels=3, beta=1.2, gamma=0.5, eta=0.2, "
            'transport=True, t_size=4, saliency="gradient")'
        ),
        hook='forward, square `(B,C,W,W)` outputs (+ one forward/backward for `"gradient"`)',
        commands="`mixup=puzzlemix`",
        details=(
            "An `n×n` grid (`n` drawn from `grids`), each sample's blocks labelled with own-content weights "
            "`1, ½, 0` by the exact minimum of the authors' energy (saliency kept, label and data "
            "smoothness, a lam prior): one minimum cut for the whole batch (Ishikawa's construction, SciPy's "
            "max-flow; the authors run GCO's alpha-beta swap, research-only); then the authors' transport "
            "moves each side's salient blocks into what it keeps; `h' = M·T(h) + (1-M)·T'(h[index])`, lam ← "
            "`mean(M)` per sample; terms, quantisation, transport and mix equal to the authors' code on the "
            "same draws, the labelling's energy equal to the enumerated optimum; at hidden layers on the "
            "map's own saliency (the authors mix there with plain mixup)"
        ),
        example={"layer": "input", "grids": "auto"},
        drawn={"seed": 3},  # a draw whose labelling mixes both images,
    )

    pin_keys = ("grid", "saliency")

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 1.0,
        grids: Sequence[int] | str = GRIDS,
        n_labels: int = 3,
        beta: float = 1.2,
        gamma: float = 0.5,
        eta: float = 0.2,
        neigh_size: int = 4,
        transport: bool = True,
        t_eps: float = 0.8,
        t_size: int | None = 4,
        saliency: str = "gradient",
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout)
        self.saliency = Saliency("PuzzleMix", saliency, None, self.layers)
        if grids != AUTO:
            grids = tuple(grids) if isinstance(grids, (list, tuple)) else (grids,)
            if not grids or any(isinstance(g, bool) or not isinstance(g, int) or g < 2 for g in grids):
                raise ValueError(
                    f"grids must be grid sides >= 2 (the authors': 2, 4, 8, 16) or 'auto', got {grids!r}"
                )
        if n_labels not in (2, 3):
            raise ValueError(f"n_labels must be 2 or 3 (own/partner, or own/half/partner), got {n_labels!r}")
        for name, value in (("neigh_size", neigh_size), ("t_size", t_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.grids, self.n_labels = grids, n_labels
        self._fitting: dict[tuple, tuple[int, ...]] = {}  # (map side, settings) -> the grid sides that fit
        self.beta, self.gamma = check_non_negative("beta", beta), check_non_negative("gamma", gamma)
        self.eta, self.t_eps = check_non_negative("eta", eta), check_non_negative("t_eps", t_eps)
        self.neigh_size, self.transport, self.t_size = neigh_size, bool(transport), t_size
        self.mean, self.std = check_normalisation(mean, std)
        if self.transport:  # moved blocks carry their labels away: no per-position labels to follow
            self.dense_targets = (
                "moves blocks by its transport: dense targets would not follow (transport=False)"
            )

    def __repr__(self) -> str:
        return (
            f"PuzzleMix(layer={self._layer_spec!r}, alpha={self.alpha}, grids={self.grids}, "
            f"n_labels={self.n_labels}, transport={self.transport}, {self.saliency!r}, prob={self.prob})"
        )

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_spatial("PuzzleMix", spec, leaves)
        height, width = h.shape[-2:]
        if height != width:
            raise ValueError(
                f"PuzzleMix at {spec!r}: its {height}x{width} map is not square (its grid is n x n blocks of "
                "equal sides); choose a square layer"
            )
        self.grids_for(spec, width)

    def grids_for(self, spec: str, width: int) -> tuple[int, ...]:
        """The grid sides drawn from on a ``width x width`` map at ``spec``: ``grids``, checked to fit it
        (one line where one does not), or with ``grids="auto"`` the authors' sides that fit (logged); worked
        out once per map side and settings (``check_leaves`` and ``mix`` both ask)."""
        key = (width, self.grids, self.transport, self.t_size, self.neigh_size)  # (settings changed: anew)
        found = self._fitting.get(key)
        if found is not None:
            return found
        if self.grids == AUTO:
            found = tuple(g for g in GRIDS if not self._misfit(g, width))
            if not found:
                raise ValueError(
                    f"PuzzleMix at {spec!r}: none of the grid sides {GRIDS} fits its {width}x{width} map "
                    f"(with neigh_size={self.neigh_size}, t_size={self.t_size}); choose an earlier layer, or "
                    f"grids that divide {width}"
                )
            log.info("PuzzleMix at %r: grids auto -> %s on its %dx%d map", spec, found, width, width)
        else:
            for g in self.grids:
                why = self._misfit(g, width)
                if why:
                    raise ValueError(f"PuzzleMix at {spec!r}: {why}")
            found = self.grids
        self._fitting[key] = found
        return found

    def _misfit(self, g: int, width: int) -> str | None:
        """Why grid side ``g`` cannot cut a ``width x width`` map (``None``: it can)."""
        if g > width or width % g:
            fits = [s for s in range(2, width + 1) if width % s == 0]
            return (
                f"grid side {g} does not fit its {width}x{width} map (a grid side must divide {width}: "
                f"{fits}); choose grids among those, or grids='auto'"
            )
        block = width // g
        if block % min(self.neigh_size, block):  # (the smoothness's pooled cells must tile each block)
            return (
                f"neigh_size {self.neigh_size} does not divide the {block}-position blocks of a {g}x{g} grid "
                f"on its {width}x{width} map; choose a neigh_size that divides each block size"
            )
        if self.transport and self.t_size is not None and block % min(self.t_size, block):
            return (
                f"t_size {self.t_size} does not divide the {block}-position blocks of a {g}x{g} grid on its "
                f"{width}x{width} map; choose a t_size that divides each block size (or None: the block size)"
            )
        return None

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, width = h.shape[0], h.shape[-1]
        if draw.lam.ndim:
            raise ValueError(f"PuzzleMix draws one lam per batch: pin one lam, not {draw.lam.shape[0]}")
        grids = self.grids_for(draw.layer, width)
        grid = draw.pinned.get("grid")
        if grid is None:
            grid = grids[
                int(torch.randint(len(grids), (), generator=draw.generator, device=draw.generator.device))
            ]
        elif grid not in grids:
            raise ValueError(f"pinned grid {grid!r} is not one of grids={grids}")
        with without_autocast(h):  # (its terms in float32 at least, its transport in the map's dtype)
            dtype = torch.promote_types(h.dtype, torch.float32)
            saliency = pinned_saliency("PuzzleMix", draw.pinned, n, width, width, h.device).to(dtype)
            index = to_device(draw.index, h.device)
            values = self._values(h.detach().to(dtype), self.sites[draw.layer].layer == INPUT)
            lam = float(draw.lam)
            own_u, partner_u, w_v, w_h, own, beta = puzzle_terms(
                saliency, values, index, grid, self.beta, self.gamma, self.neigh_size
            )
            terms = [t.detach().to("cpu", torch.float64) for t in (own_u, partner_u, w_v, w_h)]
            unary, q_v, q_h = quantized(*terms, lam, beta, self.eta, self.n_labels, grid)
            clipped = int((q_v < 0).sum() + (q_h < 0).sum())
            labels = min_labelling(unary.numpy(), q_v.clamp_min(0).numpy(), q_h.clamp_min(0).numpy())
            mask = 1.0 - torch.from_numpy(labels).to(h.device, dtype) / (self.n_labels - 1)
            mixed = self.puzzle(h, index, mask[:, None], own, grid, saliency)
        weights = F.interpolate(mask[:, None], size=width)[:, 0]
        info = {"grid": grid, "mask": mask, "saliency": saliency, "clipped": clipped, "drawn_lam": draw.lam}
        return Mixed(
            {path: mixed},
            lam=weights.reshape(n, -1).mean(-1).to("cpu", torch.float64),
            info=info,
            weights=None if self.transport else weights,
        )

    def puzzle(self, h, index, mask, own, grid, saliency):
        """``M * T(h) + (1 - M) * T'(h[index])`` for the ``(B, 1, n, n)`` mask of own-content weights, the
        normalised block saliency ``own`` and the ``(B, W, W)`` saliency: the authors' transport (at
        ``t_size``) and final blend."""
        n, width = h.shape[0], h.shape[-1]
        partner_h = h[index]
        if self.transport:
            block = width // grid
            t_size = block if self.t_size is None else min(self.t_size, block)
            t_grid, t_mask, t_own = grid, mask, own
            if t_size < block:  # (check_leaves saw that it divides the block)
                t_grid = width // t_size
                t_mask = F.interpolate(mask, size=t_grid)
                pooled = F.avg_pool2d(saliency, t_size)
                t_own = pooled / pooled.reshape(n, -1).sum(1).reshape(n, 1, 1)
            plan = mask_transport(t_mask, t_own, self.t_eps)
            moved = transport_image(h, plan.to(h.dtype), t_grid, t_size)
            plan = mask_transport(1 - t_mask, t_own[index], self.t_eps)
            partner_h = transport_image(partner_h, plan.to(h.dtype), t_grid, t_size)
            h = moved
        m = F.interpolate(mask, size=width).to(h.dtype)
        return h * m + partner_h * (1 - m)  # (h first: the result is laid out as h, channels-last kept)

    def _values(self, h: torch.Tensor, at_input: bool) -> torch.Tensor:
        """The map's values as the smoothness reads them (see the class docstring)."""
        if at_input:
            if self.mean is None:
                return h
            mean, std = per_channel("PuzzleMix", h, self.mean, self.std)
            return h * std + mean
        low, high = h.amin(), h.amax()
        return (h - low) / (high - low).clamp_min(torch.finfo(h.dtype).tiny)
