"""Who is paired: partners from a second batch (Balanced-MixUp), and saliency-greedy pairing (GuidedMixup).

Papers:
    - Galdran, Carneiro, González Ballester. "Balanced-MixUp for Highly Imbalanced Medical Image
      Classification." MICCAI 2021. https://arxiv.org/abs/2109.09850 (code: agaldran/balanced_mixup)
    - Kang, Kim. "GuidedMixup: An Efficient Mixup Strategy Guided by Saliency Maps." AAAI 2023.
      https://arxiv.org/abs/2306.16612 (code: 3neutronstar/GuidedMixup)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..engine import saliency as sources
from ..engine.checks import check_positive
from ..engine.contract import Draw, MixState
from ..engine.mixer import Mixer
from ..engine.policies import Policy, refuse_global_partners
from ..engine.saliency import guided_pairs
from ..functional import sample_beta, weight_of
from ..sites import INPUT, Leaf, describe

_PER_ROW = ("pair_weights", "warp")  # what the lam and weights policies record per row
BANK = "partner_features"  # the pinned key of PartnerBatch(at="layer")'s rows


def _refuse_own_partners(policy: Policy, mixer: Mixer) -> None:
    """A partners policy replaces the mixer's partners: refuse a mixer that chooses its own, keeps a clean
    batch beside its mix, or draws from every rank."""
    name, kind = type(policy).__name__, type(mixer).__name__
    if not type(mixer).index_is_permutation or type(mixer).before_forward is not Mixer.before_forward:
        raise TypeError(
            f"{name} chooses the partners, but {kind} chooses its own or reads the batch before the forward "
            "(labels, saliency); use it with a mixer that pairs at random (ManifoldMixup, CutMix, ...)"
        )
    refuse_global_partners(policy, mixer, "chooses the partners")


class PartnerBatch(Policy):
    """Partners from a second batch fed with the first, instead of from the batch itself.

    Before every training forward, ``mixer.use_partners(inputs, targets)`` gives the partner batch (the
    app's loop gives a class-balanced one: ``data.partner_sampler=balanced``). In a forward that mixes,
    the partner batch is appended to the model's first argument along its batch dimension, so the layers
    before the mix see the batch's ``B`` rows followed by the ``P`` partner rows (as a hand-edited
    ``forward()`` that runs ``torch.cat([x, x_partner])`` up to the mixed layer would: batch-norm
    statistics there include the partners); the mixed layer mixes row ``i`` with partner row
    ``index[i]`` and hands the next layer the ``B`` mixed rows only. At ``"input"`` the inputs are mixed
    directly. A forward that does not mix (``prob``) runs on the batch alone.

    ``.last.index`` then indexes the partner batch, ``.last.info["partners"]`` is ``"batch"`` and
    ``loss``/``targets`` take the partners' labels from ``use_partners``. This is the primitive a queue or
    memory bank of partners would use: a pool of rows beside the batch, indexed by the draw.

    With ``at="layer"`` the partners are rows of the mixed layer's output itself, given with
    ``use_partners(rows, targets)`` (a memory bank or queue of features stored from earlier batches, as
    MoCo-style queues keep them): they are appended to what the layer returns (one tensor), detached (no
    gradient reaches them: they are constants of this step), in its dtype; the layers before it run the
    batch alone.

    Args:
        pairing: ``"aligned"`` (sample ``i`` with partner ``i``, as Balanced-MixUp pairs its two loaders'
            batches: the partner batch must have the batch's size) or ``"shuffled"`` (a random choice of
            ``B`` distinct partners among the ``P >= B``).
        at: ``"input"`` (partners are inputs, run through the layers before the mix with the batch) or
            ``"layer"`` (partners are rows of the mixed layer's output: a memory bank's).

    Refused in one line: a partner batch of the wrong size, device, dtype or shape, a model that takes
    other per-sample arguments (a padding mask the partner rows would lack), and a mixer that chooses
    its partners itself (C-Mixup, the saliency mixers), keeps a clean batch (RegMixup) or draws them from
    every rank. Under activation checkpointing, layers inside the model may be checkpointed; with
    ``at="input"`` a recomputation of the whole model's forward (the partner batch is not appended again)
    is refused.
    """

    knob = "partners"
    needs_partner_batch = True

    def __init__(self, pairing: str = "aligned", at: str = "input"):
        if pairing not in ("aligned", "shuffled"):
            raise ValueError(f"pairing must be 'aligned' or 'shuffled', got {pairing!r}")
        if at not in ("input", "layer"):
            raise ValueError(f"at must be 'input' or 'layer', got {at!r}")
        self.pairing, self.at = pairing, at

    def __repr__(self) -> str:
        at = "" if self.at == "input" else ", at='layer'"
        return f"{type(self).__name__}(pairing={self.pairing!r}{at})"

    def check_mixer(self, mixer: Mixer) -> None:
        _refuse_own_partners(self, mixer)
        if mixer.clean:
            raise ValueError(
                f"{type(self).__name__}: {type(mixer).__name__} keeps the clean batch beside its mix "
                "(clean=True), whose rows would be the batch's and the partners'; use a mixer without a "
                "clean batch"
            )

    def sample_lam(self, mixer: Mixer, n: int, generator: torch.Generator) -> torch.Tensor:
        """lam of a mix of ``n`` rows (the batch's and the partners'): the mixer's own draw."""
        return mixer.sample_lam(n, generator)

    def begin(self, mixer: Mixer, model, args: tuple, kwargs: dict, pinned: Mapping, dim: int):
        name = type(self).__name__
        inputs = pinned.get("partner_inputs")
        if inputs is None:
            raise RuntimeError(
                f"{name}: no partner batch for this training forward; call mixer.use_partners(inputs, "
                "targets) before every training forward"
            )
        targets = pinned.get("partner_targets")
        if self.at == "layer":  # (appended at the mixed layer: extend)
            return args, kwargs, self._rows(inputs, targets)
        key = input_key(args, kwargs)
        first = args[0] if key is None else kwargs.get(key)
        if not isinstance(first, torch.Tensor):
            raise TypeError(
                f"{name} appends the partner batch to the model's input (its first positional argument, or "
                "its first keyword argument when it takes none: the HuggingFace Trainer's pixel_values=), a "
                f"tensor; this forward got {describe(first) if args or kwargs else 'no argument'}"
            )
        batch, rows = first.shape[dim], inputs.shape[dim] if inputs.ndim > dim else -1
        if inputs.ndim != first.ndim or inputs.shape[:dim] + inputs.shape[dim + 1 :] != (
            first.shape[:dim] + first.shape[dim + 1 :]
        ):
            raise ValueError(
                f"{name}: the partner batch has shape {tuple(inputs.shape)}, the batch {tuple(first.shape)}: "
                f"they must differ in the batch dimension ({dim}) only"
            )
        if inputs.device != first.device or inputs.dtype != first.dtype:
            raise ValueError(
                f"{name}: the partner batch is {inputs.dtype} on {inputs.device}, the batch {first.dtype} on "
                f"{first.device}; move it where the batch is"
            )
        if self.pairing == "aligned" and rows != batch:
            raise ValueError(
                f"{name}(pairing='aligned') pairs sample i with partner i: the partner batch has "
                f"{rows} rows, the batch {batch}; give one partner per sample, or pairing='shuffled' for a "
                "larger pool"
            )
        if rows < batch:
            raise ValueError(
                f"{name}(pairing='shuffled') draws {batch} distinct partners: the partner batch has "
                f"only {rows}"
            )
        others = [*(f"argument {i}" for i, v in enumerate(args[1:], 1) if _carries(v, batch, dim)),
                  *(repr(k) for k, v in kwargs.items() if k != key and _carries(v, batch, dim))]  # fmt: skip
        if others:
            raise ValueError(
                f"{name} appends the partner batch to the model's input only, but this forward also "
                f"passes {', '.join(others)} with a row per sample (a padding mask?), which the partner rows "
                "would lack"
            )
        if targets is not None and (targets.ndim == 0 or targets.shape[0] != rows):
            raise ValueError(
                f"{name}: the partner batch has {rows} rows but {tuple(targets.shape)} labels; give "
                "one per row"
            )
        values = {"partner_rows": rows, "partner_targets": targets}
        if key is not None:
            return args, {**kwargs, key: torch.cat([first, inputs], dim)}, values
        return (torch.cat([first, inputs], dim), *args[1:]), kwargs, values

    def _rows(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> dict:
        """``at="layer"``: the partner rows and their labels, checked, as the values to pin."""
        name = type(self).__name__
        if inputs.ndim == 0:
            raise ValueError(
                f"{name}(at='layer'): the partner rows must have a batch dimension, got a number"
            )
        if targets is not None and (targets.ndim == 0 or targets.shape[0] != inputs.shape[0]):
            raise ValueError(
                f"{name}: the partner rows are {inputs.shape[0]} but {tuple(targets.shape)} labels; give "
                "one per row"
            )
        return {"partner_rows": inputs.shape[0], "partner_targets": targets, BANK: inputs.detach()}

    def extend(self, kind: str, spec: str, leaves: tuple, pinned: Mapping) -> tuple | None:
        """``at="layer"``: the partner rows appended to the layer's one tensor along its batch dimension."""
        bank = pinned.get(BANK)
        if bank is None:
            return None
        site_value, found, given, n = leaves
        name = type(self).__name__
        if len(found) != 1 or found[0].path != () or given[0] is not found[0]:
            raise TypeError(
                f"{kind} with {name}(at='layer') appends the partner rows to what {spec!r} returns, which "
                f"must be one tensor mixed as it is; it returned {describe(site_value)}"
            )
        leaf = found[0]
        t, d = leaf.tensor, leaf.dim
        if bank.ndim != t.ndim or bank.shape[:d] + bank.shape[d + 1 :] != t.shape[:d] + t.shape[d + 1 :]:
            raise ValueError(
                f"{name}(at='layer'): the partner rows have shape {tuple(bank.shape)}, but {spec!r} returns "
                f"{tuple(t.shape)}: they must differ in the batch dimension ({d}) only"
            )
        if bank.device != t.device:
            raise ValueError(
                f"{name}(at='layer'): the partner rows are on {bank.device}, {spec!r}'s output on "
                f"{t.device}; move them where the model is"
            )
        batch, pool = t.shape[d], bank.shape[d]
        if (self.pairing == "aligned" and pool != batch) or pool < batch:
            raise ValueError(
                f"{name}(pairing={self.pairing!r}, at='layer'): {pool} partner rows for a batch of {batch}; "
                + ("give one per sample" if self.pairing == "aligned" else f"give {batch} or more")
            )
        rows = torch.cat([t, bank.to(t.dtype)], d)
        extended = [Leaf((), rows, d)]
        return rows, extended, extended, n + bank.shape[d]

    def draws(self, mixer: Mixer, spec: str, n: int, pins, generator: torch.Generator) -> Draw:
        rows = pins.values.get("partner_rows", 0)
        own = n - rows
        if own < 1 or (self.pairing == "aligned" and own != rows) or own > rows:
            raise RuntimeError(
                f"{type(self).__name__}: {spec!r} has {n} rows where the batch and its partner batch "
                f"of {rows} should be: a recomputation of the whole model's forward (activation "
                "checkpointing around the model) does not append the partner batch again; checkpoint the "
                "layers inside the model"
            )
        lam = pins.lam
        if lam is None:
            lam = self.sample_lam(mixer, n, generator)
            lam = (
                lam
                if type(lam) is torch.Tensor and lam.dtype == torch.float64
                else torch.as_tensor(lam, dtype=torch.float64)
            )
        elif lam.ndim == 1 and lam.shape[0] == own:  # (pinned for the batch's rows: the partners' are unused)
            lam = torch.cat([lam, lam.new_ones(rows)])
        elif lam.ndim == 1 and lam.shape[0] != n:
            raise ValueError(
                f"pinned lam has {lam.shape[0]} values but the batch at layer {spec!r} has {own}"
            )
        index = pins.index
        if index is not None and index.shape[0] == n:  # a repeat (pin_last, a recomputation): as drawn
            return Draw(spec, lam, index, generator, pins.given, pins.permutation, weight_of(lam))
        if index is None:
            chosen = (
                torch.arange(own, device=generator.device)
                if self.pairing == "aligned"
                else torch.randperm(rows, generator=generator, device=generator.device)[:own]
            )
            distinct = True
        else:
            low, high = pins.span
            if index.shape[0] != own or low < 0 or high >= rows:
                raise ValueError(
                    f"pinned index of length {index.shape[0]} (values {index.tolist()[:8]}...) does not pick "
                    f"partners among the {rows} of the partner batch for the batch of {own} at layer {spec!r}"
                )
            chosen, distinct = index, len(set(index.tolist())) == own
        full = torch.arange(n, device=chosen.device)
        full[:own] = own + chosen
        if distinct:  # each chosen partner row takes its sample's place: a permutation of the n rows
            full[own + chosen] = torch.arange(own, device=chosen.device)
        return Draw(spec, lam, full, generator, pins.given, distinct, weight_of(lam))

    def adjust(self, draw: Draw, leaves: list, own: int):
        return None, {"partners": "batch", "partner_rows": draw.pinned.get("partner_rows", 0),
                      "partner_targets": draw.pinned.get("partner_targets")}  # fmt: skip

    def finish(self, leaves: list, tensors: dict, state: MixState) -> tuple[dict, MixState]:
        """The batch's ``B`` mixed rows only; lam, the index (into the partner batch) and the region
        weights of those rows."""
        rows = state.info.get("partner_rows", 0)
        own = state.index.shape[0] - rows
        tensors = {leaf.path: tensors[leaf.path].narrow(leaf.dim, 0, own) for leaf in leaves}
        lam = state.lam[:own] if state.lam.ndim == 1 else state.lam
        weights = state.weights
        if weights is not None and weights.shape[0] == own + rows:
            weights = weights[:own]
        shapes = tuple(
            s[:d] + (own,) + s[d + 1 :] for s, d in zip(state.shapes, state.batch_dims, strict=True)
        )
        info = {k: (v[:own] if k in _PER_ROW and v is not None else v) for k, v in state.info.items()}
        return tensors, replace(
            state, lam=lam, index=state.index[:own] - own, info=info, weights=weights, shapes=shapes
        )


def class_balanced_weights(labels: torch.Tensor) -> torch.Tensor:
    """Each sample's weight in a class-balanced draw (the partner batch Balanced-MixUp takes; the app's
    ``data.sampler=balanced``): one over its class's size (float64), so that every class present is drawn
    equally often."""
    counts = torch.bincount(labels).to(torch.float64)
    return 1.0 / counts[labels]


def input_key(args: tuple, kwargs: dict) -> str | None:
    """Where a forward's input is, for a partner batch appended to it: ``None`` for its first positional
    argument; the name of its first keyword argument when it has no positional one (the HuggingFace
    Trainer calls ``model(**batch)``: ``pixel_values=``, ``input_features=``)."""
    return None if args else next(iter(kwargs), None)


def _carries(value, batch: int, dim: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim > dim and value.shape[dim] == batch


class BalancedMixup(PartnerBatch):
    """Balanced-MixUp (Galdran et al. 2021): each sample mixed with the sample at its place in a second,
    class-balanced batch, the partner's weight ``lam ~ Beta(alpha, 1)`` (small for the paper's ``alpha``:
    the mix stays close to the instance-sampled batch, and the minority classes come in through the
    partners): the sample keeps ``1 - lam``, as the authors' ``(1 - lam) * inputs + lam *
    balanced_inputs`` (agaldran/balanced_mixup ``train_lt_mxp.py``). A :class:`PartnerBatch` with aligned
    pairing; the app feeds the class-balanced batch (``mixup=balanced``).

    Args:
        alpha: the Beta(alpha, 1) concentration of the partner's weight, > 0 (authors: 0.1 to 0.3).
    """

    needs_classes = True
    why_classes = "pairs each sample with one of a class-balanced batch"

    def __init__(self, alpha: float = 0.1):
        super().__init__("aligned")
        self.alpha = check_positive("alpha", alpha)

    def __repr__(self) -> str:
        return f"BalancedMixup(alpha={self.alpha})"

    def sample_lam(self, mixer: Mixer, n: int, generator: torch.Generator) -> torch.Tensor:
        return 1 - sample_beta(self.alpha, 1.0, generator)  # the sample's own weight


# ------------------------------------------------------------------------------- saliency pairing

SALIENCY = "pairing_saliency"  # its pinned key (apart from the saliency mixers' "saliency")


def gradient_saliency(grad: torch.Tensor) -> torch.Tensor:
    """GuidedMixup's saliency of a ``(B, C, ...)`` gradient: the saliency mixers' ``sqrt(mean_c g**2)``
    per position (:func:`mixhook.engine.saliency.gradient_saliency`); ``|g|`` of a ``(B, D)`` one, whose
    mean over ``D`` would leave one number per sample to pair by. Detached, float32 at least."""
    if grad.ndim != 2:
        return sources.gradient_saliency(grad)
    return grad.detach().abs().to(torch.promote_types(grad.dtype, torch.float32))


def activation_saliency(h: torch.Tensor) -> torch.Tensor:
    """The activation saliency of a ``(B, C, ...)`` map: the saliency mixers' ``mean_c |h|`` per position
    (:func:`mixhook.engine.saliency.activation_saliency`); ``|h|`` of a ``(B, D)`` one. Detached, float32
    at least."""
    if h.ndim != 2:
        return sources.activation_saliency(h)
    return h.detach().abs().to(torch.promote_types(h.dtype, torch.float32))


class SaliencyPairing(Policy):
    """GuidedMixup's pairing (Kang & Kim 2023): each sample's partner chosen by a greedy cycle over the
    batch's saliency distances, so that samples whose salient regions differ most are mixed (and a mix
    keeps both salient parts): the ``(B, B)`` L2 distances between the samples' saliency maps (blurred,
    each normalised to sum 1, as the authors do), then :func:`~mixhook.engine.saliency.greedy_cycle`, all on
    the device (:func:`~mixhook.engine.saliency.guided_pairs`: GuidedMixup's own pairing too).

    Args:
        saliency: ``"gradient"`` (default; the authors' ``guided-ap``: ``sqrt(mean_c g**2)`` of the gradient
            of the batch's cross-entropy with respect to what is mixed: one more forward and a backward down
            to the layer, in eval mode, before the training forward; needs ``use_targets(y)``) or
            ``"activation"`` (``mean_c |h|`` of the mixed map itself: no extra pass; not at ``"input"``).
        blur: the Gaussian blur's kernel size on 2-D maps (authors: 7; 0: none).
        sigma: its standard deviation (authors: 3).

    The mix itself is the mixer's own: with ManifoldMixup the pairs are blended (GuidedMixup's own mix is
    a saliency-weighted one; this policy is its pairing, for any mixer). The pairing is a permutation; a
    pinned ``index`` wins. Cost: ``B - 2`` sequential device steps per mix.
    """

    knob = "partners"

    def __init__(self, saliency: str = "gradient", blur: int = 7, sigma: float = 3.0):
        if saliency not in ("gradient", "activation"):
            raise ValueError(f"saliency must be 'gradient' or 'activation', got {saliency!r}")
        if not isinstance(blur, int) or blur < 0:
            raise ValueError(f"blur must be a kernel size >= 0, got {blur!r}")
        self.saliency, self.blur, self.sigma = saliency, blur, check_positive("sigma", sigma)

    def __repr__(self) -> str:
        return f"SaliencyPairing(saliency={self.saliency!r}, blur={self.blur}, sigma={self.sigma})"

    def check_mixer(self, mixer: Mixer) -> None:
        _refuse_own_partners(self, mixer)
        if self.saliency == "activation" and INPUT in mixer.layers:
            raise ValueError(
                "SaliencyPairing(saliency='activation') at 'input': the input is mixed before any layer "
                "runs, so there is no activation to read; use saliency='gradient' (one more forward and "
                "backward) there"
            )

    def before_forward(self, mixer: Mixer, model, args, kwargs, spec: str, pinned, targets):
        if self.saliency != "gradient" or SALIENCY in pinned or "index" in pinned:
            return {}
        grad = mixer.gradient_at(model, args, kwargs, spec, targets)
        return {SALIENCY: gradient_saliency(mixer.channels_first(spec, grad))}

    def before_mix(self, mixer: Mixer, spec: str, leaves: list, pinned: Mapping) -> Mapping:
        if self.saliency != "activation" or SALIENCY in pinned or "index" in pinned:
            return {}
        h = leaves[0].tensor.movedim(leaves[0].dim, 0)
        return {SALIENCY: activation_saliency(mixer.channels_first(spec, h))}

    def maps(self, saliency: torch.Tensor) -> torch.Tensor:
        """The saliency maps as they are compared: blurred (2-D maps), each normalised to sum 1, flattened."""
        return sources.guided_maps(saliency, self.blur, self.sigma).flatten(1)

    def draws(self, mixer: Mixer, spec: str, n: int, pins, generator: torch.Generator) -> Draw | None:
        if pins.index is not None:
            return None  # (pinned, or a repeat: the mixer's own path)
        saliency = pins.values.get(SALIENCY)
        if saliency is None or saliency.shape[0] != n:
            raise RuntimeError(
                f"SaliencyPairing at {spec!r}: no saliency of the {n} rows mixed (attach the mixer, and give "
                "the labels with use_targets(y) before each training forward for saliency='gradient')"
            )
        index = guided_pairs(saliency, self.blur, self.sigma)
        lam = pins.lam
        if lam is None:
            lam = torch.as_tensor(mixer.sample_lam(n, generator), dtype=torch.float64)
        elif lam.ndim == 1 and lam.shape[0] != n:
            raise ValueError(f"pinned lam has {lam.shape[0]} values but the batch at layer {spec!r} has {n}")
        return Draw(spec, lam, index, generator, pins.given, True, weight_of(lam))
