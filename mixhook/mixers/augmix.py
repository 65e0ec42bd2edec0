"""AugMix as a hook at the model's input, on the batch's device: two augmented views of every image beside
the clean one, and the Jensen-Shannon consistency loss between the three predictions.

Paper: Hendrycks, Mu, Cubuk, Zoph, Gilmer, Lakshminarayanan. "AugMix: A Simple Data Processing Method to
Improve Robustness and Uncertainty." ICLR 2020. https://arxiv.org/abs/1912.02781. Authors' code:
github.com/google-research/augmix (``augmentations.py``, ``cifar.py``: ``aug`` and the JSD loss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .. import imageops
from ..engine.card import Card
from ..engine.checks import check_normalisation, check_positive, check_spatial, per_channel
from ..engine.contract import Draw, Mixed, MixState
from ..engine.mixer import Mixer
from ..functional import sample_beta
from ..sites import INPUT, Leaf
from ..transfer import to_device

# The authors' `augmentations.augmentations` (all_ops=False: the ones that do not overlap ImageNet-C's
# corruptions), in their order; the level of each is drawn uniform in [0.1, severity).
OPERATIONS = (
    "autocontrast", "equalize", "posterize", "rotate", "solarize", "shear_x", "shear_y", "translate_x",
    "translate_y",
)  # fmt: skip
# Their `augmentations_all` (all_ops=True, their --all-ops): the four enhancements after the nine
ALL_OPERATIONS = (*OPERATIONS, "color", "contrast", "brightness", "sharpness")
STEPS = 3  # the longest chain (the authors' depth: np.random.randint(1, 4) where mixture_depth <= 0)


def jensen_shannon(clean: torch.Tensor, aug1: torch.Tensor, aug2: torch.Tensor) -> torch.Tensor:
    """AugMix's consistency term per sample: the mean of the three predictions' KL divergences from their
    mixture, the mixture's probabilities clamped to ``[1e-7, 1]`` before its log (the authors' and timm's
    ``JsdCrossEntropy``): ``(B,)``, whose mean is their ``batchmean`` sum. Each ``p log p`` is taken with
    ``log_softmax``: the same value, and a finite gradient where a probability underflows to 0 (their
    ``F.kl_div(log_mixture, p)`` differentiates ``log p`` there: NaN, which ends a confident run)."""
    logs = [F.log_softmax(logits, dim=1) for logits in (clean, aug1, aug2)]
    probs = [log.exp() for log in logs]
    log_mixture = torch.clamp((probs[0] + probs[1] + probs[2]) / 3.0, 1e-7, 1).log()
    return sum((p * (log - log_mixture)).sum(1) for p, log in zip(probs, logs, strict=True)) / 3.0


class AugMix(Mixer):
    """AugMix (Hendrycks et al. 2020) as a hook at the model's input: the layer emits ``3B`` rows, the
    clean batch, then two augmented views of it, made on the batch's device; ``loss`` is the clean rows'
    criterion plus ``jsd`` times the Jensen-Shannon divergence between the three predictions.

    Each view of an image is ``(1 - m) * x + m * sum_i w_i * chain_i(x)``, with ``w ~ Dirichlet(alpha)``
    over ``width`` chains, ``m ~ Beta(alpha, alpha)``, and each chain ``depth`` operations (1 to 3 at
    random where ``depth`` is -1) drawn from the authors' nine (:data:`OPERATIONS`: autocontrast,
    equalize, posterize, rotate, solarize, shear and translate in x and y) at levels uniform in ``[0.1,
    severity)``; every draw is the sample's own, from the mixer's generator. The operations are
    :mod:`mixhook.imageops`'s: PIL's on 8-bit images (the intensity ones exactly; rotation and shear
    within one code), on tensors, batched by operation, no PIL and no data-loader worker.

    The operations read pixels in ``[0, 1]``: give the data's normalisation, ``mean`` and ``std`` (per
    channel), and the views are made of ``x * std + mean`` and normalised back; the first batch's pixels
    are checked to be in ``[0, 1]``. The loss equals the authors' (``F.cross_entropy(logits_clean, y) + 12
    * JSD``) and timm's ``JsdCrossEntropy(smoothing=0)`` on the same views; ``pin(views=...)`` takes views
    of your own (``(2, B, C, H, W)``, normalised as the input), e.g. the authors' PIL pipeline's.
    Evaluation forwards are not tripled. ``targets()`` is refused (the views keep their labels: the
    signal is the clean criterion and the consistency term); ``weigh`` gives each row its own label's.

    Args:
        layer: ``"input"`` (the operations are image operations).
        severity: the operations' strength, 1 to 10 (authors: 3).
        width: the chains mixed per view (authors: 3).
        depth: each chain's operations, 1 to 3, or -1 for 1 to 3 at random (authors: -1).
        alpha: the Dirichlet and Beta concentration (authors: 1).
        jsd: the consistency term's weight (authors: 12; 0: the clean rows' criterion alone).
        all_ops: also the authors' four enhancements (their ``--all-ops``: color, contrast, brightness,
            sharpness, PIL's ``ImageEnhance`` at ``level * 0.18 + 0.1``; off by default, as the authors':
            they overlap ImageNet-C's corruptions; timm's AugMix uses them).
        mean, std: the input's normalisation per channel (``None``: pixels as they come, in ``[0, 1]``).
        prob: probability that a batch is augmented (authors: every batch).
        generator: as :class:`~mixhook.ManifoldMixup`.

    ``.last.info["draws"]`` holds each view's draws (weights, ``m``, operations, levels, signs; CPU).
    """

    card = Card(
        paper="Hendrycks et al. 2020",
        mixes="two views of augmentation chains beside the clean batch (`3B` rows)",
        where="input; images in [0, 1] after `mean`/`std`",
        family="clean",
        traits=("pixels", "clean"),
        signature='AugMix(layer="input", severity=3, width=3, depth=-1, alpha=1.0, jsd=12.0)',
        hook="forward, clean + two augmented views",
        commands="`mixup=augmix`",
        details=(
            "The input emits `[x; view1; view2]`, each view `(1-m)·x + m·Σ w_i·chain_i(x)` (`w ~ "
            "Dirichlet(alpha)`, `m ~ Beta(alpha, alpha)`, chains of the authors' nine operations at "
            "levels in `[0.1, severity)`, each sample's own draws, on the device: PIL's operations on "
            "8-bit images as tensor ops); loss = the clean rows' criterion + `jsd`·JSD of the three "
            "predictions, equal to the authors' loss and timm's `JsdCrossEntropy` on the same views; "
            "`all_ops=True`: also their four enhancements (PIL's `ImageEnhance`); "
            '`pin(views=...)`; `.last.info["draws"]`'
        ),
        workflows="all but TRL",
        example={"layer": "input", "mean": [0.5], "std": [0.05]},  # (the matrix's N(0, 1) inputs)
        drawn={"views": True},  # (no pair is mixed: the gallery shows each image's views)
    )

    keeps_clean = True
    checks_by_signature = True  # (the pixel range is checked on a site's first batch)
    pin_keys = ("views",)

    def __init__(
        self,
        layer: str | Sequence[str] = INPUT,
        severity: int = 3,
        width: int = 3,
        depth: int = -1,
        alpha: float = 1.0,
        jsd: float = 12.0,
        all_ops: bool = False,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
    ):
        super().__init__(layer, alpha, prob, generator)
        if self.layers != (INPUT,):
            raise ValueError(
                "AugMix augments images, so it runs at the model's input: layer must be 'input', got "
                f"{layer!r}"
            )
        for name, value, low, high in (("severity", severity, 1, 10), ("width", width, 1, 100)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an int from {low} to {high}, got {value!r}")
        if isinstance(depth, bool) or depth not in (-1, 1, 2, 3):
            raise ValueError(
                f"depth must be 1, 2 or 3 operations per chain, or -1 (1 to 3 at random), got {depth!r}"
            )
        if not isinstance(all_ops, bool):
            raise ValueError(f"all_ops must be True or False, got {all_ops!r}")
        self.severity, self.width, self.depth, self.all_ops = severity, width, depth, all_ops
        self.jsd = float(jsd) if jsd == 0 else check_positive("jsd", jsd)
        self.mean, self.std = check_normalisation(mean, std)

    def use(self, *policies) -> AugMix:
        if policies:
            names = ", ".join(type(p).__name__ for p in policies)
            raise TypeError(
                f"AugMix.use({names}): AugMix mixes no pairs and weighs no labels (each view is of its own "
                "image), so no partner, lam, target or loss policy applies"
            )
        return super().use()

    def __repr__(self) -> str:
        return (
            f"AugMix(layer='input', severity={self.severity}, width={self.width}, depth={self.depth}, "
            f"alpha={self.alpha}, jsd={self.jsd}, all_ops={self.all_ops}, mean={self.mean}, std={self.std}, "
            f"prob={self.prob})"
        )

    # -------------------------------------------------------------------------------- the draw

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.ones((), dtype=torch.float64)  # (unused: each view's own m and weights)

    def draw_index(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return torch.arange(n, device=generator.device)  # (no partners: each view is of its own image)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_spatial("AugMix", spec, leaves)
        if isinstance(h, torch.Tensor) and h.numel():
            pixels = self._pixels(h)  # (mean/std of one value or one per channel, else refused there)
            low, high = float(pixels.min()), float(pixels.max())
            if low < -1e-6 or high > 1 + 1e-6:
                given = "x * std + mean" if self.mean is not None else "the input (no mean/std given)"
                raise ValueError(
                    f"AugMix's operations read pixels in [0, 1], but {given} spans [{low:.3g}, {high:.3g}]; "
                    "give the data's normalisation: mean=[...], std=[...] per channel"
                )

    def _pixels(self, h: torch.Tensor) -> torch.Tensor:
        """The images in pixel space (``x * std + mean``), in float32 at least."""
        x = h.detach().to(torch.promote_types(h.dtype, torch.float32))
        if self.mean is None:
            return x
        mean, std = per_channel("AugMix", x, self.mean, self.std)
        return x * std + mean

    def _normalised(self, u: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.mean is not None:
            mean, std = per_channel("AugMix", u, self.mean, self.std)
            u = (u - mean) / std
        return u.to(like.dtype)

    def draws(self, n: int, generator: torch.Generator) -> dict:
        """One view's draws for ``n`` images (CPU tensors where the generator is on the CPU)."""
        g, w, device = generator, self.width, generator.device
        concentration = torch.full((n, w), float(self.alpha), dtype=torch.float64, device=device)
        weights = torch._sample_dirichlet(concentration, generator=g)
        m = sample_beta(self.alpha, self.alpha, g, size=n)
        if self.depth > 0:
            depth = torch.full((n, w), self.depth, dtype=torch.int64, device=device)
        else:
            depth = torch.randint(1, STEPS + 1, (n, w), generator=g, device=device)
        kinds = len(ALL_OPERATIONS if self.all_ops else OPERATIONS)
        operations = torch.randint(kinds, (n, w, STEPS), generator=g, device=device)
        levels = 0.1 + (self.severity - 0.1) * torch.rand(
            n, w, STEPS, generator=g, device=device, dtype=torch.float64
        )
        signs = torch.where(torch.rand(n, w, STEPS, generator=g, device=device) > 0.5, -1.0, 1.0)
        return {
            "weights": weights, "m": m, "depth": depth, "operations": operations, "levels": levels,
            "signs": signs.to(torch.float64),
        }  # fmt: skip

    # --------------------------------------------------------------------------------- the mix

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n = h.shape[0]
        views = draw.pinned.get("views")
        if views is not None:
            views = torch.as_tensor(views)
            if tuple(views.shape) != (2, *h.shape):
                raise ValueError(
                    f"AugMix.pin(views=...): needs two views of the batch, shape {(2, *tuple(h.shape))}, got "
                    f"{tuple(views.shape)}"
                )
            views = views.to(device=h.device, dtype=h.dtype)
            return Mixed({path: views[1]}, info={"draws": None}, before={path: views[0]})
        u = self._pixels(h)
        drawn = [self.draws(n, draw.generator) for _ in range(2)]
        aug1, aug2 = (self._normalised(v, h) for v in self.views(u, drawn))
        info = {"draws": [{k: v.cpu() for k, v in d.items()} for d in drawn]}
        return Mixed({path: aug2}, info=info, before={path: aug1})

    def view(self, u: torch.Tensor, drawn: dict) -> torch.Tensor:
        """One augmented view of the images ``u`` (pixels in ``[0, 1]``) from its draws: ``(1 - m) * u + m *
        sum_i w_i * chain_i(u)`` (the authors' ``aug``)."""
        return self.views(u, [drawn])[0]

    def views(self, u: torch.Tensor, drawn: list[dict]) -> list[torch.Tensor]:
        """The views of ``u`` from each of ``drawn`` (as :meth:`view`), every chain of every view run as one
        batch: each chain step applies each operation once, to all the images that drew it."""
        k, width = len(drawn), self.width

        def flat(key: str) -> torch.Tensor:  # (row (v, i, b) of the batch at (v * width + i) * n + b)
            return torch.cat([d[key][:, i].cpu() for d in drawn for i in range(width)])

        depth, chosen, levels, signs = flat("depth"), flat("operations"), flat("levels"), flat("signs")
        chains = u.repeat(k * width, 1, 1, 1)
        for step in range(STEPS):
            chains = _step(chains, depth > step, chosen[:, step], levels[:, step], signs[:, step])
        chains = chains.view(k, width, *u.shape)
        out = []
        for v, d in enumerate(drawn):
            weights = d["weights"].to(device=u.device, dtype=u.dtype)
            m = d["m"].to(device=u.device, dtype=u.dtype).view(-1, 1, 1, 1)
            mixture = torch.zeros_like(u)
            for i in range(width):
                mixture = mixture + weights[:, i].view(-1, 1, 1, 1) * chains[v, i]
            out.append((1 - m) * u + m * mixture)
        return out

    # --------------------------------------------------------------------------------- the loss

    def targets_refused(self) -> str | None:
        return (
            "trains on the clean rows' criterion and the consistency of the three predictions; its "
            "views keep their labels, so there are no mixed targets"
        )

    def clean_loss(
        self,
        criterion: Callable,
        clean: torch.Tensor,
        mixed: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
    ) -> torch.Tensor:
        n = clean.shape[0]
        loss = criterion(clean, target)
        consistency = jensen_shannon(clean, mixed[:n], mixed[n:])
        if loss.ndim == 0:
            return loss + self.jsd * consistency.mean()
        return loss + self.jsd * consistency

    def mixed_loss(self, criterion, logits, target, last: MixState, own_terms: bool = True) -> torch.Tensor:
        """The views' rows (``2B``), each against its own image's label (``weigh``: a metric per row)."""
        n = target.shape[0]
        return torch.cat([criterion(logits[:n], target), criterion(logits[n:], target)])


