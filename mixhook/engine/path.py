"""One training forward of a mixer, hop by hop: :class:`Path`, the object each
:class:`~mixhook.engine.mixer.Mixer` holds that registers its hooks when it is attached, owns the state of
that attachment and is the one path every method's forward takes through them. It reads the method
through a narrow public view (:data:`VIEW`): its settings and its extension points.

1. **The model's pre-hook** (:meth:`Path._on_model_input`, and in an eager training forward
   :meth:`Path._start`) decides whether this forward mixes, and at which layer
   (:meth:`Path._decide`, :meth:`Path._layer_of`): one :class:`~.forward.Forward` (its layer
   and pins; lam, the partners and the generator's state for a repeat once drawn), the only object a
   forward carries. A mix at the model's input is made here.
2. **The mixed layer's hook** (:meth:`Path._layer_hook`) hands the layer's output to
   :meth:`Path._mix`, the one path of a mix for every method and site, one method per step: its
   leaves (:meth:`Path._leaves`: the cheap case, a plain tensor with the signature its site was
   planned for, is chosen at its top), what the method computes first, lam and the partners drawn (or
   pinned) and the method's ``mix()`` (:meth:`Path._draw_and_mix`, :meth:`Path._draws`), the
   :class:`~.contract.MixState` recorded and the tensors put back (:meth:`Path._as_planned`, or
   :meth:`Path._put_back`).
3. **The model's output hook** (:meth:`Path._on_model_output`) marks the output with what was mixed
   (:mod:`.binding`), which ``loss()`` reads (:mod:`.targets`).

What depends only on the model, its sites and the method is worked out once, when the mixer is attached
(:meth:`Path.register`: the sites' layouts and the model's input, :mod:`.leaves`; whether the model
can be given a packed batch; which hops a forward of this method can skip: the settings they depend on are
fixed while it is attached); what depends on a layer's output is planned at its first forward with the
signature it was derived from (:class:`~.leaves.Plan`), compared on every forward. A recomputation under
activation checkpointing reaches the same hooks during backward and walks the same path again with what
the forward noted (:mod:`mixhook.recompute`); under ``torch.compile`` a traced mixer's hooks take the
one-graph path (:mod:`.traced`); a gradient-saliency method's own pass goes to :mod:`.gradient_pass`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import packing, recompute
from ..functional import weight_of
from ..hooks import guard_unwrapped
from ..layouts import CHANNELS_LAST, channels_first, channels_last
from ..sharding import sharded
from ..sites import INPUT, Inputs, Leaf, rebuild_inputs, replace_leaves
from .binding import Forwards
from .contract import Draw, Mixed, MixState, checked_mixture
from .forward import NO_PINS, Forward, Pins
from .gradient_pass import GradientPass
from .leaves import SiteLeaves
from .norms import NormsApart
from .padding_masks import PaddingMasks
from .partners import crosses_ranks
from .policies import Policies
from .traced import TracedPath, refuse_capture

_compiling = torch.compiler.is_compiling
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward: see recompute.in_backward
_may_be_recomputed = recompute.may_be_recomputed
_distributed = torch.distributed.is_initialized if torch.distributed.is_available() else bool
# the make_fx tracer's mode, where one is active (torch.compiler.precompile, a non-strict export): a C call
_proxy_mode = getattr(torch._C, "_get_dispatch_mode", lambda key: None)
_PROXY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)
_PLAIN = ("[]",)  # the elements of a plain tensor (MixState.elements)
# the ways a hook call goes beside an eager forward's own (0): Path._way
_REPLAY, _GRADIENTS, _TRACED, _BETWEEN = 1, 2, 3, 4
# the extension points a forward skips where a method keeps their default, which does nothing (the class's
# Mixer.overridden, or the mixer's own attribute, read when it is attached)
SKIPPABLE = frozenset(("check_leaves", "before_forward", "before_mix"))
# What the path and its collaborators (the leaves, the padding masks, the norms, the traced path) read of a
# mixer: their whole view of the method, public settings and extension points only, and nothing of it is
# written (tests/test_style.py holds both): the attachment's state (the next forward's pins, the forward
# under way, the record of the last) is the path's own, which the mixer's user API reads and sets through
# it. The settings fixed while a mixer is attached (its setters refuse a change then) are read once, when it
# is attached.
VIEW = {
    "settings": (
        "sites", "layers", "clean", "padding", "token_grid", "layout", "layout_aware",
        "region_dims", "batch_norm_apart", "traceable", "draws_in_mix", "index_is_permutation",
        "checks_by_signature", "computed_each_forward", "overridden", "prob", "generator", "site_weights",
    ),
    "extension points": (
        "mix", "sample_lam", "draw_index", "partner_pool", "check_leaves", "before_forward", "before_mix",
        "agree", "traced_params", "draw_traced", "mix_traced",
    ),
}  # fmt: skip


def _between_graphs(hook):
    """``hook`` as torch.compile leaves it: called as it is, between graphs. For a mixer that is not traced
    (:attr:`~.mixer.Mixer.traced`), whose hooks dynamo would otherwise trace op by op, each of their draws a
    graph break to resume after. Made when first compiled (so that importing or attaching mixhook does not
    import torch._dynamo) and kept on the hook's function, which it lives as long as."""
    wrapped = getattr(hook, "between_graphs", None)
    if wrapped is None:
        wrapped = hook.between_graphs = torch.compiler.disable(hook)
    return wrapped


