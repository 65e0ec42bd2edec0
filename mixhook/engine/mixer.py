"""The base a mixing method subclasses: :class:`Mixer`, what a method implements and what a user calls.

A method subclasses :class:`Mixer` and implements :meth:`Mixer.mix` (and, where it needs to,
:meth:`Mixer.sample_lam`, :meth:`Mixer.draw_index` and :meth:`Mixer.check_leaves`; see
docs/adding-a-mixer.md); a user attaches it and calls ``pin``, ``loss``, ``targets`` and the rest of its
API, the same for every method. How one training forward travels through the mixer's hooks is
:mod:`.path` (the model's pre-hook decides, the mixed layer's hook draws, mixes and records, the model's
output hook marks the output); beside it, each in its own module: one forward as one object
(:mod:`.forward`), what a method is given and returns (:mod:`.contract`), the leaves of a site as the
method is given them (:mod:`.leaves`), which forward produced given logits (:mod:`.binding`),
``loss``/``targets`` (:mod:`.targets`), padding masks downstream of a mix (:mod:`.padding_masks`), the
gradient pass of the saliency methods (:mod:`.gradient_pass`), the one-graph path under ``torch.compile``
(:mod:`.traced`), the checks the methods share (:mod:`.checks`) and the math (:mod:`mixhook.functional`).
:class:`~mixhook.mixers.oneof.OneOf` keeps the same contract by delegating to the mixers it chooses among.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn

from .. import padding as masks
from ..functional import sample_lam
from ..hooks import LayerHook, Planned
from ..layouts import check_layout
from ..sites import Leaf
from ..transfer import to_device
from .binding import Forwards
from .checks import check_fraction, check_layer_weights, check_positive
from .contract import Draw, Mixed, MixingHook, MixState, claim, mixing_of, unclaim
from .forward import NO_PINS, SKIP, Forward, Pins, given_index
from .leaves import SiteLeaves
from .path import SKIPPABLE, Path
from .policies import Policies, Policy
from .targets import LossAndTargets
from .tokens import TokenGrid

_TRACED = ("traced_params", "draw_traced", "mix_traced")  # what a method defines beside mix() to be traced


class Mixer(LayerHook, LossAndTargets, MixingHook):
    """Base class of the single-method mixers: mixes the output of one of ``layer`` per training batch.

    The shared mechanism: at the start of each training forward (a forward pre-hook on the model)
    decide, with probability ``prob``, to mix, and at which layer (uniformly); when that layer runs (a
    forward hook; for ``"input"`` the model's pre-hook) draw ``lam`` (:meth:`sample_lam`) and a
    permutation ``index``, and replace the tensors it returns that carry the batch (all of them, or the
    selected ones, each along its own batch dimension, see :mod:`mixhook.sites`) by what :meth:`mix`
    returns; after the forward (a forward hook on the model) check that the layer did run. A
    recomputation by activation checkpointing replays the same mix (:mod:`mixhook.recompute`).
    ``pin``, ``pin_last``, ``skip_next``, ``last``, ``loss`` and ``targets`` work the same for every
    method.

    A method implements:

    - :meth:`mix` (required): the mixed tensors, and what ``loss``/``targets`` use if not the drawn lam;
    - :meth:`sample_lam` (optional): the draw of lam; by default one ``Beta(alpha, alpha)`` per batch;
    - :meth:`check_leaves` (optional): refuse, in one line, what it cannot mix (CutMix: anything but one
      ``(B, C, H, W)`` map);
    - ``pin_keys`` (optional): the names of its own values that ``pin`` accepts (CutMix: ``("box",)``),
      which :meth:`mix` finds in ``draw.pinned``.

    A model has at most one mixing regularizer attached at a time (two would each mix every batch):
    combine several with :class:`~mixhook.OneOf`.
    """

    pin_keys: ClassVar[tuple[str, ...]] = ()
    # Whether mix() draws anything of its own from draw.generator (a box, a mask, noise): then a repeat
    # (pin_last, an activation-checkpoint recomputation) replays the generator from its state before the
    # mix. False for a method whose only draws are lam and the index (sample_lam, draw_index): those are
    # then drawn before mix() and repeated as pinned values (no generator state taken per mix). A method
    # that draws in mix() must leave it True: a repeat would otherwise draw anew.
    draws_in_mix: ClassVar[bool] = True
    # Whether draw_index() returns a permutation of the batch (every sample a partner once): the blends
    # then take their backward as a gather through its inverse. A method drawing partners with
    # repetition must set it False (a gather would give a repeated partner one gradient, not their sum).
    index_is_permutation: ClassVar[bool] = True
    # Whether mix() depends on which axes of a 4-D map are its channels and which its height and width
    # (every region method): then a (B, H, W, C) map is given as its (B, C, H, W) view and a map whose
    # layout cannot be told is refused (mixhook.layouts). False for a method that treats every element
    # alike (ManifoldMixup, NoisyFeatureMixup).
    layout_aware: ClassVar[bool] = True
    # The numbers of position dimensions of the maps a layout-aware method cuts: (2,) for (B, C, H, W) maps
    # only; (1, 2, 3) where it also cuts (B, C, L) and (B, C, D, H, W) maps (CutMix, FMix, GridMix,
    # SmoothMix, PatchUp). A map of another kind is refused by the method's check_leaves.
    region_dims: ClassVar[tuple[int, ...]] = (2,)
    # None: dense targets (segmentation maps) are mixed like the map (a region method sets Mixed.weights);
    # else why not, refused in one line by loss() and targets()
    dense_targets: ClassVar[str | None] = None
    # Whether check_leaves depends on nothing but the leaves' signature (shapes, dtype, device, layout) and
    # settings fixed while attached (mixhook.hooks.Planned): then it runs when a site's value is read and
    # planned, and not again for each forward whose value has the plan's signature. False (default): it
    # runs before every mix.
    checks_by_signature: ClassVar[bool] = False
    # Whether the method's loss needs the clean batch beside its mix (RegMixup, RankMixup, MixupE): then
    # `clean` is True from the start and cannot be turned off.
    keeps_clean: ClassVar[bool] = False
    # With the clean rows beside the mixed ones (`clean`): whether batch norm normalises the two halves
    # apart, each by its own statistics, its running statistics updated by the clean half then the mixed
    # (mixhook.engine.norms: what two forwards compute, for a method whose authors run two: AutoMix, SAMix);
    # False: one batch of 2B, as one forward of the concatenated batch (RegMixup's authors').
    batch_norm_apart: ClassVar[bool] = False
    # Whether the method's loss is the mixed criterion (mixed_loss), which target, weights and loss
    # policies (Remix, LocalWeights, DecoupledLoss) change; False for a method with a loss of its own.
    takes_loss_policies: ClassVar[bool] = True
    # The most samples one mixed row may mix (2: a sample and its partner; more for a method that states a
    # Mixed.mixture, AdAutoMix): a target, weights or loss policy (two labels per row) refuses one over 2
    # when it is used, before training.
    samples_per_row: int = 2
    # The values before_forward/before_mix compute anew at every training forward, a repeat's included (they
    # do not reuse a pinned one): the record pin_last repeats leaves them out (AutoMix: its momentum copy's
    # features and its Mix Block's forward, a (B, C, h, w) map), so no mixer keeps between steps what a repeat
    # would not read. A value named here that a repeat does reuse would be computed anew: name only those.
    computed_each_forward: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        layer: str | Sequence[str],
        alpha: float,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, batch_dim)
        self.layout = check_layout(layout, self.specs)
        self.alpha = check_positive("alpha", alpha)
        self.prob = check_fraction("prob", prob)
        self._draw_from(generator)
        if padding not in masks.PADDING:
            raise ValueError(f"padding must be one of {', '.join(masks.PADDING)}, got {padding!r}")
        self.padding = padding
        self.token_grid: TokenGrid | None = None  # set by the region mixers given tokens=(gh, gw)
        self._layer_weights: tuple[float, ...] | None = None
        self._site_weights: tuple[float, ...] | None = None  # the same, per site resolved (_bind)
        self._clean = type(self).keeps_clean
        self._policies: Policies | None = None  # use(): the partners, lam and target policies
        self._clean_before_policies = self._clean  # (what `clean` was before a policy that reads it)
        # Under torch.distributed, whether each backward averages the gradients of the method's own
        # parameters and its policies' (AutoMix's Mix Block, SUMix's uncertainty layer) over the ranks, as
        # DDP averages the model's; False: they are left to you (one process replaying the ranks' batches).
        self.average_over_ranks = True

    _hooks_model = True  # its own hooks on the model (see LayerHook)
    _TRANSIENT = ("_path",)  # all of an attachment's state: a copy starts detached, with a path of its own

    def _fresh(self) -> None:
        super()._fresh()
        # the path of its training forwards through its hooks, and the state of its attachment (Path);
        # handed what it needs of this mixer's machinery as a hook on some layers
        self._path = Path(self, self._note, self._replayed, self._seed_for_rank, self._site, self._per_layer)

    def __getstate__(self) -> dict:
        """As every hook's: a copy is detached, with a path of its own, which keeps what this one's holds
        beyond its attachment (:meth:`~.path.Path.kept`: the next forward's pins, the last forward's
        record)."""
        state = super().__getstate__()
        state["_kept"] = self._path.kept()
        return state

    def __setstate__(self, state: dict) -> None:
        kept = state.pop("_kept", None)
        super().__setstate__(state)
        if kept is not None:
            self._path.keep(kept)

    def _check_attach(self, model: nn.Module) -> None:
        claim(model, self)

    def _register(self, model: nn.Module, modules: dict[str, nn.Module], handles: list) -> None:
        self._path.register(model, modules, handles, self._dims, self._policies)
        if self._policies is not None:  # (a policy's own hooks: SUMix's on the classifier)
            self._policies.register(self, model, handles)

    def parameters(self):
        """The trainable parameters of the mixer's policies (SUMix's uncertainty layer), for the optimizer
        that steps the model; a method with parameters of its own (AutoMix) yields those."""
        return iter(()) if self._policies is None else self._policies.parameters()

    def state_dict(self) -> dict:
        """As every hook's (:meth:`~mixhook.hooks.LayerHook.state_dict`), with its policies' state
        (``"policies"``) where one keeps any (SUMix's uncertainty layer)."""
        state = super().state_dict()
        kept = {} if self._policies is None else self._policies.state_dict()
        if kept:
            state["policies"] = kept
        return state

    def load_state_dict(self, state: Mapping) -> None:
        kept = state.get("policies") if isinstance(state, Mapping) else None  # (not a dict: refused below)
        if kept is not None:  # (checked before anything is loaded: a refused state changes nothing)
            if self._policies is None:
                raise ValueError(
                    f"load_state_dict(): the state holds policies' ({', '.join(kept)}), and "
                    f"{type(self).__name__} uses none; use() the policies it was saved with"
                )
            self._policies.check_state(kept)
        super().load_state_dict(state)
        if kept is not None:
            self._policies.load_state_dict(kept)

    def _reset(self) -> None:
        self._path.reset()
        if self._policies is not None:
            self._policies.reset()
        unclaim(self)

    # The settings what is worked out at attach depends on (the sites' layouts, the padding-mask hooks):
    # set before attach(), refused in one line while attached (mixhook.hooks.Planned).
    layout = Planned()
    padding = Planned()
    token_grid = Planned()

    # Which of the extension points a forward skips where a method keeps their default (path.SKIPPABLE)
    # the class overrides: set for each subclass as it is defined.
    overridden: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.overridden = frozenset(
            name for name in SKIPPABLE if getattr(cls, name) is not getattr(Mixer, name)
        )

    @property
    def traceable(self) -> bool:
        """Whether torch.compile traces this mixer's hooks into the model's graph with no graph break
        (``fullgraph=True``; :mod:`mixhook.engine.traced`): one class defines the traced path, and its
        :meth:`mix` too or none of its classes does (the default :meth:`mix` is the traced path's; a
        subclass that changes ``mix`` without it, e.g. to add noise, is not traced until it defines its
        own: the inherited one would leave its change out), and it takes no per-forward pass (gradient
        saliency); a model whose modules take padding masks (``padding="union"``) is not traced either.
        Otherwise the hooks run between graphs: each as one eager call torch.compile leaves out of its
        graphs (:mod:`.path`)."""
        cls = type(self)
        traced_by = {next(k for k in cls.__mro__ if name in vars(k)) for name in _TRACED}
        mixed_by = next(k for k in cls.__mro__ if "mix" in vars(k))
        return (
            len(traced_by) == 1
            and traced_by != {Mixer}
            and mixed_by in (Mixer, *traced_by)
            and cls.before_forward is Mixer.before_forward
            and cls.before_mix is Mixer.before_mix
            and not self._clean
            and self._policies is None
        )

    @property
    def traced(self) -> bool:
        """Whether, attached, torch.compile traces this mixer's hooks into the model's graph
        (:attr:`traceable`, and its model takes no padding masks); ``False`` when not attached."""
        return self._path.traced

    @property
    def clean(self) -> bool:
        """Whether the mixed layer emits the clean batch followed by its mixed copy (``False`` by default:
        the layer's output is replaced by the mix). With ``True``, downstream of the mixed layer the batch
        is doubled: the logits' rows ``[0, B)`` are the clean samples and ``[B, 2B)`` their mixes, and
        ``loss``/``targets`` take the ``B`` labels and know which rows are which (:attr:`MixState.clean`).
        ``loss`` is then the mean over the doubled batch: the criterion on the clean rows beside the
        mixed criterion on the mixed rows (RegMixup's loss; :class:`~mixhook.RegMixup` weighs the mixed
        rows by its ``eta``). Set it before attaching. The batch must have at least 2 samples, the logits
        must carry the ``2B`` rows first, and a model whose modules downstream of the mix take padding
        masks is refused (its masks describe ``B`` rows). A forward that does not mix keeps ``B`` rows."""
        return self._clean

    @clean.setter
    def clean(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"clean must be True or False, got {value!r}")
        if type(self).keeps_clean and not value:
            raise ValueError(
                f"{type(self).__name__} trains on the clean batch beside its mix: clean cannot be False"
            )
        if self._model is not None and value != self._clean:
            raise RuntimeError(
                f"{type(self).__name__}.clean changes how the model is traced: set it before attach()"
            )
        self._clean = value

    @property
    def layer_weights(self) -> tuple[float, ...] | None:
        """Draw weights of :attr:`specs` (one >= 0 each, not all 0), by which spec ``k`` is mixed with
        probability ``w[k] / sum(w)``, and of the layers a pattern names, each alike (``["input",
        "blocks[2:6]"]`` with ``[1, 1]``: the input half the time, each of the four blocks an eighth).
        ``None`` (default): uniform over the layers, as each paper draws."""
        return self._layer_weights

    @layer_weights.setter
    def layer_weights(self, weights) -> None:
        self._layer_weights = None if weights is None else check_layer_weights(self.specs, weights)
        self._site_weights = self._weights_of_sites()

    @property
    def site_weights(self) -> tuple[float, ...] | None:
        """:attr:`layer_weights` per site the specs resolved to (each spec's weight shared equally by its
        sites), what a forward draws its layer by; ``None``: uniform."""
        return self._site_weights

    def _weights_of_sites(self) -> tuple[float, ...] | None:
        """:attr:`layer_weights` spread over the sites the specs resolved to (each spec's weight shared
        equally by its sites); the same weights before it is attached."""
        weights = self._layer_weights
        if weights is None or not self._written:
            return weights
        share = {spec: weights[i] for i, spec in enumerate(self.specs)}
        count = {spec: list(self._written.values()).count(spec) for spec in self.specs}
        return tuple(share[self._written[n]] / count[self._written[n]] for n in self.layers)

    def _bind(self, resolved) -> None:
        super()._bind(resolved)
        if "_layer_weights" in self.__dict__:
            self._site_weights = self._weights_of_sites()

    def _site(self, layer: str, what: str) -> str:
        """The site a user's ``layer`` names: one of :attr:`layers`, or a spec that resolved to one site."""
        if layer in self.layers:
            return layer
        named = [n for n, spec in self._written.items() if spec == layer]
        if len(named) == 1:
            return named[0]
        why = f" (it names {len(named)} layers: name one)" if named else ""
        raise ValueError(
            f"{what}(layer={layer!r}): not one of this regularizer's layers {list(self.layers)}{why}"
        )

    def __repr__(self) -> str:
        tokens = (
            ""
            if self.token_grid is None
            else f", tokens={self.token_grid}, prefix={self.token_grid.prefix!r}"
        )
        layout = "" if self.layout is None else f", layout={self.layout!r}"
        clean = ", clean=True" if self._clean and not type(self).keeps_clean else ""
        policies = "" if self._policies is None else f", policies={self._policies!r}"
        return (
            f"{type(self).__name__}(layer={self._layer_spec!r}, alpha={self.alpha}, prob={self.prob}{tokens}"
            f"{layout}{clean}{policies})"
        )

    # ----------------------------------------------------------------------------------- user API

    def pin(
        self,
        layer: str | None = None,
        lam: float | torch.Tensor | None = None,
        index: Sequence[int] | torch.Tensor | None = None,
        **values,
    ) -> None:
        """Make the next training forward mix with exactly these values (and mix, whatever ``prob``).

        What is left out is drawn as usual. Sampling resumes after that forward. ``index`` is any 1-D
        integer index of the batch's length (a permutation, or e.g. a reversal to reproduce timm's
        ``flip`` pairing); its length is checked against the batch when it is used. ``lam`` is a number
        in [0, 1] (or, in ``mode="elem"``, one per sample). Subclasses take more values (CutMix ``box``,
        PatchUp ``mask``).
        """
        unknown = sorted(set(values) - set(self.pin_keys))
        if unknown:
            valid = ", ".join(("layer", "lam", "index", *self.pin_keys))
            raise TypeError(f"{type(self).__name__}.pin() got unknown values {unknown}; valid: {valid}")
        if layer is not None and (self._model is not None or layer not in self.specs):
            layer = self._site(layer, "pin")  # (before attach, a spec: its site is found at the forward)
        if lam is not None:
            lam = torch.as_tensor(lam, dtype=torch.float64).detach().cpu()
            if lam.ndim > 1 or not bool(((lam >= 0) & (lam <= 1)).all()):
                raise ValueError(f"pin(lam={lam.tolist()}): lam must be a number (or 1-D values) in [0, 1]")
        given = {} if index is None else given_index(index, "pin")
        self._path.pin(Pins(layer, lam, values={k: v for k, v in values.items() if v is not None}, **given))

    @property
    def pins(self) -> Pins | None:
        """What :meth:`pin`, :meth:`pin_last` or :meth:`skip_next` set for the next training forward
        (:class:`~mixhook.engine.forward.Pins`), or ``None``. Set, it pins a whole record: another mixer's
        forward repeated here (``other.last_forward.repeat()``), or ``None`` (:meth:`unpin`)."""
        return self._path.pins

    @pins.setter
    def pins(self, pins: Pins | None) -> None:
        if pins is not None and not isinstance(pins, Pins):
            kind = type(pins).__name__
            raise TypeError(f"{type(self).__name__}.pins takes a Pins record or None, got {kind}")
        self._path.pin(pins)

    @property
    def last(self) -> MixState | None:
        """What the last training forward mixed (its :class:`~mixhook.engine.contract.MixState`, kept
        without the loss's graph pieces), or ``None`` where it did not mix. A method that re-weighs its
        record after its mix (TransMix's labels from the attention) sets it, before the model's output is
        marked with it."""
        return self._path.last

    @last.setter
    def last(self, state: MixState) -> None:
        self._path.relabel(state)

    @property
    def last_forward(self) -> Forward | None:
        """The last training forward that mixed (a :class:`~mixhook.engine.forward.Forward`), what
        :meth:`pin_last` repeats; ``None`` before one, or once a later forward began."""
        return self._path.last_forward

    @property
    def in_gradient_pass(self) -> bool:
        """Whether :meth:`gradient_at`'s own pass is under way, which neither mixes nor records (a hook of
        the method's own skips it)."""
        return self._path.gradients.running

    def layout_at(self, spec: str, ndim: int = 4) -> str:
        """The layout of an ``ndim``-D map at ``spec`` (``"NCHW"`` or ``"NHWC"`` for 4-D; see
        :mod:`mixhook.layouts`), as the site's is read for a region method: a method that mixes such a
        map outside :meth:`mix` (AutoMix's Mix Block on its momentum copy) reads it here. One line where it
        cannot be told."""
        return self._attached("layout_at").layouts[spec, ndim].of(type(self).__name__, spec)

    @property
    def current(self) -> Forward | None:
        """The training forward under way (a :class:`~mixhook.engine.forward.Forward`, with its layer, pins
        and, once its layer ran, what it mixed), or ``None`` outside one or in a forward that does not mix."""
        return self._path.current

    @property
    def pinned(self) -> bool:
        """Whether :meth:`pin`, :meth:`pin_last` or :meth:`skip_next` set something the next training
        forward has not used yet."""
        return self._path.pins is not None

    def unpin(self) -> None:
        """Forget what :meth:`pin`, :meth:`pin_last` or :meth:`skip_next` set for the next training
        forward, which then decides as any other (``prob``, fresh draws)."""
        self._path.pin(None)

    def draw_for(
        self,
        layer: str,
        batch: int,
        generator: torch.Generator | None = None,
        index: Sequence[int] | torch.Tensor | None = None,
        leaves: list[Leaf] | None = None,
    ) -> tuple[Draw, Mixed]:
        """What this mixer draws for a mix of ``batch`` samples at ``layer``, without mixing: the
        :class:`~mixhook.engine.contract.Draw` (lam, the partner index) and the method's own draws as its
        :class:`~mixhook.engine.contract.Mixed` records them (CutMix's ``info["box"]``), every draw from
        ``generator`` (the mixer's own by default). For an adapter that must know a mix before the forward
        (timm's ``mixup_fn`` returns the soft targets first), which then pins what it drew (:meth:`pin`).

        ``index``: the partners to use (e.g. timm's flipped batch) instead of drawn ones; ``leaves``: what
        a region method cuts (:meth:`leaves_at`; their tensors may be :class:`~mixhook.engine.traced.Shape`
        objects). The methods with a one-graph path under ``torch.compile`` can draw ahead (ManifoldMixup,
        CutMix, FMix, GridMix, PatchUp, ...); the others are refused in one line."""
        if self._policies is not None:
            raise TypeError(
                f"{type(self).__name__}.draw_for(): a mixer with policies ({self._policies!r}) draws from "
                "the forward's values, so it cannot be drawn before the forward"
            )
        if type(self).draw_traced is Mixer.draw_traced:
            raise TypeError(
                f"{type(self).__name__}.draw_for(): this method draws its mix from the layer's values, so it "
                "cannot be drawn before the forward"
            )
        layer = self._site(layer, "draw_for")
        pins = NO_PINS if index is None else Pins(**given_index(index, "draw_for"))
        return self._path.drawing(
            layer, batch, pins, generator or self.generator, self.draw_traced, leaves or []
        )

    def leaves_at(self, layer: str, output) -> list[Leaf]:
        """The leaves the method acts on in ``output``, what ``layer`` returned (for ``"input"``, the
        model's :class:`~mixhook.sites.Inputs`), each with its batch dimension: what :meth:`draw_for` takes
        for a region method. Refused in one line as a forward would refuse them."""
        reading = self._attached("leaves_at")
        return reading.leaves(layer, reading.value(layer, output), None, plan=False)[1]

    @property
    def forwards(self) -> Forwards:
        """The record of this mixer's recent training forwards and what each mixed
        (:class:`~mixhook.engine.binding.Forwards`): an adapter checks at a step's end that every mixed
        forward's loss was taken under its mix (``claim_all()`` at the step's start, ``unclaimed()`` at
        its end)."""
        return self._path.seen

    def pin_last(self) -> None:
        """Make the next training forward repeat the last training forward's mix exactly: the same
        layer and every draw (lam, index, and the method's own: box, mask, noise), or no mix if the last
        forward did not mix. The mixer's generator is not advanced by the repeat."""
        if self.last is None or self.last_forward is None:
            self.skip_next()
            return
        self._path.pin(self.last_forward.repeat())

    def skip_next(self) -> None:
        """Make the next training forward not mix, whatever ``prob`` (nothing is drawn for it)."""
        self._path.pin(SKIP)

    def use_targets(self, target: torch.Tensor) -> None:
        self._path.use_targets(target)

    def use(self, *policies: Policy) -> Mixer:
        """Mix with these policies (:mod:`mixhook.policies`), replacing any used before: who is paired
        (``PartnerBatch``, ``BalancedMixup``, ``SaliencyPairing``), how much (``KernelWarping``), what the
        target is (``Remix``) and the loss (``LocalWeights``, ``DecoupledLoss``); at most one per knob
        (:data:`mixhook.engine.policies.KNOBS`). ``use()`` with none removes them. Set them before
        attaching. A mixer with policies runs its hooks between graphs under ``torch.compile`` (not traced)
        and takes the engine's general path. Returns the mixer, so ``ManifoldMixup("layer2").use(Remix())``
        builds one in a line. A policy refuses, in one line, a mixer it cannot act through. A loss
        policy that reads the clean rows (SUMix) turns ``clean`` on while it is used, and back to what it
        was when it no longer is."""
        if self._model is not None:
            raise RuntimeError(f"{type(self).__name__}.use(): set the policies before attach()")
        chosen = Policies(type(self).__name__, policies) if policies else None
        for policy in () if chosen is None else chosen.all:
            policy.check_mixer(self)
        takes = chosen is not None and any(p.takes_clean for p in chosen.all)
        had = self._policies is not None and any(p.takes_clean for p in self._policies.all)
        if takes and not had:
            self._clean_before_policies, self.clean = self._clean, True
        elif had and not takes:
            self.clean = self._clean_before_policies
        self._policies = chosen
        return self

    @property
    def policies(self) -> tuple[Policy, ...]:
        """The policies this mixer uses (:meth:`use`), in the order a forward meets them."""
        return () if self._policies is None else self._policies.all

    def use_features(self, features: torch.Tensor) -> None:
        """The features of the next training forward's rows, for a policy that takes distances between
        partners (``KernelWarping``, ``LocalWeights``) from them instead of from the mixed layer (the
        authors of SK-Mixup embed the batch with the model's feature extractor first): one row per
        sample, ``(B, ...)`` (with a partner batch: ``(B + P, ...)``, the batch's rows then the partners').
        Used for one forward only; call it before each."""
        if not isinstance(features, torch.Tensor):
            raise TypeError(
                f"use_features() takes a tensor of one row per sample, got {type(features).__name__}"
            )
        self._path.give("features", features)

    def use_partners(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> None:
        """The partner batch of the next training forward, for a ``PartnerBatch`` policy (Balanced-MixUp's
        class-balanced batch): ``inputs`` as the model's first argument takes them (with
        ``PartnerBatch(at="layer")``: rows as the mixed layer returns them, a memory bank's), ``targets``
        their labels (what ``loss``/``targets`` mix with). Used for one forward only: call it before each
        training forward, as the app's loop does; an eval forward drops it."""
        partners = self._policies.get("partners") if self._policies is not None else None
        if partners is None or not partners.needs_partner_batch:
            raise RuntimeError(
                f"{type(self).__name__}.use_partners(): this mixer draws its partners from the batch; give "
                "it a PartnerBatch policy first (mixer.use(PartnerBatch()) or BalancedMixup())"
            )
        if not isinstance(inputs, torch.Tensor) or (
            targets is not None and not isinstance(targets, torch.Tensor)
        ):
            raise TypeError("use_partners(inputs, targets) takes tensors: the partner batch and its labels")
        self._path.give("partner_inputs", inputs)
        if targets is not None:
            self._path.give("partner_targets", targets)

    def check_targets(self, target: torch.Tensor) -> None:
        """Refuse, in one line, labels this mixer or one of its policies cannot train with."""
        if self._policies is not None:
            self._policies.check_targets(target)

    # ------------------------------------------------------------ which forward produced these logits

    def state_for(self, logits: torch.Tensor | None = None) -> MixState | None:
        """The :class:`MixState` of the forward that produced ``logits``, or ``None`` when that forward
        mixed nothing (an eval forward, a forward that did not draw a mix, a skipped one). ``loss`` and
        ``targets`` use it, so an eval forward's logits get the plain criterion and each of several
        forwards (two views, micro-batches, a teacher on the same backbone) gets its own mix.

        The forward is found from the logits themselves: every output of a forward this mixer saw is
        marked (its autograd node, or the tensor when it has none), and ``logits`` may be that output
        or anything computed from it with gradients (``.float()``, a slice, a head on a hooked backbone).
        Refused in one line (:class:`ForeignLogitsError`): logits computed with gradients from no forward
        of this mixer (another model, a copy of the hooked model: copies have no hooks), logits combining
        several forwards that mixed, and logits without gradients that cannot be traced while a forward
        that mixed has not been claimed. Without ``logits``: the latest forward's, refused while an
        earlier forward that mixed is unclaimed (say which with ``logits``)."""
        return self._path.seen.state_for(logits, "state_for", type(self).__name__, self._model is not None)

    def check_output(self, spec: str, value, batch: int | None = None, model_input=None) -> None:
        """Raise ``TypeError``/``ValueError`` (one line) unless what layer ``spec`` returned (for
        ``"input"``: the model's :class:`~mixhook.sites.Inputs`) can be mixed by this class, for a model
        input of ``batch`` samples; ``model_input`` (the model's first argument), where given, is what
        the sides of a map read by convention are checked against (:mod:`mixhook.layouts`).

        The app calls it on a sample batch before training; the hooks check every mix the same way.
        Needs the regularizer to be attached (the batch dimensions depend on the model)."""
        reading = self._attached("check_output")
        saved = reading.input_sides
        if model_input is not None:
            reading.input_sides = reading.input_grid((model_input,), {})
        try:
            reading.leaves(spec, reading.value(spec, value), batch, plan=False)
        finally:
            reading.input_sides = saved

    def channels_first(self, spec: str, t: torch.Tensor) -> torch.Tensor:
        """``t``, a map as this method is given it at ``spec`` (a value there, or its gradient from
        :meth:`gradient_at`), as its channels-first view ``(B, C, ...)``: what reduces a map over its
        channels (a pairing's saliency) reads it so on any layout. A layout-aware method is given that view
        already; for another (ManifoldMixup) the site's layout is read as a region method's would be
        (:mod:`mixhook.layouts`), once per attach; one line where it cannot be told. ``(B, D)``: as it is."""
        return self._attached("channels_first").channels_first(spec, t)

    def _attached(self, what: str) -> SiteLeaves:
        """The leaves of this mixer's sites (:mod:`.leaves`), or a one-line error where it is not attached."""
        reading = self._path.site_leaves
        if reading is None:
            raise RuntimeError(f"{type(self).__name__}.{what}() needs the regularizer attached")
        return reading

    # ------------------------------------------------------------------------- what a method implements

    def agree(self, forward: Forward | None) -> Forward | None:
        """The decision a training forward follows, where its partners come from every rank
        (:meth:`partner_pool`): its own by default; a method whose ranks must agree on whether and where to
        mix overrides this (``ManifoldMixup(partners="global")``: rank 0's)."""
        return forward

    def partner_pool(self, n: int) -> int:
        """How many samples a batch of ``n`` draws its partners from: ``n`` (partners from the global
        batch of a data-parallel job: ``world * n``); a pinned index is checked against it."""
        return n

    def draw_index(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """Each sample's partner for a batch of ``n``: a uniformly random permutation (override for a
        fixed pairing, e.g. ``ManifoldMixup(mode="pair")``'s ``i <-> n - 1 - i``)."""
        return torch.randperm(n, generator=generator, device=generator.device)

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """The draw of lam for a batch of ``n``: a float64 0-d tensor (one lam for the batch) or ``n``
        values (one per sample), drawn from ``generator`` only. By default ``Beta(alpha, alpha)``."""
        return sample_lam(self.alpha, generator)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        """Refuse, with a one-line ``TypeError``/``ValueError``, what this method cannot mix: ``leaves``
        are the tensors carrying the batch at ``spec`` (each with its ``path``, ``name`` and batch
        ``dim``). Runs before every mix and in :meth:`check_output`. Accepts anything by default."""

    def traced_params(self, n: int, leaves: list[Leaf]) -> list:
        """The one-graph path under torch.compile (:mod:`.traced`; optional, with :meth:`draw_traced` and
        :meth:`mix_traced`, in the class that defines :meth:`mix`): the ``(shape, dtype)`` of each value
        :meth:`draw_traced` returns for a mix of ``n`` samples of ``leaves``; on the host their tensors are
        :class:`~.traced.Shape` objects (shape, ``ndim``, dtype), whose sizes are symbolic while a graph
        with dynamic shapes is traced."""
        raise NotImplementedError

    def draw_traced(self, leaves: list[Leaf], draw: Draw) -> tuple[list[torch.Tensor], Mixed]:
        """On the host, when the graph runs: the values the traced mix needs (CPU tensors, as
        :meth:`traced_params` describes them, or for noise of a map's size a function that fills its place
        on the device in place: :class:`~mixhook.functional.DeviceNoise`'s ``uniform_``/``normal_``) and
        the :class:`Mixed` (no tensors) that records the mix, drawn from ``draw`` exactly as :meth:`mix`
        would."""
        raise NotImplementedError

    def mix_traced(self, leaves: list[Leaf], values: list[torch.Tensor]) -> dict:
        """Traced: the mixed tensor of every leaf, by path, from the values :meth:`draw_traced` drew (on
        the leaves' device): the same ops as :meth:`mix`, with no host read and shapes that do not depend
        on the values."""
        raise NotImplementedError

    def gradient_at(self, model: nn.Module, args: tuple, kwargs: dict, spec: str, target) -> torch.Tensor:
        """The gradient of the summed cross-entropy of ``model(*args, **kwargs)`` against ``target``
        with respect to what :meth:`mix` would be given at ``spec`` (the first leaf: a ``(B, C, H, W)``
        map, or the patch tokens' map): one more forward, in eval mode (no dropout, no batch-norm
        statistics updated; each module's own mode restored after), and a backward down to ``spec``
        only (``autograd.grad``, so no parameter's ``.grad`` changes). Other hooks active in training
        mode only do not act in it. For the methods that place their regions by gradient saliency
        (:mod:`.gradient_pass`), from :meth:`before_forward`."""
        self._check_lockstep(model, "a gradient pass")
        return self._path.gradients.gradient_at(model, args, kwargs, spec, target)

    def unmixed_forward(self, model: nn.Module, args: tuple, kwargs: dict):
        """``model(*args, **kwargs)`` once more, without gradients and without any mix, for a method that
        reads what the network computes on the unmixed batch (SnapMix's class activation maps), from
        :meth:`before_forward`: in eval mode (no training hook acts, dropout off) but with batch norm on
        the batch's statistics, its running statistics untouched (:mod:`.gradient_pass`)."""
        self._check_lockstep(model, "an unmixed forward")
        return self._path.gradients.plain_forward(model, args, kwargs)

    def _check_lockstep(self, model: nn.Module, what: str) -> None:
        """Refuse, in one line, one more forward that some ranks of an FSDP job would run and others not
        (each rank draws whether it mixes): FSDP's all-gathers would wait for each other forever."""
        if self._path.sharded and (self.prob < 1 or mixing_of(model) is not self):
            why = f"prob={self.prob} < 1" if self.prob < 1 else "a OneOf's choice"
            raise RuntimeError(
                f"{type(self).__name__} runs {what} of the model before each forward it mixes, and the "
                f"model is sharded by FSDP: with {why} each rank decides alone whether to mix, so ranks "
                "would run different numbers of forwards and FSDP's all-gathers would wait for each other "
                "forever; use prob=1 (and no OneOf around it), or DDP"
            )

    def before_forward(
        self,
        model: nn.Module,
        args: tuple,
        kwargs: dict,
        spec: str,
        pinned: Mapping,
        targets,
        generator: torch.Generator,
    ) -> Mapping:
        """Called at the start of a training forward that will mix at ``spec``, with the model's
        arguments, the values pinned so far, the labels given by :meth:`use_targets` (or ``None``) and the
        generator every draw it makes comes from (the mixer's); what it returns joins the pinned values
        :meth:`mix` finds in ``draw.pinned`` (and that a recomputation and ``pin_last`` reuse). Nothing by
        default; gradient saliency runs its pass here."""
        return {}

    def before_mix(
        self, spec: str, leaves: list[Leaf], pinned: Mapping, generator: torch.Generator
    ) -> Mapping:
        """Called once per forward at the mixed layer, before the first :meth:`mix`, with the leaves
        :meth:`mix` will get and the generator every draw it makes comes from; what it returns joins the
        pinned values (so that a recomputation under activation checkpointing reuses it rather than
        computing it again). Nothing by default."""
        return {}

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        """The mix itself: a mixed tensor for every leaf (``leaf.tensor`` carries the batch along
        ``leaf.dim``), partner ``draw.index[i]`` for sample ``i``, weights from ``draw.lam``; further
        draws from ``draw.generator`` only. Gradients must flow as in a hand-edited ``forward()``.

        By default, the traced path's, run eagerly: what :meth:`draw_traced` draws, moved to the leaves'
        device, given to :meth:`mix_traced`, so that a method defining those three writes its mix once
        (for the eager and the compiled forward alike)."""
        if type(self).mix_traced is Mixer.mix_traced:
            raise NotImplementedError(
                f"{type(self).__name__} must implement mix(leaves, draw), or traced_params, draw_traced and "
                "mix_traced"
            )
        values, mixed = self.draw_traced(leaves, draw)
        device = leaves[0].tensor.device
        tensors = self.mix_traced(leaves, [to_device(v, device) for v in values])
        return Mixed(tensors, mixed.lam, mixed.info, mixed.index, mixed.weights)


def with_defaults(init: Callable, **defaults) -> Callable:
    """``init`` (a method's ``__init__``) with other defaults: a method that is another one with a few of its
    arguments changed states only those (``SAMix.__init__ = with_defaults(AutoMix.__init__,
    upsampling="bilinear", ...)``); its signature shows them (``inspect.signature``, the API page, the app's
    config checks), and a name it does not take is refused when the class is defined."""
    signature = inspect.signature(init)
    unknown = sorted(set(defaults) - set(signature.parameters))
    if unknown:
        raise TypeError(f"with_defaults: {init.__qualname__} takes no {', '.join(unknown)}")
    signature = signature.replace(
        parameters=[
            p.replace(default=defaults[p.name]) if p.name in defaults else p
            for p in signature.parameters.values()
        ]
    )

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        bound = _bound(signature, self, args, kwargs)
        init(*bound.args, **bound.kwargs)

    __init__.__signature__ = signature
    return __init__


def extending(init: Callable, own: Callable, positional: int = 2, without: Sequence[str] = (), **defaults):
    """``init`` (a method's ``__init__``) for a method that is that one with arguments of its own: ``own``
    (a function of ``(self, base, *, its own arguments)`` that checks and sets them, calling ``base()`` to
    run ``init`` with the rest), less the arguments ``init`` takes that it does not (``without``: ``init``
    gets its default, or the one ``defaults`` names) and with other defaults (``defaults``). A method then
    states only what differs (``AdAutoMix.__init__ = extending(AutoMix.__init__, AdAutoMix._own, ...)``),
    and its signature shows every argument (``inspect.signature``, the API page, the app's config checks):
    the first ``positional`` may be given by position, the rest by name only (a value given by position
    past them is refused in one line, where the base's order would have silently taken it for another)."""
    signature = inspect.signature(init)
    mine = [p for p in inspect.signature(own).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted((set(defaults) | set(without)) - set(signature.parameters))
    if unknown:
        raise TypeError(f"extending: {init.__qualname__} takes no {', '.join(unknown)}")
    kept = [p for p in signature.parameters.values() if p.name not in without]
    fixed = {name: defaults[name] for name in without if name in defaults}
    signature = signature.replace(
        parameters=[
            p.replace(
                default=defaults.get(p.name, p.default),
                kind=p.kind if i <= positional else inspect.Parameter.KEYWORD_ONLY,
            )
            for i, p in enumerate(kept)  # (0 is self)
        ]
        + mine
    )
    names = [p.name for p in mine]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        if len(args) > positional:
            first = ", ".join(p.name for p in kept[1 : positional + 1])
            raise TypeError(
                f"{type(self).__name__}() takes {first} by position and the rest by name, got {len(args)} "
                "values by position"
            )
        values = dict(_bound(signature, self, args, kwargs).arguments)
        del values[next(iter(values))]  # (self)
        theirs = {name: values.pop(name) for name in names}
        own(self, lambda: init(self, **values, **fixed), **theirs)

    __init__.__signature__ = signature
    return __init__


def _bound(signature: inspect.Signature, self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """A constructor call's arguments by ``signature`` (:func:`with_defaults`', :func:`extending`'s), its
    defaults applied; refused as Python refuses a plain ``__init__``'s, in one line."""
    try:
        bound = signature.bind(self, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{type(self).__name__}() {error}") from None
    bound.apply_defaults()
    return bound
