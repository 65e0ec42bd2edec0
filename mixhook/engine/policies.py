"""Policies: who is paired, how much, and what the target is, as objects any mixer takes.

A mix fixes three things that the calibration and long-tail methods change one at a time: the partners
(a random permutation of the batch), lam (drawn per batch or per sample) and the target
(``lam * y + (1 - lam) * y[index]``). A :class:`Policy` changes one of them for any mixer that can take it
(``mixer.use(policy, ...)``, at most one policy per knob, :data:`KNOBS`); the methods built on them are in
:mod:`mixhook.policies`. This module is how one training forward consults them, hop by hop as data
travels (:class:`Policies`, which the :class:`~mixhook.engine.mixer.Mixer` holds):

- the model's pre-hook: :meth:`Policy.begin` (a partner batch appended to the model's input) and
  :meth:`Policy.before_forward` (a pass the policy needs first: gradient saliency for a pairing);
- the mixed layer: :meth:`Policy.extend` (a memory bank's partner rows appended to the layer's output),
  :meth:`Policy.before_mix` (activation saliency), :meth:`Policy.draws` (lam and the
  partner index, where the policy draws them), :meth:`Policy.adjust` (lam warped per pair, each pair's
  weight in the loss), and after the method's mix :meth:`Policy.finish` (the partner batch's rows
  dropped);
- ``loss()``/``targets()`` (:meth:`Policies.mixed_loss`, :meth:`Policies.target_lam`):
  :meth:`Policy.target_lam` (the label's weight), :meth:`Policy.pair_weights` (each pair's share of the
  loss), :meth:`Policy.extra_loss` (a term of the method's own); after a clean+mixed forward, a loss
  policy that reads the clean rows (:attr:`Policy.takes_clean`) gives the whole loss
  (:meth:`Policy.clean_loss`: SUMix).

A policy may also hook the model when its mixer is attached (:meth:`Policy.register`: a module whose output
its loss reads) and train parameters of its own (:meth:`Policy.parameters`, saved with the mixer's state:
SUMix's uncertainty layer); its mixer's ``parameters()`` and ``state_dict()`` include them.

Everything a policy computes in a forward runs on the activations' device without a host read; what it
computes once per forward (a saliency map, the partner batch) joins the forward's pinned values, so that a
recomputation under activation checkpointing and ``pin_last`` repeat the same mix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch

from ..functional import positions, weight_of
from ..transfer import to_device
from .contract import Draw, MixingHook, MixState

KNOBS = ("partners", "lam", "target", "weights", "loss")
FEATURES = "features"  # the pinned key of the features given with use_features()


class Policy:
    """One knob of a mix (:data:`KNOBS`), for any mixer that can take it. A subclass sets ``knob`` and
    implements the hooks of that knob; every hook does nothing by default. Policies hold configuration
    only (per-forward values travel in the forward's pinned values), so one policy object may serve
    several mixers (:class:`~mixhook.OneOf`'s); one with parameters of its own (SUMix's) serves the
    mixers of one model (a OneOf's), which share them. The ``mixer`` the hooks are given is the
    :class:`~mixhook.engine.mixer.Mixer` that uses the policy (its ``layers``, ``sample_lam``,
    ``gradient_at``, ...), typed by its contract: the engine imports its modules one way only."""

    knob: ClassVar[str] = ""
    # Whether it needs class-index targets (B,) (Remix, a class-balanced partner batch, DecoupleMix):
    # regression or soft targets are refused in one line.
    needs_classes: ClassVar[bool] = False
    # Whether the mixer needs use_partners(inputs, targets) before every training forward.
    needs_partner_batch: ClassVar[bool] = False
    # Whether it reads the training set's class counts, as its ``counts`` (None until given: Remix); the app
    # gives the data's, as it gives a method whose card states the trait "class_counts".
    needs_class_counts: ClassVar[bool] = False
    # Whether loss() then adds a term or weights that targets() cannot express (targets() refuses).
    changes_loss: ClassVar[bool] = False
    # Whether it takes distances between the rows mixed (refused where padding makes them meaningless).
    takes_distances: ClassVar[bool] = False
    # Whether its loss reads the clean rows beside the mixed ones: loss() is then its clean_loss() (SUMix's)
    # and the mixer's use() turns clean on while it is used; and whether batch norm then normalises the two
    # halves apart, as its authors' two forwards do (mixhook.engine.norms).
    takes_clean: ClassVar[bool] = False
    batch_norm_apart: ClassVar[bool] = False

    def check_mixer(self, mixer: MixingHook) -> None:
        """Refuse, in one line, a mixer this policy cannot act through (at ``use()``)."""

    def check_targets(self, kind: str, target: torch.Tensor) -> None:
        """Refuse, in one line, labels this policy cannot train with (the app calls it on a sample batch)."""
        if self.needs_classes and (
            not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.ndim != 1
        ):
            what = (
                f"{target.dtype} {tuple(target.shape)}" if isinstance(target, torch.Tensor) else type(target)
            )
            raise ValueError(
                f"{kind} with {type(self).__name__} needs class indices (B,) as targets, got {what}: "
                f"{type(self).__name__} {self.why_classes}"
            )

    why_classes: ClassVar[str] = "is defined for classification"

    # ----------------------------------------------------------------------- attached, and its parameters
    def register(self, mixer: MixingHook, model, handles: list) -> None:
        """When ``mixer`` is attached to ``model``, after its own hooks: hooks of the policy's own on the
        model (appended to ``handles``, removed with the mixer's), and a one-line refusal of what it
        cannot act through there. Nothing by default."""

    def reset(self) -> None:
        """When its mixer is removed: let go of what :meth:`register` held of the model (nothing of the
        model outlives ``remove()``). Nothing by default."""

    def parameters(self):
        """The policy's own trainable parameters (made at :meth:`register`), which its mixer's
        ``parameters()`` yields for the optimizer; none by default."""
        return iter(())

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the policy (its parameters' values); nothing by default."""
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from :meth:`state_dict` (given before or after :meth:`register`)."""

    # ------------------------------------------------------------------------------- the forward
    def begin(
        self, mixer: MixingHook, model, args: tuple, kwargs: dict, pinned: Mapping, dim: int
    ) -> tuple | None:
        """At the model's pre-hook of a forward that mixes: ``(args, kwargs, values)`` where the policy
        changes the model's arguments (a partner batch appended along the input's batch dimension ``dim``)
        and the values to pin; ``None``: no change."""
        return None

    def before_forward(self, mixer: MixingHook, model, args: tuple, kwargs: dict, spec: str, pinned, targets):
        """At the model's pre-hook of a forward that mixes at ``spec``: values to pin (a gradient pass)."""
        return {}

    def before_mix(self, mixer: MixingHook, spec: str, leaves: list, pinned: Mapping) -> Mapping:
        """At the mixed layer, before the mix: values to pin (activation saliency; ``leaves`` as the method
        is given them: ``mixer.channels_first(spec, t)`` reads a map's channels on any layout)."""
        return {}

    def extend(self, kind: str, spec: str, leaves: tuple, pinned: Mapping) -> tuple | None:
        """At the mixed layer: its ``(site value, found, given, rows)`` with rows of the policy's appended
        (a memory bank's partners), or ``None``: as they are."""
        return None

    def draws(self, mixer: MixingHook, spec: str, n: int, pins, generator: torch.Generator) -> Draw | None:
        """The :class:`Draw` of a mix of ``n`` rows where this policy draws lam or the partners (a
        partners policy); ``None``: the mixer draws as it would alone."""
        return None

    def adjust(self, draw: Draw, leaves: list, own: int) -> tuple[torch.Tensor | None, dict]:
        """After the draw, before the mix: lam as the mix must use it (``None``: the drawn one) and what
        to record in the mix's ``info``, from the drawn ``draw`` and the leaves the method is given
        (``own``: how many of their rows are the batch's own, before a partner batch's)."""
        return None, {}

    def finish(self, leaves: list, tensors: dict, state: MixState) -> tuple[dict, MixState]:
        """After the method's mix: the mixed tensors and the :class:`MixState` as the rest of the forward
        and ``loss()`` must see them (a partner batch's rows dropped)."""
        return tensors, state

    # ---------------------------------------------------------------------------------- the loss
    def target_lam(self, lam: torch.Tensor, target: torch.Tensor, partner: torch.Tensor, classes: int | None):
        """The weight of each sample's own label (one per sample, on the target's device) from the mix's
        ``lam`` (0-d or one per sample), the labels of the samples and of their partners, and the number of
        classes where it is known (the logits', or ``targets(num_classes=...)``)."""
        return lam

    def pair_weights(self, last: MixState) -> torch.Tensor | None:
        """Each pair's weight in the loss (one per sample), or ``None``."""
        return None

    def extra_loss(self, logits, target, partner, lam) -> torch.Tensor:
        """A per-sample term added to the mixed loss."""
        raise NotImplementedError

    def clean_loss(self, criterion, clean, mixed, target, partner, last: MixState) -> torch.Tensor:
        """With :attr:`takes_clean`: the whole loss of a clean+mixed forward, from the ``clean`` and
        ``mixed`` logits (``B`` rows each), the labels of the samples and of their partners, and the mix
        ``last`` (with what the policy's hooks put in its ``loss_inputs``)."""
        raise NotImplementedError


def refuse_own_loss(policy: Policy, mixer: MixingHook) -> None:
    """A target, weights or loss policy changes the mixed criterion: refuse a mixer whose loss is its own
    (``takes_loss_policies = False``: RankMixup), and one that may mix more than two samples per row
    (``samples_per_row``: AdAutoMix's three-sample mixes), whose labels two weights cannot describe."""
    if not type(mixer).takes_loss_policies:
        raise TypeError(
            f"{type(policy).__name__} changes the mixed loss, which {type(mixer).__name__}'s own loss "
            "does not use"
        )
    many = getattr(mixer, "samples_per_row", 2)
    if many > 2:
        raise TypeError(
            f"{type(policy).__name__} weighs two labels per row, and {type(mixer).__name__} mixes up to "
            f"{many} samples per row; use it with a mix of two"
        )


def refuse_global_partners(policy: Policy, mixer: MixingHook, does: str) -> None:
    """Refuse a mixer that draws its partners from every rank (``partners="global"``) for a policy that
    ``does`` something with the partners this rank does not hold."""
    if getattr(mixer, "partners", "local") == "global":
        raise ValueError(
            f"{type(policy).__name__} {does}; {type(mixer).__name__}(partners='global') draws them from "
            "every rank"
        )


class Policies:
    """The policies a mixer uses (``mixer.use(...)``), one per knob, and the calls its hooks make to them
    (each a no-op for a knob with no policy)."""

    def __init__(self, kind: str, policies: Sequence[Policy]):
        self.kind = kind
        self.by_knob: dict[str, Policy] = {}
        for policy in policies:
            if not isinstance(policy, Policy):
                raise TypeError(
                    f"{kind}.use() takes policies (mixhook.policies: Remix, KernelWarping, PartnerBatch, "
                    f"...), got {type(policy).__name__}"
                )
            other = self.by_knob.get(policy.knob)
            if other is not None:
                raise ValueError(
                    f"{kind}.use(): {type(other).__name__} and {type(policy).__name__} both set the "
                    f"{policy.knob} of a mix; one policy per knob"
                )
            self.by_knob[policy.knob] = policy
        # in the order a forward meets them
        self.all = tuple(self.by_knob[k] for k in KNOBS if k in self.by_knob)

    def __repr__(self) -> str:
        return repr(list(self.all))

    def get(self, knob: str) -> Policy | None:
        return self.by_knob.get(knob)

    @property
    def changes_loss(self) -> bool:
        """Whether ``loss()`` adds a term or weights that ``targets()`` cannot express."""
        return any(p.changes_loss for p in self.all)

    @property
    def on_loss(self) -> bool:
        """Whether ``loss()`` and ``targets()`` go through the policies (a target, weights or loss policy)."""
        return any(k in self.by_knob for k in ("target", "weights", "loss"))

    def check_targets(self, target: torch.Tensor) -> None:
        for policy in self.all:
            policy.check_targets(self.kind, target)

    @property
    def batch_norm_apart(self) -> bool:
        return any(p.batch_norm_apart for p in self.all)

    def register(self, mixer: MixingHook, model, handles: list) -> None:
        for policy in self.all:
            policy.register(mixer, model, handles)

    def reset(self) -> None:
        for policy in self.all:
            policy.reset()

    def parameters(self):
        for policy in self.all:
            yield from policy.parameters()

    def state_dict(self) -> dict:
        """Each policy's state that is not empty, by knob, with the policy's name (checked on loading)."""
        return {p.knob: {**s, "policy": type(p).__name__} for p in self.all if (s := p.state_dict())}

    def check_state(self, state: Mapping) -> None:
        """Refuse, in one line, a state saved with other policies (before anything of it is loaded)."""
        for knob, value in state.items():
            policy = self.by_knob.get(knob)
            name = None if policy is None else type(policy).__name__
            if name != value.get("policy"):
                raise ValueError(
                    f"load_state_dict(): the state holds a {value.get('policy')} policy's ({knob}), and "
                    f"{self.kind} uses {name or 'none'} there; use the policies it was saved with"
                )

    def load_state_dict(self, state: Mapping) -> None:
        self.check_state(state)
        for knob, value in state.items():
            self.by_knob[knob].load_state_dict({k: v for k, v in value.items() if k != "policy"})

    def clean_loss(self, criterion, clean, mixed, target, partner, last: MixState):
        """The loss policy's whole loss of a clean+mixed forward where it reads the clean rows, else
        ``None``."""
        policy = self.by_knob.get("loss")
        if policy is None or not policy.takes_clean:
            return None
        return policy.clean_loss(criterion, clean, mixed, target, partner, last)

    # ------------------------------------------------------------------------------- the forward
    def begin(
        self, mixer: MixingHook, model, args: tuple, kwargs: dict, forward, targets, given: dict, dim: int
    ):
        """The model's pre-hook of a training forward (``forward``: ``None`` when it does not mix):
        ``(args, kwargs)`` where a policy changed the model's arguments, else ``None``. ``given``: what
        ``use_features``/``use_partners`` gave for this forward; ``dim``: the batch dimension of the model's
        input."""
        if forward is None:
            return None
        extra = {}
        if FEATURES in given:
            extra[FEATURES] = given[FEATURES]
        changed = None
        for policy in self.all:
            begun = policy.begin(mixer, model, args, kwargs, {**forward.pins.given, **given}, dim)
            if begun is not None:
                args, kwargs, values = begun
                extra.update(values)
                changed = (args, kwargs)
            extra.update(
                policy.before_forward(mixer, model, args, kwargs, forward.layer, forward.pins.given, targets)
            )
        if extra:
            forward.pins = forward.pins.joined(extra)
        return changed

    def before_mix(self, mixer: MixingHook, spec: str, leaves: list, pinned: Mapping) -> dict:
        extra = {}
        for policy in self.all:
            extra.update(policy.before_mix(mixer, spec, leaves, pinned))
        return extra

    def extend(self, spec: str, leaves: tuple, pinned: Mapping) -> tuple:
        """The mixed layer's ``(site value, found, given, rows)`` with a partners policy's rows appended
        at the layer (a memory bank's: :meth:`Policy.extend`), or as they are."""
        partners = self.by_knob.get("partners")
        extended = None if partners is None else partners.extend(self.kind, spec, leaves, pinned)
        return leaves if extended is None else extended

    def draws(self, mixer: MixingHook, spec: str, n: int, pins, generator: torch.Generator) -> Draw | None:
        partners = self.by_knob.get("partners")
        return None if partners is None else partners.draws(mixer, spec, n, pins, generator)

    def adjust(self, draw: Draw, leaves: list, padded: bool) -> tuple[Draw, dict]:
        """``draw`` with lam as the mix must use it, and what the policies record in the mix's ``info``
        (``padded``: whether the model takes padding masks, which make the rows' distances meaningless)."""
        own = draw.index.shape[0] - draw.pinned.get("partner_rows", 0)
        measuring = [type(p).__name__ for p in self.all if p.takes_distances]
        if measuring and FEATURES not in draw.pinned and padded:
            raise ValueError(
                f"{measuring[0]} at {draw.layer!r}: the model takes padding masks, so the rows mixed there "
                "hold padded positions, whose distance means nothing; give each sample's features with "
                "use_features(f) (e.g. the mean of its real tokens' embeddings)"
            )
        info: dict[str, Any] = {}
        for policy in self.all:
            lam, recorded = policy.adjust(draw, leaves, own)
            info.update(recorded)
            if lam is not None:
                draw = replace(draw, lam=lam, weight=weight_of(lam))
        return draw, info

    def finish(self, leaves: list, tensors: dict, state: MixState) -> tuple[dict, MixState]:
        for policy in self.all:
            tensors, state = policy.finish(leaves, tensors, state)
        return tensors, state

    # ---------------------------------------------------------------------------------- the loss
    def mixed_loss(self, criterion: Callable, logits, target, partner, last: MixState, own_terms: bool):
        """``loss()`` under a mix with a target, weights or loss policy: the criterion of the samples' and of
        their partners' labels (``partner``) weighted by the target policy's lam (:meth:`target_lam`), then,
        with ``own_terms`` (``loss``, not ``weigh``), each pair's weight and the loss policy's term."""
        if positions(target) > 0:
            raise ValueError(
                f"loss(): {self.kind} with {self!r} takes one label per sample, got a dense target "
                f"{target.dtype} {tuple(target.shape)}"
            )
        loss_a = criterion(logits, target)
        loss_b = criterion(logits, partner)
        classes = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.ndim == 2 else None
        label_lam = self.target_lam(last, target, partner, "loss", classes)
        lam = to_device(label_lam, loss_a.device, loss_a.dtype)
        if lam.ndim == 1 and (loss_a.ndim == 0 or loss_a.shape[0] != lam.shape[0]):
            raise ValueError(
                f"loss(): {self.kind} with {self!r} weighs each sample's labels by its own lam, so the "
                "criterion must return one loss per sample (reduction='none'), but it returned shape "
                f"{tuple(loss_a.shape)}"
            )
        if lam.ndim == 1 and loss_a.ndim > 1:
            lam = lam.view(-1, *[1] * (loss_a.ndim - 1))
        value = torch.lerp(loss_b, loss_a, lam)
        if not own_terms:
            return value
        weights = self.by_knob.get("weights")
        if weights is not None:
            w = weights.pair_weights(last)
            if value.ndim != 1 or value.shape[0] != w.shape[0]:
                raise ValueError(
                    f"loss(): {type(weights).__name__} weighs each pair's loss, so the criterion must return "
                    f"one loss per sample (reduction='none'), but it returned shape {tuple(value.shape)}"
                )
            w = to_device(w, value.device, value.dtype)
            # (w / sum(w) first: all-zero weights give 0, where B / tiny overflows float32 and 0 * inf is NaN)
            value = value * (w / w.sum().clamp_min(torch.finfo(value.dtype).tiny) * w.shape[0])
        extra = self.by_knob.get("loss")
        if extra is not None:
            term = extra.extra_loss(logits, target, partner, label_lam).to(value.dtype)
            if value.ndim == 0:
                term = term.mean()
            elif value.shape != term.shape:
                raise ValueError(
                    f"loss(): {type(extra).__name__} adds one term per sample, but the criterion returned "
                    f"shape {tuple(value.shape)}: return one loss per sample (reduction='none') or a number"
                )
            value = value + term
        return value

    def target_lam(self, last: MixState, target, partner, what: str, classes: int | None) -> torch.Tensor:
        """The weight of each sample's own label under the mix ``last``: the mix's lam, as the target policy
        (Remix) changes it, on the target's device."""
        policy = self.by_knob.get("target")
        lam = to_device(last.lam, target.device)
        if policy is None:
            return lam
        if target.ndim != 1 or target.dtype.is_floating_point:
            raise ValueError(
                f"{what}(): {type(policy).__name__} weighs one label per sample: it needs class indices "
                f"(B,), got {target.dtype} {tuple(target.shape)}"
            )
        return policy.target_lam(lam, target, partner, classes)


def given_features(draw: Draw, leaves: list, kind: str, what: str) -> list[torch.Tensor]:
    """The rows a distance is taken between: the features given with ``use_features`` (one tensor, its
    rows the mix's), else the mixed layer's leaves, each flattened to ``(rows, -1)`` in float32 at least
    (float64 stays), detached. A leaf whose batch is not its first dimension is moved there; a leaf that
    is not floating point has no distance (one line)."""
    given = draw.pinned.get(FEATURES)
    rows = draw.index.shape[0]
    if given is not None:
        if not isinstance(given, torch.Tensor) or given.ndim < 1 or given.shape[0] != rows:
            shape = tuple(given.shape) if isinstance(given, torch.Tensor) else type(given).__name__
            raise ValueError(
                f"{kind}: use_features() gave {shape}, but the mix at {draw.layer!r} has {rows} rows: give "
                f"one feature row per row mixed ({rows},...)"
            )
        tensors = [given]
    else:
        tensors = []
        for leaf in leaves:
            t = leaf.tensor
            if not t.is_floating_point():
                raise TypeError(
                    f"{kind}: {what} needs distances between the rows mixed at {draw.layer!r}, but its "
                    f"{leaf.name} is {str(t.dtype).removeprefix('torch.')}, which has none; mix a floating "
                    "layer or give the features with use_features(f)"
                )
            tensors.append(t.movedim(leaf.dim, 0) if leaf.dim else t)
    out = []
    for t in tensors:
        t = t.detach()
        out.append(t.reshape(t.shape[0], -1).to(torch.promote_types(t.dtype, torch.float32)))
    return out


def pair_sq_distances(draw: Draw, leaves: list, kind: str, what: str) -> torch.Tensor:
    """``||f_i - f_index[i]||^2`` for every row ``i`` of the mix (float64, on the features' device),
    summed over every leaf (or over the given features)."""
    total = None
    for f in given_features(draw, leaves, kind, what):
        d = (f - f.index_select(0, to_device(draw.index, f.device))).square().sum(1, dtype=torch.float64)
        total = d if total is None else total + d
    return total