def _step(images: torch.Tensor, active, chosen, levels, signs) -> torch.Tensor:
    """One step of every chain in ``images``: each image's own operation (``chosen``; none where it is not
    ``active``, its chain being shorter) at its level and sign, applied batched to the images that drew
    it (the choices are CPU tensors: which rows go where is known on the host, and queued to the device
    without a sync)."""
    out = images
    for k, name in enumerate(ALL_OPERATIONS):  # (the nine first: an index below 9 names the same one)
        rows = torch.nonzero(active & (chosen == k)).flatten()
        if rows.numel() == 0:
            continue
        at = to_device(rows, images.device)
        out = out.index_copy(0, at, operate(name, images.index_select(0, at), levels[rows], signs[rows]))
    return out


def operate(name: str, images: torch.Tensor, levels: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """One of :data:`ALL_OPERATIONS` on ``images`` (pixels in ``[0, 1]``), each at its own level (``(N,)``,
    the authors' ``sample_level(severity)``) and sign (``(N,)``, ``-1`` where their coin flipped it), with
    the authors' parameters (``int_parameter``, ``float_parameter``; translations by up to a third of the
    image's side)."""
    height, width = images.shape[-2:]
    if name == "autocontrast":
        return imageops.autocontrast(images)
    if name == "equalize":
        return imageops.equalize(images)
    if name == "posterize":
        return imageops.posterize(images, 4 - torch.floor(levels * 4 / 10).to(torch.int64))
    if name == "solarize":
        return imageops.solarize(images, 256 - torch.floor(levels * 256 / 10).to(torch.int64))
    if name == "rotate":
        return imageops.affine(
            images, imageops.rotation(torch.floor(levels * 30 / 10) * signs, height, width)
        )
    if name in ("color", "contrast", "brightness", "sharpness"):  # (float_parameter(level, 1.8) + 0.1)
        return getattr(imageops, name)(images, levels * 1.8 / 10 + 0.1)
    one, zero = torch.ones_like(levels), torch.zeros_like(levels)
    shear = levels * 0.3 / 10 * signs
    matrices = {
        "shear_x": (one, shear, zero, zero, one, zero),
        "shear_y": (one, zero, zero, shear, one, zero),
        "translate_x": (one, zero, torch.floor(levels * (width / 3) / 10) * signs, zero, one, zero),
        "translate_y": (one, zero, zero, zero, one, torch.floor(levels * (height / 3) / 10) * signs),
    }
    return imageops.affine(images, imageops.matrices(*matrices[name]))
