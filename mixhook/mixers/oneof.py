"""One mixing regularizer of several per batch: timm's switch between mixup and CutMix, generalised."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine import traced
from ..engine.card import Card
from ..engine.contract import MixingHook, MixState, claim, unclaim
from ..engine.partners import crosses_ranks
from ..hooks import LayerHook, StateError, check_state


class OneOf(LayerHook, MixingHook):
    """Use one of several mixing regularizers per training batch, drawn with probabilities ``p``
    (timm's switch between mixup and CutMix: ``OneOf([ManifoldMixup("input", 0.8), CutMix("input")])``).

    The chosen regularizer then decides, as it would alone, whether (its ``prob``) and where to mix; the
    others are told to skip that forward. ``loss``, ``targets`` and ``state_for`` are those of the
    regularizer that mixed the forward which produced the logits they are given (each saw every forward);
    ``last`` is the chosen one's, ``chosen`` the regularizer drawn for the last training forward. It works
    through the mixers' public contract only (:class:`~mixhook.mixers.MixingHook`): each is attached as
    it would be alone, so a mixer of your own composes too.

    Args:
        mixers: two or more mixing regularizers (:class:`~mixhook.mixers.MixingHook`: ManifoldMixup,
            CutMix, PatchUp, NoisyFeatureMixup, a OneOf, yours), not attached elsewhere.
        p: their probabilities (non-negative, summing to 1); uniform by default.
        generator: the generator for the choice (as :class:`~mixhook.ManifoldMixup`).
    """

    card = Card(
        paper="timm's switch",
        mixes="one of its mixers per batch (mixup or CutMix)",
        where="its mixers'",
        family="composition",
        signature="OneOf([mixers], p)",
        hook="(drives its mixers)",
        commands="`mixup=mixup_cutmix`",
        details="One mixer per batch with probabilities `p`",
        example={
            "mixers": [
                {"method": "ManifoldMixup", "layer": "input", "alpha": 1.0},
                {"method": "CutMix", "layer": "input", "alpha": 1.0},
            ]
        },
        picture="a composition: it draws one of its mixers per batch",
    )

    _hooks_model = True  # its own hooks on the model (see LayerHook)
    _TRANSIENT = ("_host",)

    def _fresh(self) -> None:
        super()._fresh()
        self._host = traced.Host(self._host_begin)  # its choice in a compiled graph (mixhook.engine.traced)

    def __init__(
        self,
        mixers: Sequence[MixingHook],
        p: Sequence[float] | None = None,
        generator: torch.Generator | None = None,
    ):
        mixers = list(mixers)
        if len(mixers) < 2 or not all(isinstance(m, MixingHook) and isinstance(m, LayerHook) for m in mixers):
            raise TypeError(
                "OneOf needs two or more mixing regularizers (ManifoldMixup, CutMix, PatchUp, "
                f"NoisyFeatureMixup, ...), got {[type(m).__name__ for m in mixers]}"
            )
        if len({id(m) for m in mixers}) != len(mixers):
            raise ValueError("OneOf got the same regularizer twice")
        if crosses_ranks(*mixers):
            raise ValueError(
                "OneOf draws its choice on each rank, but a mixer with partners='global' must mix on every "
                "rank at once; use partners='local' inside OneOf"
            )
        layers = list(dict.fromkeys(name for m in mixers for name in m.specs))
        super().__init__(layers)
        p = [1.0 / len(mixers)] * len(mixers) if p is None else [float(v) for v in p]
        if (
            len(p) != len(mixers)
            or any(not (v >= 0) for v in p)
            or not math.isclose(sum(p), 1.0, abs_tol=1e-6)
        ):
            raise ValueError(f"p must be {len(mixers)} non-negative probabilities summing to 1, got {p}")
        self.mixers = mixers
        self.p = p
        self._draw_from(generator)
        self.chosen: MixingHook | None = None
        self._pinned_choice: int | None = None
        self._skip = False

    def __repr__(self) -> str:
        return f"OneOf({self.mixers!r}, p={self.p})"

    @property
    def last(self) -> MixState | None:
        """The chosen regularizer's :class:`~mixhook.MixState`, or ``None`` when nothing was mixed."""
        return self.chosen.last if self.chosen is not None else None

    def pin(self, choice: int | None = None, **values) -> None:
        """The next training forward uses ``mixers[choice]``, pinned with ``values`` (see its ``pin``).
        Without ``choice``, ``values["layer"]`` must name a layer of exactly one of the mixers."""
        if choice is None:
            owners = [i for i, m in enumerate(self.mixers) if values.get("layer") in (*m.layers, *m.specs)]
            if len(owners) != 1:
                why = f" (layer {values['layer']!r} is in {len(owners)} of them)" if "layer" in values else ""
                raise ValueError(f"OneOf.pin(): say which mixer with choice=0..{len(self.mixers) - 1}{why}")
            (choice,) = owners
        if isinstance(choice, bool) or not isinstance(choice, int) or not 0 <= choice < len(self.mixers):
            raise ValueError(f"pin(choice={choice!r}): choose 0..{len(self.mixers) - 1}")
        self.mixers[choice].pin(**values)
        self._pinned_choice, self._skip = choice, False

    def pin_last(self) -> None:
        """The next training forward repeats the last one: the same mixer, repeating its mix."""
        if self.chosen is None:
            self.skip_next()
            return
        self.chosen.pin_last()
        self._pinned_choice, self._skip = self.mixers.index(self.chosen), False

    def skip_next(self) -> None:
        """The next training forward mixes with none of the mixers (and draws no choice)."""
        self._skip, self._pinned_choice = True, None

    def unpin(self) -> None:
        """Forget what ``pin``, ``pin_last`` or ``skip_next`` set (here and in every mixer)."""
        self._skip, self._pinned_choice = False, None
        for mixer in self.mixers:
            mixer.unpin()

    def loss(self, criterion: Callable, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The ``loss`` of the regularizer that mixed the forward which produced ``logits``
        (``criterion(logits, target)`` when none did); see :meth:`state_for`."""
        mixer = self._mixer_for(logits, "loss")
        return mixer.loss(criterion, logits, target) if mixer else criterion(logits, target)

    def weigh(self, metric: Callable, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The ``weigh`` of the regularizer that mixed the forward which produced ``logits``
        (``metric(logits, target)`` when none did)."""
        mixer = self._mixer_for(logits, "weigh")
        return mixer.weigh(metric, logits, target) if mixer else metric(logits, target)

    def targets(
        self,
        target: torch.Tensor,
        num_classes: int | None = None,
        smoothing: float = 0.0,
        dtype: torch.dtype | None = None,
        logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The ``targets`` of the regularizer that mixed the forward which produced ``logits`` (without
        ``logits``: the latest forward), or the plain targets when none did."""
        mixer = self._mixer_for(logits, "targets") or self.mixers[0]
        return mixer.targets(target, num_classes, smoothing, dtype, logits)

    def state_for(self, logits: torch.Tensor | None = None) -> MixState | None:
        """The :class:`~mixhook.MixState` of the forward that produced ``logits``, whichever of the
        regularizers mixed it (``None``: none did); see :meth:`mixhook.Mixer.state_for`."""
        mixer = self._mixer_for(logits, "state_for")
        return mixer.state_for(logits) if mixer else None

    def _mixer_for(self, logits: torch.Tensor | None, what: str) -> MixingHook | None:
        """The regularizer whose mix the forward that produced ``logits`` carries, or ``None``: each saw
        that forward, and at most one of them mixed it."""
        mixed = [m for m in self.mixers if m.state_for(logits) is not None]
        if len(mixed) > 1:
            raise RuntimeError(f"{what}(): {len(mixed)} of OneOf's regularizers mixed the same forward")
        return mixed[0] if mixed else None

    def state_dict(self) -> dict:
        """The choice's generator and each regularizer's :meth:`~mixhook.Mixer.state_dict`."""
        return {**super().state_dict(), "mixers": [m.state_dict() for m in self.mixers]}

    def load_state_dict(self, state) -> None:
        check_state(self, state, ("generator", "mixers"))
        kinds = [type(m).__name__ for m in self.mixers]
        given = [m.get("type") if isinstance(m, dict) else None for m in state["mixers"]]
        if given != kinds:
            raise StateError(
                f"OneOf.load_state_dict(): the state is for mixers {given}, this OneOf has {kinds}"
            )
        for mixer, part in zip(self.mixers, state["mixers"], strict=True):
            mixer.load_state_dict(part)
        super().load_state_dict(state)

    def check_output(self, spec: str, value, batch: int | None = None, model_input=None) -> None:
        """Each regularizer that may mix ``spec`` must accept what it returned."""
        for mixer in self.mixers:
            if spec in mixer.layers:
                mixer.check_output(spec, value, batch, model_input)

    def owns(self, hook: MixingHook) -> bool:
        return hook is self or any(m.owns(hook) for m in self.mixers)

    def check_targets(self, target: torch.Tensor) -> None:
        for mixer in self.mixers:
            mixer.check_targets(target)

    def parameters(self):
        """Every regularizer's own trainable parameters (each AutoMix's Mix Block), each once (a policy
        every regularizer uses, SUMix's uncertainty layer, is one: an optimizer given it twice would step
        it twice)."""
        seen = set()
        for mixer in self.mixers:
            for p in mixer.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def parameter_options(self) -> dict:
        """Its regularizers' options for their parameters, where they agree (one group holds them all)."""
        found = [m.parameter_options() for m in self.mixers if any(True for _ in m.parameters())]
        if any(options != found[0] for options in found):
            raise ValueError(
                f"OneOf: its mixers want different optimizer options for their parameters ({found}); "
                "give them the same block_lr and block_momentum"
            )
        return found[0] if found else {}

    def use_targets(self, target: torch.Tensor) -> None:
        """Every regularizer gets the labels (whichever is chosen uses them)."""
        for mixer in self.mixers:
            mixer.use_targets(target)

    def use(self, *policies) -> OneOf:
        """Every regularizer mixes with these policies (:meth:`mixhook.Mixer.use`; each refuses in one line
        one it cannot take). Returns self."""
        for mixer in self.mixers:
            if not callable(getattr(mixer, "use", None)):
                raise TypeError(f"OneOf.use(): {type(mixer).__name__} takes no policies")
            mixer.use(*policies)
        return self

    @property
    def policies(self) -> tuple:
        """The policies of its first regularizer (:meth:`use` gives all the same)."""
        return getattr(self.mixers[0], "policies", ())

    def use_features(self, features: torch.Tensor) -> None:
        """Every regularizer gets the features (whichever is chosen uses them)."""
        for mixer in self.mixers:
            mixer.use_features(features)

    def use_partners(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """Every regularizer gets the partner batch (whichever is chosen uses it)."""
        for mixer in self.mixers:
            mixer.use_partners(inputs, targets)

    # ---------------------------------------------------------------------------------- the hooks

    def _check_attach(self, model: nn.Module) -> None:
        claim(model, self)  # the model's mixing regularizer: its mixers then attach as its parts
        busy = [type(m).__name__ for m in self.mixers if m.model is not None]
        if busy:
            unclaim(self)
            raise RuntimeError(f"OneOf: {busy} already attached on their own; remove them first")

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        # The choice is made before any mixer's own pre-hook runs: registered first, it runs first.
        handles.append(model.register_forward_pre_hook(recompute.hook(self._choose)))
        for mixer in self.mixers:
            handles.append(mixer.attach(model))  # a HookHandle: removed like the others

    def _reset(self) -> None:
        unclaim(self)

    def _choose(self, model: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling() and all(m.traced for m in self.mixers):
            traced.begin(self._host.token, model.training, -1)  # the choice, made when the graph runs
            return
        self._host_begin(model.training, None)

    def _host_begin(self, training: bool, batch: int | None) -> int:
        """The choice of a training forward (eager, or ``mixhook::begin`` in a compiled graph, before the
        mixers' own): the others are told to skip it. Returns the choice (-1: none)."""
        if recompute.in_backward() or not training:  # each mixer replays or skips on its own
            return -1
        skip, self._skip = self._skip, False
        choice, self._pinned_choice = self._pinned_choice, None
        if skip:
            self.chosen = None
            for mixer in self.mixers:
                mixer.skip_next()
            return -1
        if choice is None:
            self._seed_for_rank()
            probs = torch.tensor(self.p, dtype=torch.float64, device=self.generator.device)
            choice = int(torch.multinomial(probs, 1, generator=self.generator))
        self.chosen = self.mixers[choice]
        for mixer in self.mixers:
            if mixer is not self.chosen:
                mixer.skip_next()
        return choice
