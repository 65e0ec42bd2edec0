"""How much: lam warped per pair by the pair's distance (SK-Mixup), and each pair's weight in the loss
by its distance (Local Mixup).

Papers:
    - Bouniot, Mozharovskyi, d'Alché-Buc. "Tailoring Mixup to Data for Calibration." ICLR 2025.
      https://arxiv.org/abs/2311.01434 (code: qbouniot/sim_kernel_mixup; torch-uncertainty's
      ``WarpingMixup``, ``src/torch_uncertainty/transforms/mixup.py``)
    - Baena, Drumetz, Gripon. "Preventing Manifold Intrusion with Locality: Local Mixup." EUSIPCO 2022.
      https://arxiv.org/abs/2201.04368 (code: raphael-baena/Local-Mixup)
"""

from __future__ import annotations

import torch

from ..engine.checks import check_positive
from ..engine.contract import Draw, MixState
from ..engine.mixer import Mixer
from ..engine.policies import Policy, pair_sq_distances, refuse_global_partners, refuse_own_loss
from ..transfer import to_device

# The symmetric Beta CDF: a continued fraction of CF_TERMS terms up to CF_UP_TO, the Student-t limit above.
CF_TERMS = 256
CF_UP_TO = 2000.0


def _continued_fraction(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``I_x(a, b)`` for ``x <= (a + 1) / (a + b + 2)`` (where the continued fraction of Numerical
    Recipes' ``betacf`` converges fast), from its first :data:`CF_TERMS` terms. The convergents are a
    product of 2x2 matrices, taken pairwise in ``log2(CF_TERMS)`` batched matrix products (each level
    rescaled: only their ratio counts) instead of one term after another: a fixed number of device ops,
    no host read."""
    m = torch.arange(1, CF_TERMS // 2 + 1, dtype=x.dtype, device=x.device)
    X, A, B = x[..., None], a[..., None], b[..., None]
    even = m * (B - m) * X / ((A + 2 * m - 1) * (A + 2 * m))  # d_2m
    m = m - 1
    odd = -(A + m) * (A + B + m) * X / ((A + 2 * m) * (A + 2 * m + 1))  # d_2m+1
    d = torch.stack([odd, even], -1).flatten(-2)  # d_1, d_2, ...: 1 + d_1 / (1 + d_2 / (1 + ...))
    one, zero = torch.ones_like(d), torch.zeros_like(d)
    M = torch.stack([torch.stack([one, d], -1), torch.stack([one, zero], -1)], -2)  # (..., terms, 2, 2)
    while M.shape[-3] > 1:  # [A_n, A_n-1] = [[1, d_n], [1, 0]] [A_n-1, A_n-2]: later terms on the left
        M = M[..., 1::2, :, :] @ M[..., 0::2, :, :]
        M = M / M.abs().amax((-2, -1), keepdim=True)
    P = M[..., 0, :, :]
    fraction = (P[..., 0, 0] + P[..., 0, 1]) / P[
        ..., 0, 0
    ]  # A_N / B_N, from A_0 = A_-1 = 1, B_0 = 1, B_-1 = 0
    log_front = a * torch.log(x) + b * torch.log1p(-x) - torch.log(a)
    log_front = log_front - (torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b))
    return torch.exp(log_front) / fraction


def symmetric_beta_cdf(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``BetaCDF(x; a, a)``, the regularized incomplete beta function ``I_x(a, a)``, elementwise, on the
    tensors' device with no host read (torch has no Beta CDF; SK-Mixup's authors call scipy on the host).

    For ``a <= CF_UP_TO`` (2000): the continued fraction (:func:`_continued_fraction`, with ``I_x(a, a) =
    1 - I_1-x(a, a)`` above ``x = 1/2``); above: the Student-t limit (``x ~ Beta(a, a)`` iff
    ``sqrt(2a) (x - 1/2) / sqrt(x (1 - x))`` follows Student's t with ``2a`` degrees of freedom), its CDF
    by Abramowitz & Stegun 26.7.8's normal approximation. Error against scipy's ``betainc`` in float64
    (tests/policies/test_policies.py): below 1e-10 for ``1e-3 <= a <= 2000``, below 3e-8 above (it falls as
    ``1/a**2``: 2e-10 at ``a = 1e4``). ``x`` in [0, 1] and ``a > 0``, float64."""
    x, a = torch.broadcast_tensors(x.to(torch.float64), a.to(torch.float64))
    low = torch.minimum(x, 1 - x)
    inner = low.clamp(min=torch.finfo(torch.float64).tiny)
    cf = _continued_fraction(inner, a.clamp(max=CF_UP_TO), a.clamp(max=CF_UP_TO))
    cf = torch.where(low > 0, cf, torch.zeros_like(cf))
    nu = 2 * a
    over_t = torch.sqrt(inner * (1 - inner)) / (torch.sqrt(nu) * (inner - 0.5))  # 1/t: no overflow near 0
    z = torch.sign(inner - 0.5) * (1 - 1 / (4 * nu)) / torch.sqrt(over_t * over_t + 1 / (2 * nu))
    tail = torch.where(low > 0, torch.special.ndtr(z), torch.zeros_like(z))
    lower = torch.where(a <= CF_UP_TO, cf, tail)  # I_min(x, 1-x)(a, a)
    return torch.where(x <= 0.5, lower, 1 - lower)


def warp_parameters(sq_distances: torch.Tensor, tau_max: float, tau_std: float, own: int) -> torch.Tensor:
    """SK-Mixup's warping parameter of each pair from its squared distance ``d``, normalised by the
    batch's mean (over the batch's own rows, the first ``own``): ``1 / (tau_max * exp(-(d / mean(d) - 1) /
    (2 tau_std^2)) + 1e-12)``, as the authors' ``KernelMixup(warping="beta_cdf")`` with their
    ``sim_gauss_kernel`` (qbouniot/sim_kernel_mixup ``classification/torch_uncertainty/transforms/
    mixup.py``): a pair at the mean distance gets ``1 / tau_max``, closer pairs less (their lam stays
    spread: they mix), farther pairs more (their lam pushed to 0 or 1: they barely mix)."""
    mean = sq_distances[:own].mean().clamp_min(torch.finfo(torch.float64).tiny)
    rate = tau_max * torch.exp(-(sq_distances / mean - 1) / (2 * tau_std * tau_std))
    return 1 / (rate + 1e-12)


def _check_blend(policy: Policy, mixer: Mixer) -> None:
    from ..mixers.manifold import ManifoldMixup  # (the blends: lam per sample)

    name, kind = type(policy).__name__, type(mixer).__name__
    if not isinstance(mixer, ManifoldMixup):
        raise TypeError(
            f"{name} changes lam for each pair, which {kind} cannot take (its lam sizes a region, one per "
            "batch): use it with a blend, ManifoldMixup or a method built on it"
        )
    refuse_global_partners(policy, mixer, "takes distances between partners")


class KernelWarping(Policy):
    """SK-Mixup's kernel warping (Bouniot et al., ICLR 2025): each pair's lam warped by the pair's
    similarity, ``lam_i <- BetaCDF(lam; w_i + eps, w_i + eps)`` with ``w_i`` the inverse of a Gaussian
    kernel of the pair's squared distance normalised by the batch's mean (:func:`warp_parameters`):
    distant pairs get lam near 0 or 1 (little mixing: less of the calibration damage mixup does between
    far classes), close pairs mix as drawn. The warped lam weighs the blend and the targets alike. This is
    the authors' ``KernelMixup(warping="beta_cdf")``; their CIFAR configs run ``warping="inverse_beta_cdf"``
    (the Beta quantile, with the kernel itself as the parameter), which needs the incomplete beta's
    inverse on the device and is not built; torch-uncertainty's ``WarpingMixup`` divides ``d - 1``, not
    ``d``, by the mean (the same where the mean distance is 1).

    The distance is taken between the rows mixed at the mixed layer (at ``"input"``, the authors'
    ``dist_sim="inp"``) or between features given with ``mixer.use_features(f)`` before the forward (the
    authors' default ``"emb"``: the model's embedding of the batch, computed by you). The Beta CDF is
    computed on the device (:func:`symmetric_beta_cdf`); the warped lam is one per sample, on the device,
    so ``loss`` needs one loss per sample (``reduction='none'``). ``.last.info["warp"]`` holds each pair's
    parameter.

    Args:
        tau_max: the kernel's amplitude (authors: 1.0).
        tau_std: its width, relative to the mean distance (authors: 0.5; 0.25 to 1 in their sweeps).

    Takes blends only (ManifoldMixup and the methods built on it); with ``alpha`` the mixer's (the authors:
    1.0).
    """

    knob = "lam"
    takes_distances = True

    def __init__(self, tau_max: float = 1.0, tau_std: float = 0.5):
        self.tau_max, self.tau_std = check_positive("tau_max", tau_max), check_positive("tau_std", tau_std)

    def __repr__(self) -> str:
        return f"KernelWarping(tau_max={self.tau_max}, tau_std={self.tau_std})"

    def check_mixer(self, mixer: Mixer) -> None:
        _check_blend(self, mixer)

    def adjust(self, draw: Draw, leaves: list, own: int):
        d = pair_sq_distances(draw, leaves, type(self).__name__, "kernel warping")
        warp = warp_parameters(d, self.tau_max, self.tau_std, own)
        lam = to_device(draw.lam, d.device).expand(d.shape[0])
        return symmetric_beta_cdf(lam, warp + 1e-12), {"warp": warp}


class LocalWeights(Policy):
    """Local Mixup (Baena et al. 2022): each pair's loss weighted by the pair's distance ``d`` (L2 between
    the rows mixed, or between features given with ``use_features``), so that far pairs, whose mix may
    cross another class's region, count less: ``w = 1`` if ``d <= epsilon`` else 0 (the paper's
    thresholded weight), or ``w = exp(-sigma d)`` (the authors' scripts, ``sigma = 0.0005`` on raw
    pixels). ``loss`` is then ``sum_i w_i l_i / sum_i w_i`` (their normalisation) for the mean of the per-
    sample losses it returns: each is ``l_i w_i B / sum w``, so the criterion must return one loss per
    sample (``reduction='none'``); a batch whose pairs are all farther than ``epsilon`` gives zero loss.
    ``targets()`` refuses (the weights are not targets); ``.last.info["pair_weights"]`` holds them.

    Args:
        epsilon: the distance threshold (exactly one of ``epsilon`` and ``sigma``).
        sigma: the exponential weight's rate.
    """

    knob = "weights"
    changes_loss = True
    takes_distances = True

    def __init__(self, epsilon: float | None = None, sigma: float | None = None):
        if (epsilon is None) == (sigma is None):
            raise ValueError(
                "LocalWeights takes exactly one of epsilon (a distance threshold) and sigma (a rate)"
            )
        self.epsilon = None if epsilon is None else check_positive("epsilon", epsilon)
        self.sigma = None if sigma is None else check_positive("sigma", sigma)

    def __repr__(self) -> str:
        which = f"epsilon={self.epsilon}" if self.sigma is None else f"sigma={self.sigma}"
        return f"LocalWeights({which})"

    def check_mixer(self, mixer: Mixer) -> None:
        refuse_own_loss(self, mixer)
        refuse_global_partners(self, mixer, "takes distances between partners")

    def adjust(self, draw: Draw, leaves: list, own: int):
        d = pair_sq_distances(draw, leaves, type(self).__name__, "Local Mixup").sqrt()
        w = (d <= self.epsilon).to(torch.float64) if self.sigma is None else torch.exp(-self.sigma * d)
        return None, {"pair_weights": w}

    def pair_weights(self, last: MixState) -> torch.Tensor:
        return last.info["pair_weights"][: last.index.shape[0]]