class Path:
    """The path of one training forward of ``mixer`` (a :class:`~mixhook.engine.mixer.Mixer`) through the
    hooks it registers (see the module's docstring), and the state of the mixer's attachment: the forward
    under way, the record of recent forwards, the sites' plans and what was worked out when attached. The
    mixer holds it as one attribute, made anew for a copy (which starts detached).

    It reads the method through :data:`VIEW` only, the mixer's public settings and its extension points,
    and writes nothing of it: the pins of the next forward, the forward under way and the last forward's
    record are its own (the mixer's ``pin()``, ``last`` and ``use_targets()`` read and set them here); the
    settings fixed while attached are read once, when attached (:meth:`register`). The mixer's own
    machinery as a hook on some layers (the recompute notes, the reseed per rank, its per-layer arguments,
    the site a spec names) is handed to it here, by the mixer."""

    def __init__(self, mixer, note: Callable, replayed: Callable, seed: Callable, site: Callable,
                 per_layer: Callable):  # fmt: skip
        self.mixer = mixer
        self.kind = type(mixer).__name__
        self._note, self._replayed = note, replayed  # (recompute: what a recomputation must redo)
        self._seed, self._site, self._per_layer = seed, site, per_layer
        # the attachment's state and record, which the mixer's user API reads and sets through the methods
        # below (pin, use_targets, give, relabel): nothing of it lives on the mixer
        self.pins: Pins | None = None  # what pin(), pin_last() or skip_next() set for the next forward
        self.current: Forward | None = None  # the training forward under way
        self.last: MixState | None = None  # what the last training forward mixed (without the loss's pieces)
        # the last training forward that mixed, what pin_last() repeats; None before one, or once a later
        # forward began
        self.last_forward: Forward | None = None
        self.targets: torch.Tensor | None = None  # use_targets(): the next forward's labels
        self.seen = Forwards(mixer)  # the recent forwards, and which one produced given logits
        self.given: dict = {}  # use_features() / use_partners(): the next training forward's
        # the collaborators: padding masks downstream of a mix, the gradient pass, the one-graph path
        under_way = self._under_way
        self._masks = PaddingMasks(mixer, under_way, note, replayed)
        self._norms = NormsApart(under_way, note, replayed)
        self.gradients = GradientPass(self.kind, mixer.sites, self._captured_leaves, self._as_given)
        self._compiled = TracedPath(mixer, self._read_input, self._unplanned, self._restore, self._host_begin,
                                    self._host_draw)  # fmt: skip
        # what is worked out when attached (register)
        self.model: nn.Module | None = None  # the model attached to
        self.sites: dict = {}  # the mixer's sites, resolved on the model
        self.layers: tuple[str, ...] = ()  # their specs, in the mixer's order
        self.site_leaves: SiteLeaves | None = None  # the sites' leaves, layouts and plans
        self._modules: dict[str, nn.Module] = {}  # the modules attached to, by spec
        self._inputs: tuple[str, ...] = ()  # the specs of the model's input
        self.traced = False  # whether torch.compile traces the one-graph path
        self._positional: dict[str, bool] = {}  # per input spec: it mixes the model's first argument whole
        self._packable = False  # whether the model can be called with a packed batch (checked per forward)
        self._global = False  # whether the partners come from every rank (the ranks agree per forward)
        self._extended: frozenset[str] = frozenset()  # the SKIPPABLE extension points it overrides
        self._checks_leaves = False  # whether each forward runs the method's check_leaves (see register)
        self._before = False  # whether the method computes something before the forward (before_forward)
        self._begins = False  # whether a forward's start needs _begin (before_forward, policies)
        self._before_mix = False  # whether the method computes something before its mix (before_mix)
        self._draws_later = True  # whether mix() draws from the generator itself (draws_in_mix)
        self.sharded = False  # whether the model is sharded by FSDP2 (a pass must run on every rank)
        self._recomputed: frozenset[str] = frozenset()  # computed_each_forward: pin_last's record leaves them
        # the settings fixed while the mixer is attached (refused in one line if set then)
        self._clean = False  # clean: the clean rows kept before the mixed ones
        self._policies: Policies | None = None  # use(): the partners, lam, target and loss policies
        self._padding = "union"  # padding: the padding masks downstream of a mix
        self._token_grid = None  # token_grid: a region method's patch grid of a token sequence

    # ------------------------------------------------------------------------ attaching, once

    def register(
        self,
        model: nn.Module,
        modules: dict[str, nn.Module],
        handles: list[RemovableHandle],
        dims: dict,
        policies: Policies | None,
    ) -> None:
        """Register the model hooks that start and end each forward, the layer hooks and the padding-mask
        hooks (their handles appended to ``handles``), and work out what depends only on the model, its
        sites (resolved, each module by spec; ``dims``: their batch dimensions) and the method (``policies``:
        the mixer's, which it cannot change while attached)."""
        mixer = self.mixer
        self.model, self.sites, self.layers = model, mixer.sites, mixer.layers
        self._clean, self._padding, self._token_grid = mixer.clean, mixer.padding, mixer.token_grid
        self._policies = policies
        self.site_leaves = SiteLeaves(mixer, model, dims, self._per_layer)
        # (made again now that the specs are resolved: a portable spec's real name is what the pass meets)
        self.gradients = GradientPass(self.kind, self.sites, self._captured_leaves, self._as_given)
        self._modules = modules
        self._inputs = tuple(spec for spec, site in self.sites.items() if site.layer == INPUT)
        self._positional = {spec: self.sites[spec].paths is None for spec in self._inputs}
        self._packable = packing.may_pack(model)
        self._global = crosses_ranks(mixer)
        # the skippable extension points it overrides: its class's, or this mixer's own attributes
        self._extended = mixer.overridden | (SKIPPABLE & vars(mixer).keys())
        self._checks_leaves = "check_leaves" in self._extended and not (
            mixer.checks_by_signature and "check_leaves" not in vars(mixer)
        )  # (whether the cheap case runs it: a check that depends on the signature ran when it was planned)
        self._before = "before_forward" in self._extended
        self._begins = self._before or self._policies is not None
        self._before_mix = "before_mix" in self._extended
        self._draws_later = mixer.draws_in_mix
        self._recomputed = frozenset(mixer.computed_each_forward)
        self.sharded = sharded(model)
        handles.append(
            model.register_forward_pre_hook(recompute.own_code(self._on_model_input), with_kwargs=True)
        )
        guard_unwrapped(mixer, model, handles)
        for spec, module in modules.items():
            if spec not in self._inputs:
                handles.append(module.register_forward_hook(self._layer_hook(spec)))
        takes_masks = self._padding == "union" and self._masks.register(model, handles)
        if self._clean and (mixer.batch_norm_apart or (policies is not None and policies.batch_norm_apart)):
            self._norms.register(model, handles)
        handles.append(model.register_forward_hook(recompute.own_code(self._on_model_output)))
        self.traced = mixer.traceable and not takes_masks

    def reset(self) -> None:
        """Removed: nothing of the model, its modules or a forward's tensors stays (the record of recent
        forwards does: a loss on logits of a forward made while attached still binds to its mix)."""
        self.current = None
        self.last_forward = None
        self.model = None
        self.site_leaves = None
        self._modules = {}
        self.given, self.targets = {}, None

    # --------------------------------------------------- the state the mixer's user API reads and sets

    def pin(self, pins: Pins | None) -> None:
        """What the next training forward uses (``pin()``, ``pin_last()``, ``skip_next()``; ``None``:
        nothing, ``unpin()``)."""
        self.pins = pins

    def use_targets(self, targets: torch.Tensor | None) -> None:
        """The next training forward's labels (``use_targets()``), forgotten when it starts."""
        self.targets = targets

    def give(self, name: str, value) -> None:
        """A value the next training forward's policies read (``use_features()``, ``use_partners()``)."""
        self.given[name] = value

    def relabel(self, state: MixState) -> None:
        """The last forward's record as a method re-weighs it after its mix, before the model's output is
        marked with it (TransMix's labels from the attention, SUMix's uncertainty)."""
        self.last = state

    def kept(self) -> dict:
        """What a copy of the mixer keeps of this path (a copy starts detached): the next forward's pins and
        the last forward's record, not the forward under way, the model or the plans."""
        return {"pins": self.pins, "last": self.last, "last_forward": self.last_forward}

    def keep(self, kept: dict) -> None:
        """A copy's path: what :meth:`kept` returned of the original's."""
        self.pins, self.last, self.last_forward = kept["pins"], kept["last"], kept["last_forward"]

    def _under_way(self) -> Forward | None:
        """The training forward under way (what the padding masks and the norms follow)."""
        return self.current

    # ------------------------------------------------------------- 1. the model's pre-hook: decide

    def _way(self, training: bool) -> int:
        """Which way a call of any of the three hooks goes (``training``: the model's mode): 0, an eager
        forward's own; ``_REPLAY``, a recomputation in backward (activation checkpointing:
        :func:`mixhook.recompute.in_backward`); ``_GRADIENTS``, :meth:`gradient_at`'s own pass;
        ``_TRACED``, the one-graph path torch.compile traces (:mod:`.traced`); ``_BETWEEN``, a training
        forward's hook under torch.compile for a mixer it does not trace, run as one eager call between
        graphs. The one dispatch of the three hooks: each says what it does on each way."""
        compiling = _compiling()
        if not compiling and _graph_task() != -1:
            return _REPLAY
        if self.gradients.running:
            return _GRADIENTS
        if not compiling:
            return 0
        if self.traced:
            return _TRACED
        return _BETWEEN if training else 0

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict):
        """A forward of the model begins: in training, decide whether it mixes and where, and start it (a
        mix at the model's input is made here, on the one path: :meth:`_mix`)."""
        way = self._way(model.training)
        if way:
            if way == _REPLAY:
                return self._replay_input(model, args, kwargs)
            if way == _GRADIENTS:
                return self.gradients.input(model, args, kwargs)
            if way == _TRACED:
                return self._compiled.begin(model, args, kwargs)
            return _between_graphs(Path._on_model_input)(self, model, args, kwargs)
        if not model.training:
            self.current = None
            self.given = {}
            return None
        return self._start(model, args, kwargs)

    def _start(self, model: nn.Module, args: tuple, kwargs: dict):
        """:meth:`_on_model_input` in an eager training forward: refuse what no mix could be exact for,
        decide (:meth:`_decide`), note the batch size the mixed layer's must be, let the method compute what
        it needs first, and mix the model's input where this forward mixes there."""
        if self._packable or _proxy_mode(_PROXY) is not None:
            self._refuse_call(model, args, kwargs)
        reading = self.site_leaves
        first = args[0] if args else None  # (the usual call: the model's input first, positionally)
        if reading.reads_sides:
            reading.input_sides = reading.input_grid(args, kwargs)
        targets = self.targets  # (this forward's: the forward started forgets them)
        forward = self._decide()
        if forward is not None:  # the model input's batch size, which the mixed layer's must be
            dim = reading.input_dim  # (a keyword call: the model's first parameter, by signature)
            usual = type(first) is torch.Tensor and dim is not None and first.ndim > dim
            forward.batch = first.shape[dim] if usual else reading.reference_batch(model, args, kwargs)
        changed = None
        if self._begins:  # the method or its policies compute something first
            changed = self._begin(model, args, kwargs, forward, targets)
            args, kwargs = (args, kwargs) if changed is None else changed
        if forward is None or forward.layer not in self._inputs:
            return changed
        return self._mix_input(model, args, kwargs, forward)

    def _refuse_call(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Refuse, in one line, a training call that no mix could be exact for: a packed batch
        (:func:`mixhook.packing.refuse`), or a trace by make_fx (``torch.compiler.precompile``, a
        non-strict export), whose artifact would replay this one forward's draws at every call."""
        if _proxy_mode(_PROXY) is not None:
            raise RuntimeError(
                f"{self.kind}: the model is being traced by make_fx (torch.compiler.precompile, or "
                "a non-strict torch.export) in training mode: each training forward draws its own mix, "
                "which the traced artifact would replay as this one draw at every call; compile with "
                "torch.compile(model) (or model.compile()), or trace the model in eval mode"
            )
        packing.refuse(self.kind, model, args, kwargs)

    def _decide(self, training: bool = True) -> Forward | None:
        """A forward begins (eager, or in a compiled graph; ``training``: one that may mix): whether it
        mixes, and where (pinned values win; a pinned forward always mixes; with partners from every rank,
        rank 0 decides), made the mixer's current forward. A compiled forward before it is settled first
        (its record must not take this forward's mix)."""
        forward = None
        mixer = self.mixer
        if training:
            if _distributed():  # (a default generator, reseeded for its rank once)
                self._seed()
            pins, self.pins = self.pins, None
            g = mixer.generator
            if pins is None and (
                mixer.prob >= 1.0 or float(torch.rand((), generator=g, device=g.device)) < mixer.prob
            ):
                pins = NO_PINS
            if pins is not None and not pins.skip:
                forward = Forward(self._layer_of(pins), pins)
            if self._global:
                forward = mixer.agree(forward)
        seen = self.seen
        if seen.begun or seen.pending is not None:
            seen.settle()
        self.last = None
        self.last_forward = None  # (what pin_last would have repeated: no longer the last forward)
        self.targets = None
        self.current = forward
        if self._masks.active:
            self._masks.begin()
        return forward

    def _layer_of(self, pins: Pins) -> str:
        """The site a mixing forward mixes: the pinned one, else one drawn from the mixer's generator (by the
        layers' weights, or uniformly among them)."""
        layer = pins.layer
        if layer is not None:
            return layer if layer in self.sites else self._site(layer, "pin")  # (pinned by its spec)
        g, k, weights = self.mixer.generator, 0, self.mixer.site_weights
        if weights is not None:
            weights = torch.tensor(weights, dtype=torch.float64, device=g.device)
            k = int(torch.multinomial(weights, 1, generator=g))
        elif len(self.layers) > 1:
            k = int(torch.randint(len(self.layers), (), generator=g, device=g.device))
        return self.layers[k]

    def _begin(self, model: nn.Module, args: tuple, kwargs: dict, forward: Forward | None, targets):
        """What the method or its policies compute at a training forward's start, before any mix (a
        gradient pass, a partner batch appended to the model's input): the model's changed arguments, or
        ``None``."""
        if forward is not None and self._before:
            mixer = self.mixer
            extra = mixer.before_forward(
                model, args, kwargs, forward.layer, forward.pins.given, targets, mixer.generator
            )
            if extra:
                forward.pins = forward.pins.joined(extra)
        if self._policies is None:
            return None
        given, self.given = self.given, {}
        dim = self.site_leaves.input_dim or 0
        changed = self._policies.begin(self.mixer, model, args, kwargs, forward, targets, given, dim)
        if changed is not None:  # (a partner batch appended to the model's input)
            forward.batch = self.site_leaves.reference_batch(model, *changed)
        return changed

    def _mix_input(self, model: nn.Module, args: tuple, kwargs: dict, forward: Forward):
        """A mix at the model's input, on the one path (:meth:`_mix`): the model's arguments with it made
        (and their padding masks unioned, where the model takes them)."""
        spec = forward.layer
        if self._positional[spec] and args and type(args[0]) is torch.Tensor:  # (the usual call)
            args = (self._mix(spec, args[0], forward)[0], *args[1:])
            if self._padding == "union" and (kwargs or len(args) > 1):  # (a lone input takes no mask)
                return self._input_masks(model, args, kwargs, spec, self.last)
            return args, kwargs
        inputs = Inputs(model, args, kwargs)
        value, state = self._mix(spec, inputs, forward)
        args, kwargs = rebuild_inputs(inputs, self.sites[spec], value)
        return self._input_masks(model, args, kwargs, spec, state)

    def _input_masks(self, model, args: tuple, kwargs: dict, spec: str, state: MixState, again=False):
        """The model's arguments after a mix at its input, with their padding masks unioned
        (``padding="union"``: :meth:`~.padding_masks.PaddingMasks.at_input`)."""
        if self._padding != "union":
            return args, kwargs
        return self._masks.at_input(model, args, kwargs, spec, state, again)

    # ------------------------------------------------------------------ 2. the mixed layer: mix

    def _layer_hook(self, spec: str):
        """The forward hook of the layer at ``spec``: the mix where this forward mixes there, its replay in
        a recomputation."""

        def hook(module: nn.Module, args: tuple, output):
            way = self._way(self.model.training)
            if way:
                if way == _REPLAY:
                    return self._replay_layer(spec, output)
                if way == _GRADIENTS:
                    return self.gradients.layer(spec, output)
                if way == _TRACED:
                    return self._compiled.mix(spec, output) if module.training else None
                return _between_graphs(hook)(module, args, output)
            forward = self.current
            if forward is None or forward.mixed is not None or forward.layer != spec:  # it mixes elsewhere
                if self.model.training and _may_be_recomputed():
                    self._note(spec)  # (what a recomputation of this layer must know: it mixed nothing)
                return None
            return self._mix(spec, output, forward)[0]  # (self.last set)

        return recompute.own_code(hook, f"{self.kind}_layer_hook")

    def _mix(self, spec: str, value, forward: Forward):
        """The one path of a mix, for every method and site: what ``spec`` returned (for the model's input,
        its first argument, or its :class:`Inputs`) mixed as ``forward`` decided, and the
        :class:`MixState`, in the order the method meets it:

        1. its leaves: a plain tensor with the signature of the site's :class:`~.leaves.Plan` is taken as
           planned (the cheap case, chosen here at the top); anything else is read, checked and planned
           again (:meth:`_read`), as a fresh mixer reads it;
        2. what the method and its policies compute before the mix (:meth:`_before_mixing`);
        3. lam and the partners drawn (or pinned), and what a repeat needs kept (``pin_last``, a
           recomputation under activation checkpointing, which walks this path again with
           ``forward.replay``: nothing drawn anew, computed first or recorded);
        4. the method's :meth:`mix`, checked;
        5. the record (:class:`MixState`), and the mixed tensors put back where the site had them
           (:meth:`_put_back`)."""
        plan, site_value, found, given, n = self._leaves(spec, value, forward)  # 1.
        if self._policies is not None or (self._before_mix and not forward.replay):  # 2.
            site_value, found, given, n = self._before_mixing(spec, (site_value, found, given, n), forward)
            plan = None if given[0].tensor is not value else plan  # (rows appended: put back in general)
        draw, mixed = self._draw_and_mix(spec, n, found, given, forward)  # 3. and 4.
        if plan is None:  # 5.
            tensors, state = self._put_back(spec, found, given, draw, mixed)
        else:
            tensors, state = self._as_planned(spec, plan, value, given, draw, mixed)
        if self._clean or self._policies is not None:
            before = None if mixed.before is None else self._rows_before(spec, found, given, draw, mixed)
            tensors, state = self._finish(found, tensors, state, before)
        elif mixed.before is not None:  # (refused: rows before the mix need the clean rows)
            self._rows_before(spec, found, given, draw, mixed)
        self._done(forward, state)
        return (
            tensors[()] if type(site_value) is torch.Tensor else replace_leaves(site_value, tensors)
        ), state

    def _leaves(self, spec: str, value, forward: Forward) -> tuple:
        """:meth:`_mix`'s step 1: ``(plan, site value, found, given, n)``: the site's plan where ``value``
        is one tensor with its signature (the cheap case, taken as planned), else ``None`` and the leaves
        read, checked and planned again (:meth:`_read`); the leaves found, as the method is given them
        (a channels-last map as its channels-first view), and the batch size."""
        reading = self.site_leaves
        plan = reading.plans.get(spec)
        batch = forward.batch
        if not (  # the cheap case: one tensor, as planned
            plan is not None
            and type(value) is torch.Tensor
            and plan.signature
            == (value.shape, value.stride(), value.dtype, value.device, reading.input_sides)
            and (batch is None or value.shape[plan.dim] == batch)
        ):
            return (None, *self._read(spec, value, forward))
        found = [Leaf((), value, plan.dim)]
        given = [Leaf((), channels_first(value, CHANNELS_LAST[value.ndim]), 0)] if plan.view else found
        if self._checks_leaves:
            self.mixer.check_leaves(spec, given)
        return plan, value, found, given, value.shape[plan.dim]

    def _draw_and_mix(self, spec: str, n: int, found: list[Leaf], given: list[Leaf], forward: Forward):
        """:meth:`_mix`'s steps 3 and 4: ``(draw, mixed)``: lam and the partners drawn (or pinned, or the
        forward's own in a replay) with what a repeat needs kept, and the method's :meth:`mix` of
        ``given``."""
        pins, mixer = forward.pins, self.mixer
        generator = mixer.generator if pins.state is None else self._replaying(pins.state)
        drawn = None
        if not forward.replay:
            drawn = self._repeatable(spec, n, forward, generator)
            if _may_be_recomputed():
                self._note(spec, forward.repeat)
        if self._clean or self._masks.active or found[0].tensor.is_cuda:
            self._check_apply(spec, found, n)
        if generator is not mixer.generator or self._policies is not None:
            return self.drawing(spec, n, pins, generator, mixer.mix, given, drawn)
        draw = drawn if drawn is not None else self._draws(spec, n, pins, generator)  # (the usual mix)
        return draw, mixer.mix(given, draw)

    def _as_planned(self, spec: str, plan, value: torch.Tensor, given: list[Leaf], draw: Draw, mixed: Mixed):
        """:meth:`_mix`'s step 5 in the cheap case: the mixed tensor (laid out as the site's) and the
        :class:`MixState`, once ``mixed`` gives one tensor of the leaf's shape (else
        :meth:`_check_mixed` refuses it, in one line)."""
        t = mixed.tensors.get(()) if type(mixed) is Mixed and len(mixed.tensors) == 1 else None
        if t is None or t.shape != given[0].tensor.shape:  # (what _check_mixed refuses, said by it)
            t = self._check_mixed(spec, given, mixed)[()]
        state = self._state(spec, _PLAIN, (plan.dim,), (value.shape,), draw, mixed, self._clean)
        return {(): channels_last(t) if plan.view else t}, state

    def _read(self, spec: str, value, forward: Forward) -> tuple:
        """:meth:`_mix`'s step 1 where its plan does not hold: the site's value in ``value``, its leaves
        found and as the method is given them, and the batch size, read, checked and planned again
        (:meth:`SiteLeaves.leaves`)."""
        reading = self.site_leaves
        site_value = reading.value(spec, value) if type(value) is Inputs else value  # (the model's input)
        return (site_value, *reading.leaves(spec, site_value, forward.batch))

    def _before_mixing(self, spec: str, leaves: tuple, forward: Forward) -> tuple:
        """:meth:`_mix`'s step 2: the site's ``(value, found, given, n)`` with a policy's rows appended (a
        memory bank's partners), and what the method (``before_mix``) and its policies compute before the
        mix joined to the forward's pins (so that a recomputation and ``pin_last`` reuse it: a replay
        computes nothing again)."""
        policies = self._policies
        if policies is not None:
            leaves = policies.extend(spec, leaves, forward.pins.given)
        if forward.replay:
            return leaves
        if self._before_mix:
            extra = self.mixer.before_mix(spec, leaves[2], forward.pins.given, self.mixer.generator)
            if extra:
                forward.pins = forward.pins.joined(extra)
        if policies is not None:
            extra = policies.before_mix(self.mixer, spec, leaves[2], forward.pins.given)
            if extra:
                forward.pins = forward.pins.joined(extra)
        return leaves

    def _finish(self, found: list[Leaf], tensors: dict, state: MixState, before: dict | None = None):
        """The mixed tensors with the clean rows before them (``clean``: along each tensor's batch
        dimension; ``before``: the method's own rows between the two, :attr:`Mixed.before`), and a partner
        batch's rows dropped (a policy's)."""
        if self._clean and before is None:
            tensors = {leaf.path: torch.cat([leaf.tensor, tensors[leaf.path]], leaf.dim) for leaf in found}
        elif self._clean:
            tensors = {
                leaf.path: torch.cat([leaf.tensor, before[leaf.path], tensors[leaf.path]], leaf.dim)
                for leaf in found
            }
            state = dataclasses.replace(state, groups=2)
        if self._policies is not None:
            tensors, state = self._policies.finish(found, tensors, state)
        return tensors, state

    def _rows_before(self, spec: str, found: list[Leaf], given: list[Leaf], draw: Draw, mixed: Mixed) -> dict:
        """A method's rows before its mixed ones (:attr:`Mixed.before`), checked and put back as the mixed
        tensors are (refused in one line without the clean rows, which they follow)."""
        if not self._clean:
            raise RuntimeError(
                f"{self.kind} at {spec!r} put rows before its mix, which follow the clean rows: "
                "set clean=True"
            )
        return self._put_back(spec, found, given, draw, Mixed(mixed.before))[0]

    def _put_back(self, spec: str, found: list[Leaf], given: list[Leaf], draw: Draw, mixed: Mixed):
        """:meth:`_mix`'s step 5 where no plan held: the mixed tensors, checked, as the site had them (a
        token grid's maps into their tokens, channels-first views into their channels-last maps), and the
        :class:`MixState`."""
        tensors = self._check_mixed(spec, given, mixed)
        state = self._state_of(spec, found, draw, mixed, self._clean)
        if self._token_grid is not None:
            grid, index, permutation = self._token_grid, draw.index, draw.permutation
            return {
                f.path: grid.from_map(f, tensors[f.path], state.lam, index, permutation) for f in found
            }, state
        if given is not found:  # channels-last maps were given as their channels-first views
            restore = self.site_leaves.restore
            return {f.path: restore(spec, f, tensors[f.path], None, None) for f in found}, state
        return tensors, state

    def _repeatable(self, spec: str, n: int | None, forward: Forward, generator: torch.Generator):
        """Make ``forward``'s mix at ``spec`` repeatable (``pin_last``, a recomputation): for a method that
        draws in :meth:`mix`, keep the generator's state before it (and return ``None``: nothing drawn
        yet); else draw lam and the index of the ``n`` samples now (the :class:`Draw`), keep and return
        it."""
        if self._draws_later:  # (draws_in_mix, read when attached)
            forward.state = generator.get_state()
            return None
        forward.drawn = self._draws(spec, n, forward.pins, generator)
        return forward.drawn

    def _done(self, forward: Forward, last: MixState) -> None:
        """``forward`` mixed ``last``: kept for ``pin_last``, and recorded for ``loss()`` (eager here, or
        in ``mixhook::draw`` for a forward a compiled graph began)."""
        if forward.replay:  # (a recomputation's mix was recorded by its forward)
            return
        self.last_forward = forward
        forward.mixed = last
        self.last = last
        if self.seen.begun:  # (a compiled forward: kept without the loss's graph pieces)
            self.last = self.seen.mixed(last)

    # ------------------------------------------------------------ 3. the model's output hook: mark

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        """A forward of the model ends: mark its output with what it mixed (``loss()`` reads it)."""
        way = self._way(model.training)
        if way:  # (a recomputation or gradient_at()'s pass: nothing to record)
            if way == _TRACED:
                self.seen.pending = output  # (bound to its forward's record after the graph: .traced)
            elif way == _BETWEEN:
                _between_graphs(Path._on_model_output)(self, model, args, output)
            return
        forward, self.current = self.current, None
        if forward is None:
            self.seen.record(output, None)
            return
        if forward.mixed is None:
            raise RuntimeError(self._did_not_run(model, forward.layer))
        state = self.last  # (a method may re-weigh it after the mix: TransMix, relabel)
        if state.clean:
            _check_doubled(model, output, state)
        # the output carries the whole state to loss(); the path keeps it without the loss's graph pieces
        self.last = self.seen.record(output, state)
        if state.loss_inputs is not None or self._recomputed:  # (what pin_last repeats, kept lean)
            self.last_forward = forward.kept(self._recomputed)

    def _did_not_run(self, model: nn.Module, spec: str) -> str:
        """Why layer ``spec`` did not run in a training forward that was to mix it (one line)."""
        replaced = self._replaced(model, spec)
        if replaced:
            return f"mixup layer {spec!r} did not run during {type(model).__name__}.forward(): {replaced}"
        return (
            f"mixup layer {spec!r} did not run during {type(model).__name__}.forward(), so nothing was "
            "mixed; choose a layer that forward() calls. (Under torch.compile: attach before compiling, and "
            "if hooks changed after compiling, or another instance of this class was compiled without them, "
            "set torch._dynamo.config.skip_nnmodule_hook_guards = False before compiling.)"
        )

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

    # --------------------------------------------- a recomputation by activation checkpointing: replay

    def _replay_input(self, model: nn.Module, args: tuple, kwargs: dict):
        """In a recomputation of the whole model: its input's mix again, on the one path (:meth:`_mix`)."""
        if self.gradients.running:
            return None
        for spec in self._inputs:
            pins = self._replayed(spec)
            if pins is not None:
                inputs = Inputs(model, args, kwargs)
                value, state = self._mix(spec, inputs, Forward(spec, pins, replay=True))
                args, kwargs = rebuild_inputs(inputs, self.sites[spec], value)
                return self._input_masks(model, args, kwargs, spec, state, again=True)
        return None

    def _replay_layer(self, spec: str, output):
        """In a recomputation: the forward's mix at ``spec`` again, on the one path (:meth:`_mix`)."""
        pins = None if self.gradients.running else self._replayed(spec)
        if pins is None:
            return None
        return self._mix(spec, output, Forward(spec, pins, replay=True))[0]

    def _replaying(self, state: torch.Tensor | None) -> torch.Generator:
        """The generator a mix draws from: the mixer's own, or for a repeat (``pin_last``, a
        recomputation) a copy in the repeated mix's ``state`` (``None``: the mix drew nothing beyond lam
        and the index, which are repeated as pinned values)."""
        own = self.mixer.generator
        return own if state is None else recompute.replay_generator(own, state)

    # ------------------------------------------------------------------ the checks and draws of a mix

    def _check_apply(self, spec: str, found: list[Leaf], n: int) -> None:
        """Refuse, in one line, a mix :meth:`_mix` cannot make exact: clean rows of a batch of one, a CUDA
        graph being captured, a ``(B, L, C)`` sequence cut by position where the model takes padding masks."""
        if self._clean and n < 2:
            raise ValueError(
                f"{self.kind}(clean=True) at {spec!r}: a batch of {n} has no partner to mix with; "
                "the clean+mixed batch needs at least 2 samples"
            )
        if found[0].tensor.is_cuda:
            refuse_capture(self.kind, spec, found[0].tensor.device)
        if (
            self._masks.active
            and self._token_grid is None  # (a token grid cuts patches, and keeps the leading tokens' rule)
            and found[0].tensor.ndim == 3
            and self.site_leaves.channels_last(spec, found[0])
        ):
            raise ValueError(
                f"{self.kind} at {spec!r} cuts the positions of a (B, L, C) sequence, and the "
                "model takes padding masks: their union (padding='union') would call a pasted position valid "
                "by the wrong sample's mask; blend the sequence instead (ManifoldMixup), or pass "
                "padding='keep' to hand the model its own masks unchanged"
            )

    def drawing(
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
        of lam and the index, made already by :meth:`_repeatable`). Where ``generator`` is not the mixer's
        own (a repeat's copy, ``draw_for``'s), a method that drew from its own instead is refused in one
        line: its repeat would not draw the same."""
        own = self.mixer.generator
        before = None if generator is own else own.get_state()
        draw = drawn if drawn is not None else self._draws(spec, n, pins, generator)
        if self._policies is None:
            mixed = method(leaves, draw)
        else:  # lam warped per pair, pair weights: what the mix uses and records
            draw, info = self._policies.adjust(draw, leaves, self._masks.active)
            mixed = method(leaves, draw)
            if info:
                mixed = dataclasses.replace(mixed, info={**mixed.info, **info})
        if before is not None and not torch.equal(before, own.get_state()):
            raise RuntimeError(
                f"{self.kind}.{method.__name__}() at {spec!r} drew from the mixer's own generator, not "
                "draw.generator: a repeat (pin_last, an activation-checkpoint recomputation, draw_for) would "
                "not draw the same; draw every value from draw.generator"
            )
        return draw, mixed

    def _draws(self, spec: str, n: int, pins: Pins, generator: torch.Generator) -> Draw:
        """The :class:`Draw` of a mix of ``n`` samples at ``spec``: lam and the partner index (pinned, else
        drawn from ``generator``), and whether the index is a permutation of the batch."""
        if self._policies is not None:
            drawn = self._policies.draws(self.mixer, spec, n, pins, generator)
            if drawn is not None:
                return drawn
        lam, mixer = pins.lam, self.mixer
        if lam is None:
            lam = mixer.sample_lam(n, generator)
            if type(lam) is not torch.Tensor or lam.dtype != torch.float64:
                lam = torch.as_tensor(lam, dtype=torch.float64)
        elif lam.ndim == 1 and lam.shape[0] != n:
            raise ValueError(f"pinned lam has {lam.shape[0]} values but the batch at layer {spec!r} has {n}")
        weight = weight_of(lam)
        index = pins.index
        if index is None:
            index = mixer.draw_index(n, generator)
            permutation = mixer.index_is_permutation and (not self._global or mixer.partner_pool(n) == n)
            return Draw(spec, lam, index, generator, pins.given, permutation, weight)
        pool = mixer.partner_pool(n) if self._global else n
        low, high = pins.span
        if index.shape[0] != n or (n and (low < -pool or high >= pool)):
            where = f"the batch of {n}" if pool == n else f"{pool} partners for a batch of {n}"
            raise ValueError(
                f"pinned index of length {index.shape[0]} (values {index.tolist()[:8]}...) "
                f"does not index {where} at layer {spec!r}"
            )
        if low < 0:  # counted from the end, as indexing counts them
            index = torch.where(index < 0, index + pool, index)
        return Draw(spec, lam, index, generator, pins.given, pool == n and pins.permutation, weight)

    @classmethod
    def _state_of(cls, spec: str, found: list[Leaf], draw: Draw, mixed: Mixed, clean=False) -> MixState:
        """:meth:`_state` of the leaves ``found`` (names, batch dimensions and shapes read off them)."""
        names = tuple([leaf.name for leaf in found])
        dims, shapes = tuple([leaf.dim for leaf in found]), tuple([leaf.tensor.shape for leaf in found])
        return cls._state(spec, names, dims, shapes, draw, mixed, clean)

    @staticmethod
    def _state(spec: str, names: tuple, dims: tuple, shapes: tuple, draw: Draw, mixed: Mixed, clean=False):
        """The :class:`MixState` of a mix at ``spec`` of the elements ``names`` (their batch dimensions
        ``dims`` and shapes), drawn ``draw``, as ``mixed`` says (``clean``: the clean rows kept before it)."""
        own, given = mixed.lam is None, mixed.lam
        lam = draw.lam if own else torch.as_tensor(given, dtype=torch.float64)
        weight = draw.weight if own else given  # (one lam on the CPU as a float: what loss() weighs by)
        if type(weight) is not float:
            weight = weight_of(lam)
        index = draw.index if mixed.index is None else mixed.index
        mixture = mixed.mixture
        if mixture is not None:
            mixture = checked_mixture(spec, mixture, index.shape[0])
        state = MixState(
            spec,
            lam,
            index,
            dict(mixed.info) if mixed.info else {},
            names,
            dims,
            mixed.weights,
            shapes,
            clean,
            mixed.partner_lam,
            mixture=mixture,
            loss_inputs=mixed.loss_inputs,
        )
        state.__dict__["weight"] = weight  # (MixState.weight, made with lam: no read of it again)
        return state

    def _check_mixed(self, spec: str, leaves: list[Leaf], mixed: Mixed) -> dict:
        """``mixed.tensors``, once it gives every leaf a tensor of the leaf's shape (a method that skipped
        one would leave it silently unmixed)."""
        kind = self.kind
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

    # ---------------------------------------------- what the collaborators are given (see __init__)

    def _captured_leaves(self, spec: str, value) -> tuple:
        """For the gradient pass: the site's value in ``value`` and the leaves that carry its batch."""
        reading = self.site_leaves
        site_value = reading.value(spec, value)
        return site_value, reading.leaves(spec, site_value)[0]

    def _as_given(self, spec: str, leaf: Leaf, model: nn.Module) -> torch.Tensor:
        """``leaf``'s tensor as :meth:`mix` is given it (:meth:`SiteLeaves.as_given`)."""
        return self.site_leaves.as_given(spec, leaf, model)

    def _read_input(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
        """A training forward's input, read under torch.compile as an eager forward reads it: its sides
        (the map checks) and its batch size, where the model tells it."""
        reading = self.site_leaves
        reading.input_sides = reading.input_grid(args, kwargs)
        return reading.reference_batch(model, args, kwargs)

    def _unplanned(self, spec: str, value) -> tuple:
        """The site's value in ``value``, the leaves found and given and the batch size, without the plans
        (traced code neither reads nor writes them)."""
        reading = self.site_leaves
        site_value = reading.value(spec, value)
        return (site_value, *reading.leaves(spec, site_value, None, plan=False))

    def _restore(self, spec: str, leaf: Leaf, t: torch.Tensor, weight, index) -> torch.Tensor:
        """A mixed tensor of ``leaf`` given to the method as a view, put back (:meth:`SiteLeaves.restore`)."""
        return self.site_leaves.restore(spec, leaf, t, weight, index)

    def _host_begin(self, training: bool, batch: int | None) -> int:
        """``mixhook::begin`` (:mod:`.traced`): the previous compiled forward's output bound to its record,
        this forward's record opened, and (training) its decision made as an eager forward makes it; the
        chosen layer's position (-1: none)."""
        forward = self._decide(training)
        self.seen.open(None if forward is None else forward.layer)
        if forward is None:
            return -1
        forward.batch = batch
        return self.layers.index(forward.layer)

    def _host_draw(self, spec: str, n: int, found: list, given: list, device: torch.device):
        """``mixhook::draw`` at ``spec`` (:mod:`.traced`): ``None`` unless this forward mixes there; then
        the values :meth:`draw_traced` draws and the :class:`MixState`, drawn and kept as :meth:`_mix`
        draws and keeps an eager mix."""
        forward = self.current
        if forward is None or forward.done or forward.layer != spec:
            return None
        refuse_capture(self.kind, spec, device)
        if forward.batch is not None and n != forward.batch:
            raise TypeError(
                f"{self.kind} at {spec!r}: its batch dimension has size {n}, but the model's input "
                f"has a batch of {forward.batch}: the layer loses or reshapes the batch dimension; choose "
                "another layer, or pass batch_dim"
            )
        generator = self._replaying(forward.pins.state)
        drawn = self._repeatable(spec, n, forward, generator)
        d, (values, mixed) = self.drawing(
            spec, n, forward.pins, generator, self.mixer.draw_traced, given, drawn
        )
        self._done(forward, self._state_of(spec, found, d, mixed))
        return values, self.last


def _check_doubled(model: nn.Module, output, state: MixState) -> None:
    """Refuse a clean+mixed forward whose output (a plain tensor) has no dimension of ``2B``: the model
    lost the doubled batch downstream of the mix (e.g. a ``view(B, ...)`` with the batch size read from its
    input), so its rows would not be the clean samples and their mixes."""
    n, rows = state.index.shape[0], (1 + state.groups) * state.index.shape[0]
    if isinstance(output, torch.Tensor) and output.ndim and rows not in output.shape:
        raise RuntimeError(
            f"{type(model).__name__} returned shape {tuple(output.shape)} after a clean+mixed mix at "
            f"{state.layer!r}, which emitted {rows} rows (the {n} clean samples, then their mixes): the "
            "model reshapes by the batch size of its input downstream of that layer; mix a later layer, or "
            "use clean=False"
        )
