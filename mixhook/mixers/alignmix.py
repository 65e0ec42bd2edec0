"""AlignMix: feature maps aligned by Sinkhorn optimal transport before they are mixed.

Paper: Venkataramanan, Kijak, Amsaleg, Avrithis. "AlignMixup: Improving Representations By Interpolating
Aligned Features." CVPR 2022. https://arxiv.org/abs/2103.15375 (code: shashankvkt/AlignMixup_CVPR22)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.card import Card
from ..engine.checks import check_one_map, check_positive
from ..engine.contract import Draw, Mixed
from ..engine.mixer import Mixer
from ..functional import per_sample, without_autocast
from ..sites import Leaf
from ..transfer import to_device


def sinkhorn_plan(
    x: torch.Tensor,
    y: torch.Tensor,
    eps: float = 0.1,
    max_iter: int = 100,
    tol: float = 0.1,
    read_every: int | None = None,
) -> torch.Tensor:
    """The entropic optimal transport plan ``(B, P, Q)`` between the ``P`` points of ``x`` ``(B, P, D)`` and
    the ``Q`` points of ``y`` ``(B, Q, D)``, uniform marginals, squared Euclidean cost, log-domain Sinkhorn
    iterations with regularisation ``eps``: the authors' ``SinkhornDistance`` (``utils/OT.py``, adapted
    from gpeyre/SinkhornAutoDiff), which stops after the first iteration where the mean over the batch of
    ``sum |u - u_prev|`` falls below ``tol`` (``tol=0``: always ``max_iter`` iterations).

    The stopping test is made on the device at every iteration and read on the host every ``read_every``
    iterations only (default: every one on the CPU, where a read costs nothing; every 10 on a GPU, where
    each read waits for the device): the iterations after the stopping one leave the potentials as they
    are (a ``where`` on the device flag), so the plan is the one the authors' loop returns, bit for bit,
    however rarely it is read. Without gradient: the plan is a constant of the mix, as the authors detach
    it."""
    with torch.no_grad():
        cost = torch.cdist(x, y, compute_mode="donot_use_mm_for_euclid_dist").square()
        mu = torch.full(x.shape[:2], 1.0 / x.shape[1], dtype=cost.dtype, device=cost.device)
        nu = torch.full((y.shape[0], y.shape[1]), 1.0 / y.shape[1], dtype=cost.dtype, device=cost.device)
        u, v = torch.zeros_like(mu), torch.zeros_like(nu)
        log_mu, log_nu = torch.log(mu + 1e-8), torch.log(nu + 1e-8)
        if read_every is None:
            read_every = 1 if cost.device.type == "cpu" else 10

        def modified(u, v):  # (-C + u_i + v_j) / eps
            return (-cost + u.unsqueeze(-1) + v.unsqueeze(-2)) / eps

        stopped = torch.zeros((), dtype=torch.bool, device=cost.device)  # the stopping test was met
        for i in range(max_iter):
            previous = u
            new_u = eps * (log_mu - torch.logsumexp(modified(u, v), dim=-1)) + u
            new_v = eps * (log_nu - torch.logsumexp(modified(new_u, v).transpose(-2, -1), dim=-1)) + v
            if tol <= 0:
                u, v = new_u, new_v
                continue
            u, v = torch.where(stopped, u, new_u), torch.where(stopped, v, new_v)
            stopped = stopped | ((new_u - previous).abs().sum(-1).mean() < tol)
            if (i + 1) % read_every == 0 and bool(stopped):
                break
        return torch.exp(modified(u, v))


class AlignMix(Mixer):
    """AlignMix (Venkataramanan et al. 2022) at any layer whose output is a map ``(B, C, *positions)``.

    On each training forward, with probability ``prob``: ``lam ~ Beta(alpha, alpha)``, a permutation
    ``index`` and a direction are drawn; each sample's map ``A`` (``C`` features at each of its ``N``
    positions) and its partner's ``B = h[index]`` are aligned by the entropic optimal transport plan
    ``P`` between their positions (:func:`sinkhorn_plan`, squared Euclidean cost on the features), scaled
    to an assignment ``R = N * P``, and then mixed:

    - direction 0: ``h' = lam * A + (1 - lam) * B R^T`` (the partner's features moved to ``A``'s positions);
    - direction 1: ``h' = lam * A R + (1 - lam) * B`` (``A``'s features moved to the partner's positions).

    Both directions give the sample's own label the weight ``lam``, as the authors' code does
    (``models/resnet18_classifier.py``, ``mixup_aligned``); the plan carries no gradient (theirs is
    detached). Equal to that code on the same draws. The authors mix either the input (plain mixup) or
    the last stage's features (AlignMix), drawn per batch: ``OneOf([ManifoldMixup("input"),
    AlignMix("layer4")])`` with ``alpha=2`` trains as they do. ``.last.info["direction"]`` records the
    direction.

    With ``eps = 0.1`` and squared feature distances much larger than 1 (the usual case: they sum over
    the channels), the iterations stop (by ``tol``, or at ``max_iter``) far from convergence: the plan's
    partner marginal is exact (the last update) but its rows do not sum to ``1/N``, so ``R`` also rescales
    each position. That is the authors' code as it runs, which this equals; a larger ``eps`` or features
    on a smaller scale give a plan closer to a permutation-like assignment.

    The Sinkhorn iterations cost ``O(B N^2 (C + iterations))``, batched over the samples: use it on late,
    small maps (the authors' 4x4); their stopping rule is tested on the device and read on the host every
    10 iterations on a GPU (every one on the CPU), with the same plan as theirs (``tol=0``: no read).
    Cost: a step 7.3x a Manifold Mixup step on an H200 at PreActResNet-18's ``layer2`` (16x16 maps, batch
    128), 12x on 2 CPU cores: at the authors' 4x4 maps it is far less.

    Args:
        layer: a name or a list (one drawn per batch); each must output ``(B, C, ...)`` with at least 2
            positions (the input works too, aligning pixels).
        alpha: the Beta distribution's concentration, > 0 (authors: 2.0).
        eps: the Sinkhorn regularisation, > 0 (authors: 0.1).
        max_iter: at most this many Sinkhorn iterations (authors: 100).
        tol: stop once the dual potential moves less than this (authors: 0.1); 0: every iteration.
        prob, generator, batch_dim, padding, layout: as :class:`~mixhook.CutMix`.
    """

    card = Card(
        paper="Venkataramanan et al. 2022",
        mixes="the partner's positions aligned by optimal transport, blended",
        where="any map",
        family="feature",
        signature="AlignMix(layer, alpha=2.0, eps=0.1, max_iter=100, tol=0.1)",
        hook="forward, `(B,C,...)` maps (≥ 2 positions)",
        commands="`mixup=alignmix` (CIFAR: `mixup.layer=layer4`, the authors')",
        details=(
            "Each sample's map `A` and its partner's `B` aligned by the entropic OT plan `P` between their "
            "positions (log-domain Sinkhorn, squared Euclidean cost on the features, no gradient), `R = "
            "N·P`; direction drawn per batch: `lam*A + (1-lam)*B Rᵀ` or `lam*A R + (1-lam)*B`; own label "
            "`lam`; equal to the authors' `mixup_aligned` and `SinkhornDistance` on the same draws (their "
            "stopping rule included: tested on the device at every iteration, read on the host every 10 on a "
            'GPU, the same plan; `tol=0` reads nothing); `.last.info["direction"]`'
        ),
        example={"layer": "conv2", "alpha": 1.0},
        drawn={"size": 32},  # its transport plan has (pixels)**2 entries,
    )

    pin_keys = ("direction",)
    dense_targets = "aligns positions across samples, so no label map follows its mix; train on labels"

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float = 2.0,
        eps: float = 0.1,
        max_iter: int = 100,
        tol: float = 0.1,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout)
        self.eps = check_positive("eps", eps)
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter must be an integer >= 1, got {max_iter!r}")
        self.max_iter = max_iter
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
            raise ValueError(f"tol must be a number >= 0, got {tol!r}")
        self.tol = float(tol)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        kind = type(self).__name__
        check_one_map(kind, spec, leaves, "aligns one map")
        h = leaves[0].tensor
        if h.ndim < 3 or leaves[0].dim != 0:
            raise TypeError(
                f"{kind} at {spec!r} needs a (B, C, ...) map with the batch first, got shape "
                f"{tuple(h.shape)} with the batch at dim {leaves[0].dim}"
            )
        if h[0, 0].numel() < 2:
            raise ValueError(
                f"{kind} at {spec!r}: its map of shape {tuple(h.shape)} has fewer than 2 positions, so there "
                "is nothing to align; choose an earlier layer"
            )

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h = leaves[0].tensor
        n, c = h.shape[:2]
        direction = draw.pinned.get("direction")
        if direction is None:
            direction = int(torch.randint(2, (), generator=draw.generator, device=draw.generator.device))
        elif direction not in (0, 1):
            raise ValueError(f"pin(direction={direction!r}): the direction is 0 or 1")
        index = to_device(draw.index, h.device)
        own = h.reshape(n, c, -1)
        partner = own[index]
        work = torch.promote_types(h.dtype, torch.float32)
        with without_autocast(h):  # (the plan in float32 at least, the alignment in the map's dtype)
            plan = sinkhorn_plan(
                own.detach().transpose(1, 2).to(work), partner.detach().transpose(1, 2).to(work),
                self.eps, self.max_iter, self.tol,
            ).to(h.dtype) * own.shape[2]  # fmt: skip
            lam = draw.weight if isinstance(draw.weight, float) else per_sample(draw.lam, own)
            if direction == 0:  # the partner's features moved to the sample's positions
                mixed = torch.lerp(partner @ plan.transpose(1, 2), own, lam)
            else:  # the sample's features moved to the partner's positions
                mixed = torch.lerp(partner, own @ plan, lam)
        return Mixed({leaves[0].path: mixed.view(h.shape)}, info={"direction": direction})
