"""The base a mixing method subclasses: :class:`Mixer`, and the hot path of a mix.

A training forward is decided at the model's pre-hook (:meth:`Mixer._decide`: whether, and at which
layer; a :class:`~.forward.Forward`), mixed when that layer runs (:meth:`Mixer._mix_now`: lam and the
partners drawn or pinned, the site's tensors found once per site and then planned, the method's
:meth:`Mixer.mix`; a planned plain tensor, for a method that draws nothing in ``mix()``, in the few calls of
:meth:`Mixer._mix_plain`), and recorded at the model's end (:mod:`.binding`). Around it, each in its own
module: the contract the training loop relies on (:mod:`.contract`), ``loss``/``targets`` (:mod:`.targets`),
padding masks downstream of a mix (:mod:`.padding_masks`), the gradient pass of the saliency methods
(:mod:`.gradient_pass`), the one-graph path under ``torch.compile`` (:mod:`.traced`), the checks the
methods share (:mod:`.checks`) and the math (:mod:`mixhook.functional`). A method subclasses
:class:`Mixer` and implements :meth:`Mixer.mix` (and, where it needs to, :meth:`Mixer.sample_lam` and
:meth:`Mixer.check_leaves`); :class:`~mixhook.mixers.oneof.OneOf` keeps the same contract by delegating
to the mixers it chooses among. See docs/adding-a-mixer.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils.hooks import RemovableHandle

from .. import packing, recompute
from .. import padding as masks
from ..functional import sample_lam
from ..hooks import LayerHook, guard_unwrapped
from ..layouts import (
    CHANNELS_LAST,
    SiteLayout,
    channels_first,
    channels_last,
    check_layout,
    layout_facts,
    site_layout,
)
from ..sites import (
    INPUT,
    Inputs,
    Leaf,
    batch_leaves,
    blendable,
    describe,
    embedding_layers,
    input_dim,
    rebuild_inputs,
    replace_leaves,
    size_along,
)
from ..transfer import to_device
from .binding import Forwards
from .checks import check_fraction, check_layer_weights, check_positive
from .contract import Draw, Mixed, MixingHook, MixState, claim, unclaim
from .forward import NO_PINS, SKIP, Forward, Pins, given_index
from .gradient_pass import GradientPass
from .padding_masks import PaddingMasks
from .policies import Policies, Policy
from .targets import LossAndTargets
from .tokens import TokenGrid
from .traced import TracedPath, refuse_capture


def _check_doubled(model: nn.Module, output, state: MixState) -> None:
    """Refuse a clean+mixed forward whose output (a plain tensor) has no dimension of ``2B``: the model
    lost the doubled batch downstream of the mix (e.g. a ``view(B, ...)`` with the batch size read from its
    input), so its rows would not be the clean samples and their mixes."""
    n = state.index.shape[0]
    if isinstance(output, torch.Tensor) and output.ndim and 2 * n not in output.shape:
        raise RuntimeError(
            f"{type(model).__name__} returned shape {tuple(output.shape)} after a clean+mixed mix at "
            f"{state.layer!r}, which emitted {2 * n} rows (the {n} clean samples, then their mixes): the "
            "model reshapes by the batch size of its input downstream of that layer; mix a later layer, or "
            "use clean=False"
        )


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
    # Whether the method's loss needs the clean batch beside its mix (RegMixup, RankMixup, MixupE): then
    # `clean` is True from the start and cannot be turned off.
    keeps_clean: ClassVar[bool] = False
    # Whether the method's loss is the mixed criterion (_mixed_loss), which target, weights and loss
    # policies (Remix, LocalWeights, DecoupledLoss) change; False for a method with a loss of its own.
    takes_loss_policies: ClassVar[bool] = True

    _hooks_model = True  # its own hooks on the model (see LayerHook)

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
        self.layout = check_layout(layout, self.layers)
        self.alpha = check_positive("alpha", alpha)
        self.prob = check_fraction("prob", prob)
        self._draw_from(generator)
        if padding not in masks.PADDING:
            raise ValueError(f"padding must be one of {', '.join(masks.PADDING)}, got {padding!r}")
        self.padding = padding
        self.last: MixState | None = None
        self._pinned: Pins | None = None  # what pin(), pin_last() or skip_next() set for the next forward
        self._last_forward: Forward | None = None  # the last forward that mixed (what pin_last() repeats)
        self.token_grid: TokenGrid | None = None  # set by the region mixers given tokens=(gh, gw)
        self._layer_weights: tuple[float, ...] | None = None
        self._clean = type(self).keeps_clean
        self._policies: Policies | None = None  # use(): the partners, lam and target policies

    _TRANSIENT = (
        "_current", "_targets", "_seen", "_layouts", "_plans", "_traced", "_input_sides", "_reads_sides",
        "_modules", "_masks", "_gradients", "_compiled", "_plain", "_input_dim", "_given",
    )  # fmt: skip

    def _fresh(self) -> None:
        super()._fresh()
        self._layouts: dict[
            tuple[str, int], SiteLayout
        ] = {}  # (site, ndim): its maps' layout (mixhook.layouts)
        self._plans: dict[str, tuple] = {}  # a site that returns a plain tensor: (ndim, dtype, batch dim)
        self._current: Forward | None = None  # the training forward under way
        self._targets: torch.Tensor | None = None  # use_targets(): the next forward's labels
        self._seen = Forwards(self)  # the recent forwards, and which one produced given logits
        self._traced = False  # whether torch.compile traces the one-graph path (set at attach)
        # the collaborators: padding masks downstream of a mix, the gradient pass, the one-graph path
        self._masks = PaddingMasks(self, self._note, self._replayed)
        self._gradients = GradientPass(type(self).__name__, self.sites, self._captured_leaves, self._as_given)
        self._compiled = TracedPath(self, self._read_input, self._unplanned, self._restore, self._host_begin,
                                    self._host_draw)  # fmt: skip
        self._input_sides: tuple[int, int, int] | None = None  # a training input's (ndim, H, W)
        self._reads_sides = False  # whether maps are checked against the input's sides (set at attach)
        self._modules: dict[str, nn.Module] = {}  # the modules attached to, by spec
        self._plain = False  # whether a planned plain tensor takes the short path (_mix_plain; set at attach)
        self._input_dim: int | None = None  # the batch dimension of the model's input (set at attach)
        self._given: dict = {}  # use_features() / use_partners(): the next training forward's

    @property
    def traceable(self) -> bool:
        """Whether torch.compile traces this mixer's hooks into the model's graph with no graph break
        (``fullgraph=True``; :mod:`mixhook.engine.traced`): one class defines the traced path, and its
        :meth:`mix` too or none of its classes does (the default :meth:`mix` is the traced path's; a
        subclass that changes ``mix`` without it, e.g. to add noise, is not traced until it defines its
        own: the inherited one would leave its change out), and it takes no per-forward pass (gradient
        saliency); a model whose modules take padding masks (``padding="union"``) is not traced either.
        Otherwise the hooks run between graphs."""
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
        return self._traced

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
        """Draw weights of :attr:`layers` (one >= 0 each, not all 0): layer ``k`` is mixed with
        probability ``w[k] / sum(w)``. ``None`` (default): uniform, as each paper draws."""
        return self._layer_weights

    @layer_weights.setter
    def layer_weights(self, weights) -> None:
        self._layer_weights = None if weights is None else check_layer_weights(self.layers, weights)

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
        if layer is not None and layer not in self.layers:
            raise ValueError(
                f"pin(layer={layer!r}): not one of this regularizer's layers {list(self.layers)}"
            )
        if lam is not None:
            lam = torch.as_tensor(lam, dtype=torch.float64).detach().cpu()
            if lam.ndim > 1 or not bool(((lam >= 0) & (lam <= 1)).all()):
                raise ValueError(f"pin(lam={lam.tolist()}): lam must be a number (or 1-D values) in [0, 1]")
        given = {} if index is None else given_index(index, "pin")
        self._pinned = Pins(layer, lam, values={k: v for k, v in values.items() if v is not None}, **given)

    @property
    def pins(self) -> Pins | None:
        """What :meth:`pin`, :meth:`pin_last` or :meth:`skip_next` set for the next training forward
        (:class:`~mixhook.engine.forward.Pins`), or ``None``."""
        return self._pinned

    @property
    def current(self) -> Forward | None:
        """The training forward under way (:class:`~mixhook.engine.forward.Forward`: its layer, pins and,
        once its layer ran, what it mixed), or ``None`` outside one or in a forward that does not mix."""
        return self._current

    @property
    def pinned(self) -> bool:
        """Whether :meth:`pin`, :meth:`pin_last` or :meth:`skip_next` set something the next training
        forward has not used yet."""
        return self._pinned is not None

    def unpin(self) -> None:
        """Forget what :meth:`pin`, :meth:`pin_last` or :meth:`skip_next` set for the next training
        forward, which then decides as any other (``prob``, fresh draws)."""
        self._pinned = None

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
        if layer not in self.layers:
            raise ValueError(
                f"draw_for(layer={layer!r}): not one of this regularizer's layers {list(self.layers)}"
            )
        pins = NO_PINS if index is None else Pins(**given_index(index, "draw_for"))
        return self._drawing(layer, batch, pins, generator or self.generator, self.draw_traced, leaves or [])

    def leaves_at(self, layer: str, output) -> list[Leaf]:
        """The leaves the method acts on in ``output``, what ``layer`` returned (for ``"input"``, the
        model's :class:`~mixhook.sites.Inputs`), each with its batch dimension: what :meth:`draw_for` takes
        for a region method. Refused in one line as a forward would refuse them."""
        return self._leaves(layer, self._site_value(layer, output), None, plan=False)[1]

    @property
    def forwards(self) -> Forwards:
        """The record of this mixer's recent training forwards and what each mixed
        (:class:`~mixhook.engine.binding.Forwards`): an adapter checks at a step's end that every mixed
        forward's loss was taken under its mix (``claim_all()`` at the step's start, ``unclaimed()`` at
        its end)."""
        return self._seen

    def pin_last(self) -> None:
        """Make the next training forward repeat the last training forward's mix exactly: the same
        layer and every draw (lam, index, and the method's own: box, mask, noise), or no mix if the last
        forward did not mix. The mixer's generator is not advanced by the repeat."""
        if self.last is None or self._last_forward is None:
            self.skip_next()
            return
        self._pinned = self._last_forward.repeat()

    def skip_next(self) -> None:
        """Make the next training forward not mix, whatever ``prob`` (nothing is drawn for it)."""
        self._pinned = SKIP

    def use_targets(self, target: torch.Tensor) -> None:
        self._targets = target

    def use(self, *policies: Policy) -> Mixer:
        """Mix with these policies (:mod:`mixhook.policies`), replacing any used before: who is paired
        (``PartnerBatch``, ``BalancedMixup``, ``SaliencyPairing``), how much (``KernelWarping``), what the
        target is (``Remix``) and the loss (``LocalWeights``, ``DecoupledLoss``); at most one per knob
        (:data:`mixhook.engine.policies.KNOBS`). ``use()`` with none removes them. Set them before
        attaching. A mixer with policies runs its hooks between graphs under ``torch.compile`` (not traced)
        and takes the engine's general path. Returns the mixer, so ``ManifoldMixup("layer2").use(Remix())``
        builds one in a line. A policy refuses, in one line, a mixer it cannot act through."""
        if self._model is not None:
            raise RuntimeError(f"{type(self).__name__}.use(): set the policies before attach()")
        chosen = Policies(type(self).__name__, policies) if policies else None
        for policy in () if chosen is None else chosen.all:
            policy.check_mixer(self)
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
        self._given["features"] = features

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
        self._given["partner_inputs"] = inputs
        if targets is not None:
            self._given["partner_targets"] = targets

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
        return self._bound_state(logits, "state_for")

    def _bound_state(self, logits: torch.Tensor | None, what: str) -> MixState | None:
        return self._seen.state_for(logits, what, type(self).__name__, self._model is not None)

    def check_output(self, spec: str, value, batch: int | None = None, model_input=None) -> None:
        """Raise ``TypeError``/``ValueError`` (one line) unless what layer ``spec`` returned (for
        ``"input"``: the model's :class:`~mixhook.sites.Inputs`) can be mixed by this class, for a model
        input of ``batch`` samples; ``model_input`` (the model's first argument), where given, is what
        the sides of a map read by convention are checked against (:mod:`mixhook.layouts`).

        The app calls it on a sample batch before training; the hooks check every mix the same way.
        Needs the regularizer to be attached (the batch dimensions depend on the model)."""
        saved = self._input_sides
        if model_input is not None:
            self._input_sides = self._input_grid((model_input,), {})
        try:
            self._leaves(spec, self._site_value(spec, value), batch, plan=False)
        finally:
            self._input_sides = saved

    # ---------------------------------------------------------------------------------- the hooks

    def _check_attach(self, model: nn.Module) -> None:
        claim(model, self)

    def _register(
        self, model: nn.Module, modules: dict[str, nn.Module], handles: list[RemovableHandle]
    ) -> None:
        """Register the model hooks that start and end each forward, the layer hooks and the
        padding-mask hooks."""
        if self.layout_aware:
            declared = [self._declared_layout(s) for s, site in self.sites.items() if site.layer == INPUT]
            self._reads_sides = not any(d in CHANNELS_LAST.values() for d in declared if d is not None)
            self._layouts = {}
            for ndim in (d + 2 for d in self.region_dims):
                facts = layout_facts(model, ndim)
                for spec, site in self.sites.items():
                    self._layouts[spec, ndim] = site_layout(
                        model, site, self._declared_layout(spec), facts, ndim
                    )
        dims = next(iter(self._dims.values()), None)  # (the model's layout is fixed once it is built)
        self._input_dim = None if dims is None else input_dim(model, dims.seq_first)
        begin = recompute.hook(self._on_model_input, self._replay_input)
        handles.append(model.register_forward_pre_hook(begin, with_kwargs=True))
        guard_unwrapped(self, model, handles)
        self._modules = modules
        for spec, module in modules.items():
            if self.sites[spec].layer != INPUT:
                hook = recompute.hook(self._layer_hook(spec), self._replay_layer(spec))
                handles.append(module.register_forward_hook(hook))
        takes_masks = self.padding == "union" and self._masks.register(model, handles)
        handles.append(model.register_forward_hook(recompute.hook(self._on_model_output)))
        self._traced = self.traceable and not takes_masks
        self._plain = (
            not self.draws_in_mix
            and type(self).before_mix is Mixer.before_mix
            and not self._clean
            and not self._masks.active
            and self.token_grid is None
            and self._policies is None
        )

    def _reset(self) -> None:
        self._current = None
        self._plans = {}
        unclaim(self)

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict):
        if self._gradients.running:  # gradient_at()'s own pass
            return self._gradients.input(model, args, kwargs)
        if self._traced and torch.compiler.is_compiling():
            return self._compiled.begin(model, args, kwargs)
        if not model.training:
            self._current = None
            self._given = {}
            return None
        packing.refuse(type(self).__name__, model, args, kwargs)
        self._input_sides = self._input_grid(args, kwargs)
        return self._begin(model, args, kwargs, self._agree(self._decide()))

    def _begin(self, model: nn.Module, args: tuple, kwargs: dict, forward: Forward | None):
        """Start a training forward that mixes as ``forward`` decided (or not at all); mix the input now
        if it is the layer."""
        targets = self._targets
        if forward is not None and type(self).before_forward is not Mixer.before_forward:
            extra = self.before_forward(model, args, kwargs, forward.layer, forward.pins.given, targets)
            if extra:
                forward.pins = forward.pins.joined(extra)
        changed = None
        if self._policies is not None:
            given, self._given = self._given, {}
            changed = self._policies.begin(
                self, model, args, kwargs, forward, targets, given, self._input_dim or 0
            )
            if changed is not None:  # (a partner batch appended to the model's input)
                args, kwargs = changed
        if self._begin_forward(forward) is None:
            return None
        forward.batch = self._reference_batch(model, args, kwargs)
        if self.sites[forward.layer].layer != INPUT:
            return changed
        inputs = Inputs(model, args, kwargs)
        value, _ = self._mix_now(forward.layer, inputs, forward)  # (self.last set)
        args, kwargs = rebuild_inputs(inputs, self.sites[forward.layer], value)
        return self._input_masks(model, args, kwargs, forward.layer, self.last)

    def _input_masks(self, model, args: tuple, kwargs: dict, spec: str, state: MixState, again=False):
        """The model's arguments after a mix at its input, with their padding masks unioned
        (``padding="union"``: :meth:`~.padding_masks.PaddingMasks.at_input`)."""
        if self.padding != "union":
            return args, kwargs
        return self._masks.at_input(model, args, kwargs, spec, state, again)

    def _begin_forward(self, forward: Forward | None) -> Forward | None:
        """The state of a training forward that follows ``forward`` (eager, or in a compiled graph); a
        compiled forward before it is settled first (its record must not take this forward's mix)."""
        self._seen.settle()
        self.last = None
        self._targets = None
        self._current = forward
        self._masks.begin()
        return forward

    def _replay_input(self, model: nn.Module, args: tuple, kwargs: dict):
        """In a recomputation of the whole model (activation checkpointing): its input's mix again."""
        if self._gradients.running:
            return None
        for spec, site in self.sites.items():
            if site.layer == INPUT:
                pins = self._replayed(spec)
                if pins is not None:
                    inputs = Inputs(model, args, kwargs)
                    value, state = self._apply(spec, inputs, pins, self._replaying(pins.state))
                    args, kwargs = rebuild_inputs(inputs, site, value)
                    return self._input_masks(model, args, kwargs, spec, state, again=True)
        return None

    def _layer_hook(self, spec: str):
        def hook(module: nn.Module, args: tuple, output):
            if self._gradients.running:  # gradient_at()'s own pass
                return self._gradients.layer(spec, output)
            if self._traced and torch.compiler.is_compiling():
                return self._compiled.mix(spec, output) if module.training else None
            forward = self._current
            if forward is not None and forward.mixed is None and forward.layer == spec:  # it mixes here
                return self._mix_now(spec, output, forward)[0]  # (self.last set)
            self._note(spec)
            return None

        return hook

    def _replay_layer(self, spec: str):
        def again(module: nn.Module, args: tuple, output):
            """In a recomputation (activation checkpointing): the forward's mix at ``spec`` again."""
            pins = None if self._gradients.running else self._replayed(spec)
            if pins is None:
                return None
            return self._apply(spec, output, pins, self._replaying(pins.state))[0]

        return again

    def _mix_now(self, spec: str, value, forward: Forward):
        """The forward's mix at ``spec``: drawn from the mixer's generator (or, for ``pin_last``, from a
        copy in the repeated mix's state); what repeats it is noted for a recomputation and kept for
        ``pin_last``."""
        planned = self._plans.get(spec) if self._plain else None
        if planned is not None and type(value) is torch.Tensor and (value.ndim, value.dtype) == planned[:2]:
            if forward.batch is None or value.shape[planned[2]] == forward.batch:
                return self._mix_plain(spec, value, planned[2], forward)
        generator = self._replaying(forward.pins.state)
        leaves, before = None, type(self).before_mix is not Mixer.before_mix  # (a method that overrides it)
        policies = self._policies
        if before or not self.draws_in_mix or policies is not None:
            site_value = self._site_value(spec, value)
            leaves = (site_value, *self._leaves(spec, site_value, forward.batch))
            if policies is not None:  # (a memory bank's partner rows appended)
                leaves = policies.extend(spec, leaves, forward.pins.given)
        if before:
            extra = self.before_mix(spec, leaves[2], forward.pins.given)
            if extra:  # a recomputation and pin_last mix with the same values
                forward.pins = forward.pins.joined(extra)
        if policies is not None:
            extra = policies.before_mix(spec, leaves[2], forward.pins.given)
            if extra:
                forward.pins = forward.pins.joined(extra)
        drawn = self._repeatable(spec, None if leaves is None else leaves[3], forward, generator)
        self._note(spec, forward.repeat)  # (computed only where the forward may be recomputed)
        mixed, last = self._apply(spec, value, forward.pins, generator, forward.batch, leaves, drawn)
        self._done(forward, last)
        return mixed, last

    def _mix_plain(self, spec: str, h: torch.Tensor, dim: int, forward: Forward):
        """:meth:`_mix_now` where ``spec`` returned a plain tensor as it did before (planned: its batch
        dimension ``dim`` known, the checks that depend on nothing else passed) and the method draws nothing
        in :meth:`mix` and needs nothing before it (ManifoldMixup): what :meth:`_apply` does for it, without
        the structure, layouts, token grids and clean rows it has none of."""
        if h.is_cuda:
            refuse_capture(type(self).__name__, spec, h.device)
        leaves = [Leaf((), h, dim)]
        self.check_leaves(spec, leaves)
        draw = forward.drawn = self._draws(
            spec, h.shape[dim], forward.pins, self._replaying(forward.pins.state)
        )
        self._note(spec, forward.repeat)  # (computed only where the forward may be recomputed)
        mixed = self.mix(leaves, draw)
        t = mixed.tensors.get(()) if type(mixed) is Mixed and len(mixed.tensors) == 1 else None
        if t is None or t.shape != h.shape:  # (what _check_mixed refuses, said by it)
            t = self._check_mixed(spec, leaves, mixed)[()]
        last = self._state(spec, leaves, draw, mixed)
        self._done(forward, last)
        return t, last

    def _repeatable(self, spec: str, n: int | None, forward: Forward, generator: torch.Generator):
        """Make ``forward``'s mix at ``spec`` repeatable (``pin_last``, a recomputation): for a method that
        draws in :meth:`mix`, keep the generator's state before it (and return ``None``: nothing drawn
        yet); else draw lam and the index of the ``n`` samples now (the :class:`Draw`), keep and return
        it."""
        if self.draws_in_mix:
            forward.state = recompute.generator_state(generator)
            return None
        forward.drawn = self._draws(spec, n, forward.pins, generator)
        return forward.drawn

    def _done(self, forward: Forward, last: MixState) -> None:
        """``forward`` mixed ``last``: kept for ``pin_last``, and recorded for ``loss()`` (eager here, or
        in ``mixhook::draw`` for a forward a compiled graph began)."""
        self._last_forward = forward
        forward.mixed = last
        self.last = last
        self._seen.mixed(last)

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        if self._gradients.running:  # gradient_at()'s own pass
            return
        if self._traced and torch.compiler.is_compiling():
            self._seen.pending = output  # (bound to its forward's record after the graph: .traced)
            return
        forward, self._current = self._current, None
        if forward is None:
            state = None
        elif forward.mixed is not None:
            state = self.last
            if state.clean:
                _check_doubled(model, output, state)
        else:
            replaced = self._replaced(model, forward.layer)
            if replaced:
                where = f"{type(model).__name__}.forward()"
                raise RuntimeError(f"mixup layer {forward.layer!r} did not run during {where}: {replaced}")
            raise RuntimeError(
                f"mixup layer {forward.layer!r} did not run during {type(model).__name__}.forward(), so "
                "nothing was mixed; choose a layer that forward() calls. (Under torch.compile: attach before "
                "compiling, and if hooks changed after compiling, or another instance of this class was "
                "compiled without them, set torch._dynamo.config.skip_nnmodule_hook_guards = False before "
                "compiling.)"
            )
        self._seen.record(output, state)

    def _replaced(self, model: nn.Module, spec: str) -> str | None:
        """Why layer ``spec`` could not run, where the module now at its name is not the one attached to."""
        name = self.sites[spec].layer
        try:
            current = model.get_submodule(name)
        except AttributeError:
            current = None
        if current is self._modules.get(spec):
            return None
        now = f"a {type(current).__name__}" if current is not None else "nothing"
        return (
            f"the {type(self._modules.get(spec)).__name__} it was attached to was replaced by {now} (PEFT's "
            "merge_and_unload() or unload()?), so nothing was mixed; attach the mixer again"
        )

    def _agree(self, forward: Forward | None) -> Forward | None:
        """The decision this forward follows: its own (ranks that must agree override this)."""
        return forward

    def partner_pool(self, n: int) -> int:
        """How many samples a batch of ``n`` draws its partners from: ``n`` (partners from the global
        batch of a data-parallel job: ``world * n``); a pinned index is checked against it."""
        return n

    def _decide(self) -> Forward | None:
        """Whether this forward mixes, and where (pinned values win; a pinned forward always mixes)."""
        self._seed_for_rank()
        pins, self._pinned = self._pinned, None
        if pins is not None and pins.skip:
            return None
        g = self.generator
        if pins is None:
            if self.prob < 1.0 and float(torch.rand((), generator=g, device=g.device)) >= self.prob:
                return None
            pins = NO_PINS
        layer = pins.layer
        if layer is None:
            k = 0
            if self.layer_weights is not None:
                weights = torch.tensor(self.layer_weights, dtype=torch.float64, device=g.device)
                k = int(torch.multinomial(weights, 1, generator=g))
            elif len(self.layers) > 1:
                k = int(torch.randint(len(self.layers), (), generator=g, device=g.device))
            layer = self.layers[k]
        return Forward(layer, pins)

    # ------------------------------------------------------------------------------ the mix itself

    def _site_value(self, spec: str, value):
        """What a spec acts on in a layer's output or, for ``"input"``, the model's :class:`Inputs`:
        with a selector, the whole (the selector picks), else the output or the first argument."""
        site = self.sites[spec]
        if site.layer != INPUT:
            return value
        if not len(value):
            raise TypeError(f"mixup layer {spec!r}: the model was called without arguments; nothing to mix")
        return value if site.paths is not None else value[0]

    def _leaves(
        self, spec: str, value, expected: int | None = None, plan: bool = True
    ) -> tuple[list[Leaf], list[Leaf], int]:
        """The leaves that carry the batch at ``spec``, what the method is given for them (the same, or
        with a token grid their ``(B, D, gh, gw)`` patch maps), and the batch size.

        A site that returned a plain tensor once is planned (its batch dimension, for its number of
        dimensions and dtype): the next tensor of the same kind skips the structure walk and the checks
        that depend on nothing else; the method's own :meth:`check_leaves` runs every time. Traced code
        (``plan=False``) neither reads nor writes plans (a traced read of the dict would be a guard)."""
        planned = self._plans.get(spec) if plan else None
        if planned is not None and type(value) is torch.Tensor and (value.ndim, value.dtype) == planned[:2]:
            batch = value.shape[planned[2]]
            if expected is not None and batch != expected:
                self._plans.pop(spec)  # the full path says what is wrong
                return self._leaves(spec, value, expected)
            found = [Leaf((), value, planned[2])]
            self.check_leaves(spec, found)
            return found, found, batch
        site = self.sites[spec]
        if site.layer == INPUT:
            self._check_token_ids(spec, value)
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}.check_output() needs the regularizer attached")
        kind = type(self).__name__
        found, batch = batch_leaves(value, site, self._dims[spec], kind, inputs=site.layer == INPUT)
        if expected is not None and batch != expected:
            rule = self._layouts.get((spec, found[0].tensor.ndim)) if self.layout_aware else None
            if rule is not None and rule.how == "windows":  # (B * windows) rows: say why
                rule.of(kind, spec)
            raise TypeError(
                f"{kind} at {spec!r}: it returned {describe(value)}, whose batch dimension "
                f"{found[0].dim} has size {batch}, but the model's input has a batch of {expected}: the "
                "layer loses or reshapes the batch dimension (or, applied to a PackedSequence's .data, sees "
                "the time steps of every sample as rows); choose another layer, or pass batch_dim"
            )
        if self.layout_aware and self._input_sides is not None and site.layer != INPUT:
            for leaf in found:
                self._check_sides(spec, leaf)
        if self.token_grid is not None:
            given = self.token_grid.to_maps(spec, found, self._model)
        elif self.layout_aware and any(self._channels_last(spec, leaf) for leaf in found):
            given = [Leaf(f.path, channels_first(f.tensor, CHANNELS_LAST[f.tensor.ndim]), 0)
                     if self._channels_last(spec, f) else f for f in found]  # fmt: skip
        else:
            given = found
            if plan and type(value) is torch.Tensor and found[0].path == ():
                self._plans[spec] = (value.ndim, value.dtype, found[0].dim)
        self.check_leaves(spec, given)
        return found, given, batch

    def _declared_layout(self, spec: str) -> str | None:
        return self.layout.get(spec) if isinstance(self.layout, dict) else self.layout

    def _channels_last(self, spec: str, leaf: Leaf) -> bool:
        """Whether ``leaf`` is a channels-last map (``(B, H, W, C)``; for a method that cuts them,
        ``(B, L, C)`` or ``(B, D, H, W, C)``), which a layout-aware method is given as its channels-first
        view; a map whose layout cannot be told is refused here (one line)."""
        ndim = leaf.tensor.ndim
        if not self.layout_aware or leaf.dim != 0 or ndim - 2 not in self.region_dims:
            return False
        rule = self._layouts.get((spec, ndim))
        return rule is not None and rule.of(type(self).__name__, spec) == CHANNELS_LAST[ndim]

    def _reference_batch(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
        """The batch size of the model's input, to check each mixed layer against: the first tensor
        argument's batch dimension, where the model's layout tells it (``None`` where it does not)."""
        first = args[0] if args and type(args[0]) is torch.Tensor else None  # (the usual call)
        if first is None:
            first = next(
                (v for v in (*args, *kwargs.values()) if isinstance(v, (torch.Tensor, PackedSequence))), None
            )
        if isinstance(first, PackedSequence):  # its .data rows are time steps of every sample
            return int(first.batch_sizes[0])
        return size_along(first, self._input_dim)

    def _input_grid(self, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        """The number of dimensions, height and width of the model's input where it is an image or a clip
        (4-D or 5-D, its height and width last, as NCHW images and both clip layouts have them) and the
        region methods read their maps' layouts (to check a map's sides against: ``check_sides``)."""
        if not self._reads_sides:
            return None
        first = args[0] if args else next(iter(kwargs.values()), None)
        if type(first) is not torch.Tensor or first.ndim not in (4, 5):
            return None
        return first.ndim, int(first.shape[-2]), int(first.shape[-1])

    def _check_sides(self, spec: str, leaf: Leaf) -> None:
        """A map read by its model's statement, PyTorch's convention or a last-dimension op, checked
        against the input's height and width (:meth:`mixhook.layouts.SiteLayout.check_sides`)."""
        rule = self._layouts.get((spec, leaf.tensor.ndim))
        if rule is not None and leaf.dim == 0:
            rule.check_sides(type(self).__name__, spec, leaf.tensor.shape, self._input_sides)

    def _check_token_ids(self, spec: str, value) -> None:
        selected = value if isinstance(value, torch.Tensor) else None
        if selected is None and isinstance(value, Inputs):
            paths = self.sites[spec].paths or ()
            picked = [value.get(value.key(p[0])) if isinstance(p[0], str) or p[0] < len(value) else None
                      for p in paths]  # fmt: skip
            selected = next((t for t in picked if isinstance(t, torch.Tensor) and not blendable(t)), None)
        if isinstance(selected, torch.Tensor) and not blendable(selected):
            embeddings = embedding_layers(self._model) if self._model is not None else []
            where = (f"mix the embeddings instead: {', '.join(embeddings[:4])}, or a layer after them"
                     if embeddings else "mix a layer whose output is floating point")  # fmt: skip
            dtype = str(selected.dtype).removeprefix("torch.")
            raise TypeError(
                f"mixup layer {spec!r}: the model's input is a {dtype} tensor of shape "
                f"{tuple(selected.shape)} (token ids or labels), which cannot be blended; {where}"
            )

    def _apply(
        self,
        spec: str,
        value,
        pins: Pins,
        generator: torch.Generator,
        batch: int | None = None,
        leaves: tuple | None = None,
        drawn: Draw | None = None,
    ):
        """Mix what ``spec`` returned (or the model's inputs); draws come from ``generator``. Returns the
        mixed value (same structure; for ``"input"`` the changed arguments) and the :class:`MixState`.
        ``leaves``: the site's value and what :meth:`_leaves` gave for it, where the caller has them;
        ``drawn``: the :class:`Draw`, where the caller drew it (not read back from ``pins`` and checked
        again)."""
        if leaves is None:
            site_value = self._site_value(spec, value)
            found, given, n = self._leaves(spec, site_value, batch)
            if self._policies is not None:  # (a recomputation: the bank's rows appended again)
                site_value, found, given, n = self._policies.extend(
                    spec, (site_value, found, given, n), pins.given
                )
        else:
            site_value, found, given, n = leaves
        if self._clean and n < 2:
            raise ValueError(
                f"{type(self).__name__}(clean=True) at {spec!r}: a batch of {n} has no partner to mix with; "
                "the clean+mixed batch needs at least 2 samples"
            )
        if found[0].tensor.is_cuda:
            refuse_capture(type(self).__name__, spec, found[0].tensor.device)
        if (
            self._masks.active
            and self.token_grid is None  # (a token grid cuts patches, and keeps the leading tokens' rule)
            and found[0].tensor.ndim == 3
            and self._channels_last(spec, found[0])
        ):
            raise ValueError(
                f"{type(self).__name__} at {spec!r} cuts the positions of a (B, L, C) sequence, and the "
                "model takes padding masks: their union (padding='union') would call a pasted position valid "
                "by the wrong sample's mask; blend the sequence instead (ManifoldMixup), or pass "
                "padding='keep' to hand the model its own masks unchanged"
            )
        draw, mixed = self._drawing(spec, n, pins, generator, self.mix, given, drawn)
        tensors = self._check_mixed(spec, given, mixed)
        state = self._state(spec, found, draw, mixed, self._clean)
        if self.token_grid is not None:
            grid = self.token_grid
            tensors = {
                leaf.path: grid.from_map(leaf, tensors[leaf.path], state.lam, draw.index, draw.permutation)
                for leaf in found
            }
        elif self.layout_aware:  # channels-last maps were given as their channels-first views
            tensors = dict(tensors)
            for leaf in found:
                if self._channels_last(spec, leaf):
                    tensors[leaf.path] = channels_last(tensors[leaf.path])
        if self._clean:  # the clean rows, then their mixes, along each tensor's batch dimension
            tensors = {leaf.path: torch.cat([leaf.tensor, tensors[leaf.path]], leaf.dim) for leaf in found}
        if self._policies is not None:  # (a partner batch's rows dropped)
            tensors, state = self._policies.finish(found, tensors, state)
        return replace_leaves(site_value, tensors), state

    def _drawing(
        self,
        spec: str,
        n: int,
        pins: Pins,
        generator: torch.Generator,
        method,
        leaves: list,
        drawn: Draw | None = None,
    ):
        """The :class:`Draw` of a mix of ``n`` samples at ``spec`` and what ``method(leaves, draw)``
        returns (:meth:`mix`, or :meth:`draw_traced`), every draw from ``generator`` (``drawn``: the draw
        of lam and the index, made already by :meth:`_repeatable`)."""
        saved, self.generator = self.generator, generator  # a mixer drawing from self.generator replays too
        try:
            draw = drawn if drawn is not None else self._draws(spec, n, pins, generator)
            if self._policies is None:
                return draw, method(leaves, draw)
            # lam warped per pair, pair weights: what the mix uses and records
            draw, info = self._policies.adjust(draw, leaves, self._masks.active)
            mixed = method(leaves, draw)
            if info:
                mixed = Mixed(mixed.tensors, mixed.lam, {**mixed.info, **info}, mixed.index, mixed.weights)
            return draw, mixed
        finally:
            self.generator = saved

    @staticmethod
    def _state(spec: str, found: list[Leaf], draw: Draw, mixed: Mixed, clean: bool = False) -> MixState:
        """What a mix at ``spec`` of the leaves ``found`` did, drawn ``draw``, as ``mixed`` says (``clean``:
        the clean rows kept before it)."""
        return MixState(
            layer=spec,
            lam=draw.lam if mixed.lam is None else torch.as_tensor(mixed.lam, dtype=torch.float64),
            index=draw.index if mixed.index is None else mixed.index,
            info=dict(mixed.info) if mixed.info else {},
            elements=tuple([leaf.name for leaf in found]),
            batch_dims=tuple([leaf.dim for leaf in found]),
            weights=mixed.weights,
            shapes=tuple([leaf.tensor.shape for leaf in found]),
            clean=clean,
            partner_lam=mixed.partner_lam,
            _weight=draw.weight if mixed.lam is None and isinstance(draw.weight, float) else None,
        )

    def _draws(self, spec: str, n: int, pins: Pins, generator: torch.Generator) -> Draw:
        """The :class:`Draw` of a mix of ``n`` samples at ``spec``: lam and the partner index (pinned, else
        drawn from ``generator``), and whether the index is a permutation of the batch."""
        if self._policies is not None:
            drawn = self._policies.draws(self, spec, n, pins, generator)
            if drawn is not None:
                return drawn
        pool = self.partner_pool(n)
        lam = pins.lam
        if lam is None:
            lam = self.sample_lam(n, generator)
            if type(lam) is not torch.Tensor or lam.dtype != torch.float64:
                lam = torch.as_tensor(lam, dtype=torch.float64)
        elif lam.ndim == 1 and lam.shape[0] != n:
            raise ValueError(f"pinned lam has {lam.shape[0]} values but the batch at layer {spec!r} has {n}")
        index = pins.index
        if index is None:
            permutation = pool == n and self.index_is_permutation
            return Draw(spec, lam, self.draw_index(n, generator), generator, pins.given, permutation)
        low, high = pins.span
        if index.shape[0] != n or (n and (low < -pool or high >= pool)):
            where = f"the batch of {n}" if pool == n else f"{pool} partners for a batch of {n}"
            raise ValueError(
                f"pinned index of length {index.shape[0]} (values {index.tolist()[:8]}...) "
                f"does not index {where} at layer {spec!r}"
            )
        if low < 0:  # counted from the end, as indexing counts them
            index = torch.where(index < 0, index + pool, index)
        return Draw(spec, lam, index, generator, pins.given, pool == n and pins.permutation)

    def _replaying(self, state: torch.Tensor | None) -> torch.Generator:
        """The generator a mix draws from: the mixer's own, or for a repeat (``pin_last``, a
        recomputation) a copy in the repeated mix's ``state`` (``None``: the mix drew nothing beyond lam
        and the index, which are repeated as pinned values)."""
        return self.generator if state is None else recompute.replay_generator(self.generator, state)

    # ------------------------------------------------ what the collaborators are given (see _fresh)

    def _captured_leaves(self, spec: str, value) -> tuple:
        """For the gradient pass: the site's value in ``value`` and the leaves that carry its batch."""
        site_value = self._site_value(spec, value)
        return site_value, self._leaves(spec, site_value)[0]

    def _as_given(self, spec: str, leaf: Leaf, model: nn.Module) -> torch.Tensor:
        """``leaf``'s tensor as :meth:`mix` is given it: a token grid's ``(B, D, gh, gw)`` map, a
        channels-last map's channels-first view, or itself."""
        if self.token_grid is not None:
            return self.token_grid.to_maps(spec, [leaf], model)[0].tensor
        if self._channels_last(spec, leaf):  # (as _leaves gives the method a channels-last map)
            return channels_first(leaf.tensor, CHANNELS_LAST[leaf.tensor.ndim])
        return leaf.tensor

    def _read_input(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
        """A training forward's input, read under torch.compile as an eager forward reads it: its sides
        (the map checks of :meth:`_leaves`) and its batch size, where the model tells it."""
        self._input_sides = self._input_grid(args, kwargs)
        return self._reference_batch(model, args, kwargs)

    def _unplanned(self, spec: str, value) -> tuple:
        """The site's value in ``value``, the leaves found and given and the batch size, without the plans
        (traced code neither reads nor writes them)."""
        site_value = self._site_value(spec, value)
        return (site_value, *self._leaves(spec, site_value, None, plan=False))

    def _restore(self, spec: str, leaf: Leaf, t: torch.Tensor, weight, index) -> torch.Tensor:
        """A mixed tensor ``t`` of ``leaf``, which the method was given as a view, put back (traced): a
        token grid's map into the tokens (the leading tokens blended by ``weight`` and ``index``), a
        channels-first view into its channels-last map."""
        if self.token_grid is not None:
            return self.token_grid.from_map_traced(leaf, t, weight, index)
        return channels_last(t) if self._channels_last(spec, leaf) else t

    def _host_begin(self, training: bool, batch: int | None) -> int:
        """``mixhook::begin`` (:mod:`.traced`): the previous compiled forward's output bound to its record,
        this forward's record opened, and (training) its decision made as an eager forward makes it; the
        chosen layer's position (-1: none)."""
        forward = self._begin_forward(self._agree(self._decide()) if training else None)
        self._seen.open(None if forward is None else forward.layer)
        if forward is None:
            return -1
        forward.batch = batch
        return self.layers.index(forward.layer)

    def _host_draw(self, spec: str, n: int, found: list, given: list, device: torch.device):
        """``mixhook::draw`` at ``spec`` (:mod:`.traced`): ``None`` unless this forward mixes there; then
        the values :meth:`draw_traced` draws and the :class:`MixState`, drawn and kept as :meth:`_mix_now`
        draws and keeps an eager mix."""
        forward = self._current
        if forward is None or forward.done or forward.layer != spec:
            return None
        refuse_capture(type(self).__name__, spec, device)
        if forward.batch is not None and n != forward.batch:
            raise TypeError(
                f"{type(self).__name__} at {spec!r}: its batch dimension has size {n}, but the model's input "
                f"has a batch of {forward.batch}: the layer loses or reshapes the batch dimension; choose "
                "another layer, or pass batch_dim"
            )
        generator = self._replaying(forward.pins.state)
        drawn = self._repeatable(spec, n, forward, generator)
        d, (values, mixed) = self._drawing(spec, n, forward.pins, generator, self.draw_traced, given, drawn)
        last = self._state(spec, found, d, mixed)
        self._done(forward, last)
        return values, last

    def _check_mixed(self, spec: str, leaves: list[Leaf], mixed: Mixed) -> dict:
        """``mixed.tensors``, once it gives every leaf a tensor of the leaf's shape (a method that skipped
        one would leave it silently unmixed)."""
        kind = type(self).__name__
        if not isinstance(mixed, Mixed):
            raise TypeError(f"{kind}.mix() must return a mixhook.mixers.Mixed, got {type(mixed).__name__}")
        expected = {leaf.path: leaf for leaf in leaves}
        if set(mixed.tensors) != set(expected):
            raise RuntimeError(
                f"{kind}.mix() at {spec!r} returned tensors for {sorted(map(str, mixed.tensors))} but was "
                f"given {sorted(map(str, expected))}: every leaf must be mixed"
            )
        for path, t in mixed.tensors.items():
            if t.shape != expected[path].tensor.shape:
                raise RuntimeError(
                    f"{kind}.mix() at {spec!r} changed the shape of {expected[path].name} from "
                    f"{tuple(expected[path].tensor.shape)} to {tuple(t.shape)}"
                )
        return mixed.tensors

    # ------------------------------------------------------------------------- what a method implements

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
        :meth:`traced_params` describes them) and the :class:`Mixed` (no tensors) that records the mix,
        drawn from ``draw`` exactly as :meth:`mix` would."""
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
        return self._gradients.gradient_at(model, args, kwargs, spec, target)

    def unmixed_forward(self, model: nn.Module, args: tuple, kwargs: dict):
        """``model(*args, **kwargs)`` once more, without gradients and without any mix, for a method that
        reads what the network computes on the unmixed batch (SnapMix's class activation maps), from
        :meth:`before_forward`: in eval mode (no training hook acts, dropout off) but with batch norm on
        the batch's statistics, its running statistics untouched (:mod:`.gradient_pass`)."""
        return self._gradients.plain_forward(model, args, kwargs)

    def before_forward(
        self, model: nn.Module, args: tuple, kwargs: dict, spec: str, pinned: Mapping, targets
    ) -> Mapping:
        """Called at the start of a training forward that will mix at ``spec``, with the model's
        arguments, the values pinned so far and the labels given by :meth:`use_targets` (or ``None``);
        what it returns joins the pinned values :meth:`mix` finds in ``draw.pinned`` (and that a
        recomputation and ``pin_last`` reuse). Nothing by default; gradient saliency runs its pass here."""
        return {}

    def before_mix(self, spec: str, leaves: list[Leaf], pinned: Mapping) -> Mapping:
        """Called once per forward at the mixed layer, before the first :meth:`mix`, with the leaves
        :meth:`mix` will get; what it returns joins the pinned values (so that a recomputation under
        activation checkpointing reuses it rather than computing it again). Nothing by default."""
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
