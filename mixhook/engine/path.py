"""One training forward of a mixer, hop by hop: the hooks a :class:`~mixhook.engine.mixer.Mixer` registers
and the path a forward takes through them.

1. **The model's pre-hook** (:meth:`MixerHooks._on_model_input`) decides whether this forward mixes, and
   at which layer: one :class:`~.forward.Forward` (its layer and pins; lam, the partners and the
   generator's state for a repeat once drawn), the only object a forward carries.
2. **The mixed layer's hook** (:meth:`MixerHooks._layer_hook`) draws lam and the partners (or reads the
   pins), hands the layer's output to the method's ``mix()`` and records the
   :class:`~.contract.MixState`. A layer that returned a plain tensor as before takes the short path
   (:meth:`MixerHooks._mix_plain`); structured outputs, layouts, token grids, clean rows, policies and
   methods that draw in ``mix()`` take the general one (:meth:`MixerHooks._mix_now`, :meth:`_apply`).
3. **The model's output hook** (:meth:`MixerHooks._on_model_output`) marks the output with what was mixed
   (:mod:`.binding`), which ``loss()`` reads (:mod:`.targets`).

What depends only on the model and its sites is worked out once, when the mixer is attached
(:meth:`MixerHooks._register`: the sites' leaves and layouts, :mod:`.leaves`; whether the model can be
given a packed batch; which hops a forward of this method can skip); what depends on a layer's output
signature is planned at its first forward (:attr:`~.leaves.SiteLeaves.plans`). A recomputation under
activation checkpointing reaches the same hooks during backward and replays what the forward noted
(:mod:`mixhook.recompute`); under ``torch.compile`` a traced mixer's hooks take the one-graph path
(:mod:`.traced`); a gradient-saliency method's own pass goes to :mod:`.gradient_pass`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import packing, recompute
from ..functional import weight_of
from ..hooks import LayerHook, guard_unwrapped
from ..sites import INPUT, Inputs, Leaf, rebuild_inputs, replace_leaves
from .binding import Forwards
from .contract import Draw, Mixed, MixState, claim, unclaim
from .forward import NO_PINS, Forward, Pins
from .gradient_pass import GradientPass, sharded
from .leaves import SiteLeaves
from .padding_masks import PaddingMasks
from .partners import crosses_ranks
from .traced import TracedPath, refuse_capture

_compiling = torch.compiler.is_compiling
_graph_task = torch._C._current_graph_task_id  # -1 outside a backward: see recompute.in_backward
_saved_hooks = recompute.saved_tensor_hooks
_distributed = torch.distributed.is_initialized if torch.distributed.is_available() else bool
_PLAIN = ("[]",)  # the elements of a plain tensor (MixState.elements)
# the extension points whose default does nothing, which a forward skips where a method keeps the default
# (the class's Mixer._overrides, or the mixer's own attribute, read when it is attached)
SKIPPABLE = frozenset(("check_leaves", "before_forward", "before_mix"))


def _between_graphs(hook):
    """``hook`` as torch.compile leaves it: called as it is, between graphs. For a mixer that is not traced
    (:attr:`~.mixer.Mixer.traced`), whose hooks dynamo would otherwise trace op by op, each of their draws a
    graph break to resume after. Made when first compiled (so that importing or attaching mixhook does not
    import torch._dynamo) and kept on the hook's function, which it lives as long as."""
    wrapped = getattr(hook, "between_graphs", None)
    if wrapped is None:
        wrapped = hook.between_graphs = torch.compiler.disable(hook)
    return wrapped


class MixerHooks(LayerHook):
    """The hooks of a :class:`~mixhook.engine.mixer.Mixer` and the path of one training forward through
    them (see the module's docstring). The extension points it calls (``mix``, ``sample_lam``,
    ``draw_index``, ``check_leaves``, ``before_forward``, ``before_mix``) are the mixer's."""

    _hooks_model = True  # its own hooks on the model (see LayerHook)
    _TRANSIENT = (
        "_current", "_targets", "_seen", "_site_leaves", "_traced", "_modules", "_masks", "_gradients",
        "_compiled", "_plain", "_given", "_inputs", "_packable", "_global", "_checks_leaves", "_before",
        "_begins", "_extended",
    )  # fmt: skip

    def _fresh(self) -> None:
        super()._fresh()
        self._current: Forward | None = None  # the training forward under way
        self._targets: torch.Tensor | None = None  # use_targets(): the next forward's labels
        self._seen = Forwards(self)  # the recent forwards, and which one produced given logits
        self._given: dict = {}  # use_features() / use_partners(): the next training forward's
        # the collaborators: padding masks downstream of a mix, the gradient pass, the one-graph path
        self._masks = PaddingMasks(self, self._note, self._replayed)
        self._gradients = GradientPass(type(self).__name__, self.sites, self._captured_leaves, self._as_given)
        self._compiled = TracedPath(self, self._read_input, self._unplanned, self._restore, self._host_begin,
                                    self._host_draw)  # fmt: skip
        # what is worked out when attached (_register)
        self._site_leaves: SiteLeaves | None = None  # the sites' leaves, layouts and plans
        self._modules: dict[str, nn.Module] = {}  # the modules attached to, by spec
        self._inputs: tuple[str, ...] = ()  # the specs of the model's input
        self._traced = False  # whether torch.compile traces the one-graph path
        self._plain = False  # whether a planned plain tensor takes the short path (_mix_plain)
        self._packable = False  # whether the model can be called with a packed batch (checked per forward)
        self._global = False  # whether the partners come from every rank (the ranks agree per forward)
        self._extended: frozenset[str] = frozenset()  # the SKIPPABLE extension points it overrides
        self._checks_leaves = False  # whether the method checks its leaves (check_leaves overridden)
        self._before = False  # whether the method computes something before the forward (before_forward)
        self._begins = False  # whether a forward's start needs _begin (before_forward, policies, input)
        self._sharded = False  # whether the model is sharded by FSDP2 (a pass must run on every rank)

    # ------------------------------------------------------------------------ attaching, once

    def _check_attach(self, model: nn.Module) -> None:
        claim(model, self)

    def _register(
        self, model: nn.Module, modules: dict[str, nn.Module], handles: list[RemovableHandle]
    ) -> None:
        """Register the model hooks that start and end each forward, the layer hooks and the padding-mask
        hooks, and work out what depends only on the model, its sites and the method."""
        self._site_leaves = SiteLeaves(self, model, self._dims)
        self._modules = modules
        self._inputs = tuple(spec for spec, site in self.sites.items() if site.layer == INPUT)
        self._packable = packing.may_pack(model)
        self._global = crosses_ranks(self)
        self._extended = self._overrides | (SKIPPABLE & vars(self).keys())  # (a class's, or this one's)
        self._checks_leaves = "check_leaves" in self._extended
        self._before = "before_forward" in self._extended
        self._begins = self._before or self._policies is not None or bool(self._inputs)
        self._sharded = sharded(model)
        handles.append(
            model.register_forward_pre_hook(recompute.own_code(self._on_model_input), with_kwargs=True)
        )
        guard_unwrapped(self, model, handles)
        for spec, module in modules.items():
            if spec not in self._inputs:
                handles.append(module.register_forward_hook(self._layer_hook(spec)))
        takes_masks = self.padding == "union" and self._masks.register(model, handles)
        handles.append(model.register_forward_hook(recompute.own_code(self._on_model_output)))
        self._traced = self.traceable and not takes_masks
        self._plain = (
            not self.draws_in_mix
            and "before_mix" not in self._extended
            and not self._clean
            and not self._masks.active
            and self.token_grid is None
            and self._policies is None
            and not self._global
        )

    def _reset(self) -> None:
        self._current = None
        self._site_leaves = None
        unclaim(self)

    # ------------------------------------------------------------- 1. the model's pre-hook: decide

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict):
        """A forward of the model begins: in training, decide whether it mixes and where, and start it."""
        if not _compiling() and _graph_task() != -1:  # a recomputation (recompute.in_backward)
            return self._replay_input(model, args, kwargs)
        if self._gradients.running:  # gradient_at()'s own pass
            return self._gradients.input(model, args, kwargs)
        if _compiling():  # the one-graph path, or a training forward's hook run eagerly, between graphs
            if self._traced:
                return self._compiled.begin(model, args, kwargs)
            if model.training:
                return _between_graphs(MixerHooks._on_model_input)(self, model, args, kwargs)
        if not model.training:
            self._current = None
            self._given = {}
            return None
        if self._packable:
            packing.refuse(type(self).__name__, model, args, kwargs)
        reading = self._site_leaves
        if reading.reads_sides:
            reading.input_sides = reading.input_grid(args, kwargs)
        targets = self._targets  # (this forward's: the forward started forgets them)
        forward = self._decide()
        if forward is not None:  # the model input's batch size, which the mixed layer's must be
            first, dim = args[0] if args else None, reading.input_dim
            if type(first) is torch.Tensor and dim is not None and first.ndim > dim:  # (the usual call)
                forward.batch = first.shape[dim]
            else:
                forward.batch = reading.reference_batch(model, args, kwargs)
        if self._begins:
            return self._begin(model, args, kwargs, forward, targets)
        return None

    def _decide(self, training: bool = True) -> Forward | None:
        """A forward begins (eager, or in a compiled graph; ``training``: one that may mix): whether it
        mixes, and where (pinned values win; a pinned forward always mixes; with partners from every rank,
        rank 0 decides), made the mixer's current forward. A compiled forward before it is settled first
        (its record must not take this forward's mix)."""
        forward = None
        if training:
            if self._per_rank and _distributed():  # (a default generator, reseeded for its rank once)
                self._seed_for_rank()
            pins, self._pinned = self._pinned, None
            g = self.generator
            if pins is None and (
                self.prob >= 1.0 or float(torch.rand((), generator=g, device=g.device)) < self.prob
            ):
                pins = NO_PINS
            if pins is not None and not pins.skip:
                layer = pins.layer
                if layer is not None and layer not in self.sites:  # pinned by its spec before attach
                    layer = self._site(layer, "pin")
                if layer is None:
                    k = 0
                    if self._site_weights is not None:
                        weights = torch.tensor(self._site_weights, dtype=torch.float64, device=g.device)
                        k = int(torch.multinomial(weights, 1, generator=g))
                    elif len(self.layers) > 1:
                        k = int(torch.randint(len(self.layers), (), generator=g, device=g.device))
                    layer = self.layers[k]
                forward = Forward(layer, pins)
            if self._global:
                forward = self._agree(forward)
        seen = self._seen
        if seen.begun or seen.pending is not None:
            seen.settle()
        self.last = None
        self._targets = None
        self._current = forward
        if self._masks.active:
            self._masks.begin()
        return forward

    def _begin(self, model: nn.Module, args: tuple, kwargs: dict, forward: Forward | None, targets):
        """The rest of a training forward's start, where the method or its policies need it: what they
        compute first (a gradient pass, a partner batch appended to the model's input), and the input mixed
        now if it is the layer."""
        if forward is not None and self._before:
            extra = self.before_forward(model, args, kwargs, forward.layer, forward.pins.given, targets)
            if extra:
                forward.pins = forward.pins.joined(extra)
        changed = None
        if self._policies is not None:
            given, self._given = self._given, {}
            dim = self._site_leaves.input_dim or 0
            changed = self._policies.begin(self, model, args, kwargs, forward, targets, given, dim)
            if changed is not None:  # (a partner batch appended to the model's input)
                args, kwargs = changed
                forward.batch = self._site_leaves.reference_batch(model, args, kwargs)
        if forward is None or forward.layer not in self._inputs:
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

    # ------------------------------------------------------------------ 2. the mixed layer: mix

    def _layer_hook(self, spec: str):
        """The forward hook of the layer at ``spec``: the mix where this forward mixes there, its replay in
        a recomputation."""

        def hook(module: nn.Module, args: tuple, output):
            if not _compiling() and _graph_task() != -1:  # a recomputation (recompute.in_backward)
                return self._replay_layer(spec, output)
            if self._gradients.running:  # gradient_at()'s own pass
                return self._gradients.layer(spec, output)
            if _compiling():  # the one-graph path, or a training forward's hook run eagerly, between graphs
                if self._traced:
                    return self._compiled.mix(spec, output) if module.training else None
                if self._model.training:
                    return _between_graphs(hook)(module, args, output)
            forward = self._current
            if forward is None or forward.mixed is not None or forward.layer != spec:  # it mixes elsewhere
                if self._model.training and (not torch.is_grad_enabled() or _saved_hooks(False) is not None):
                    self._note(spec)  # (what a recomputation of this layer must know: it mixed nothing)
                return None
            planned = self._site_leaves.plans.get(spec) if self._plain else None
            if planned is not None and type(output) is torch.Tensor and output.ndim == planned[0]:
                batch, dim = forward.batch, planned[2]
                if output.dtype == planned[1] and (batch is None or output.shape[dim] == batch):
                    return self._mix_plain(spec, output, dim, forward)
            return self._mix_now(spec, output, forward)[0]  # (self.last set)

        return recompute.own_code(hook, f"{type(self).__name__}_layer_hook")

    def _mix_plain(self, spec: str, h: torch.Tensor, dim: int, forward: Forward) -> torch.Tensor:
        """The short path of :meth:`_mix_now`: ``spec`` returned a plain tensor as it did before (planned:
        its batch dimension ``dim`` known, the checks that depend on nothing else passed), and the method
        draws nothing in :meth:`mix` and needs nothing before it (ManifoldMixup): lam and the partners
        drawn (or pinned), the method's mix, the record."""
        if h.is_cuda:
            refuse_capture(type(self).__name__, spec, h.device)
        leaves = [Leaf((), h, dim)]
        if self._checks_leaves:
            self.check_leaves(spec, leaves)
        pins = forward.pins  # (the generator as _replaying gives it, inline: one call fewer per forward)
        generator = (
            self.generator if pins.state is None else recompute.replay_generator(self.generator, pins.state)
        )
        draw = forward.drawn = self._draws(spec, h.shape[dim], pins, generator)
        if not torch.is_grad_enabled() or _saved_hooks(False) is not None:  # (recompute.may_be_recomputed)
            self._note(spec, forward.repeat)
        mixed = self.mix(leaves, draw)
        t = mixed.tensors.get(()) if type(mixed) is Mixed and len(mixed.tensors) == 1 else None
        if t is None or t.shape != h.shape:  # (what _check_mixed refuses, said by it)
            t = self._check_mixed(spec, leaves, mixed)[()]
        self._done(forward, self._state(spec, _PLAIN, (dim,), (h.shape,), draw, mixed))
        return t

    def _mix_now(self, spec: str, value, forward: Forward):
        """The forward's mix at ``spec`` (any site: structures, layouts, token grids, clean rows, policies;
        methods that draw in ``mix()`` or before it): drawn from the mixer's generator (or, for ``pin_last``,
        from a copy in the repeated mix's state); what repeats it is noted for a recomputation and kept for
        ``pin_last``."""
        generator = self._replaying(forward.pins.state)
        leaves, before = None, "before_mix" in self._extended
        policies = self._policies
        if before or not self.draws_in_mix or policies is not None:
            reading = self._site_leaves
            site_value = reading.value(spec, value)
            leaves = (site_value, *reading.leaves(spec, site_value, forward.batch))
            if policies is not None:  # (a memory bank's partner rows appended)
                leaves = policies.extend(spec, leaves, forward.pins.given)
        if before:
            extra = self.before_mix(spec, leaves[2], forward.pins.given)
            if extra:  # a recomputation and pin_last mix with the same values
                forward.pins = forward.pins.joined(extra)
        if policies is not None:
            extra = policies.before_mix(self, spec, leaves[2], forward.pins.given)
            if extra:
                forward.pins = forward.pins.joined(extra)
        drawn = self._repeatable(spec, None if leaves is None else leaves[3], forward, generator)
        self._note(spec, forward.repeat)  # (computed only where the forward may be recomputed)
        mixed, last = self._apply(spec, value, forward.pins, generator, forward.batch, leaves, drawn)
        self._done(forward, last)
        return mixed, last

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
        if self._seen.begun:
            self._seen.mixed(last)

    # ------------------------------------------------------------ 3. the model's output hook: mark

    def _on_model_output(self, model: nn.Module, args: tuple, output) -> None:
        """A forward of the model ends: mark its output with what it mixed (``loss()`` reads it)."""
        if not _compiling() and _graph_task() != -1:  # a recomputation: nothing to record again
            return
        if self._gradients.running:  # gradient_at()'s own pass
            return
        if _compiling():  # the one-graph path, or a training forward's hook run eagerly, between graphs
            if self._traced:
                self._seen.pending = output  # (bound to its forward's record after the graph: .traced)
                return
            if model.training:
                return _between_graphs(MixerHooks._on_model_output)(self, model, args, output)
        forward, self._current = self._current, None
        if forward is None:
            state = None
        elif forward.mixed is not None:
            state = self.last  # (a method may re-weigh it after the mix: TransMix)
            if state.clean:
                _check_doubled(model, output, state)
        else:
            raise RuntimeError(self._did_not_run(model, forward.layer))
        self._seen.record(output, state)

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
        """In a recomputation of the whole model: its input's mix again."""
        if self._gradients.running:
            return None
        for spec in self._inputs:
            pins = self._replayed(spec)
            if pins is not None:
                inputs = Inputs(model, args, kwargs)
                value, state = self._apply(spec, inputs, pins, self._replaying(pins.state))
                args, kwargs = rebuild_inputs(inputs, self.sites[spec], value)
                return self._input_masks(model, args, kwargs, spec, state, again=True)
        return None

    def _replay_layer(self, spec: str, output):
        """In a recomputation: the forward's mix at ``spec`` again."""
        pins = None if self._gradients.running else self._replayed(spec)
        if pins is None:
            return None
        return self._apply(spec, output, pins, self._replaying(pins.state))[0]

    def _replaying(self, state: torch.Tensor | None) -> torch.Generator:
        """The generator a mix draws from: the mixer's own, or for a repeat (``pin_last``, a
        recomputation) a copy in the repeated mix's ``state`` (``None``: the mix drew nothing beyond lam
        and the index, which are repeated as pinned values)."""
        return self.generator if state is None else recompute.replay_generator(self.generator, state)

    # ------------------------------------------------------------------ the general mix of any site

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
        ``leaves``: the site's value and what :meth:`SiteLeaves.leaves` gave for it, where the caller has
        them; ``drawn``: the :class:`Draw`, where the caller drew it (not read back from ``pins`` and
        checked again)."""
        reading = self._site_leaves
        if leaves is None:
            site_value = reading.value(spec, value)
            found, given, n = reading.leaves(spec, site_value, batch)
            if self._policies is not None:  # (a recomputation: the bank's rows appended again)
                site_value, found, given, n = self._policies.extend(
                    spec, (site_value, found, given, n), pins.given
                )
        else:
            site_value, found, given, n = leaves
        self._check_apply(spec, found, n)
        draw, mixed = self._drawing(spec, n, pins, generator, self.mix, given, drawn)
        tensors = self._check_mixed(spec, given, mixed)
        state = self._state_of(spec, found, draw, mixed, self._clean)
        if self.token_grid is not None:
            grid = self.token_grid
            tensors = {
                leaf.path: grid.from_map(leaf, tensors[leaf.path], state.lam, draw.index, draw.permutation)
                for leaf in found
            }
        elif self.layout_aware:  # channels-last maps were given as their channels-first views
            tensors = {
                leaf.path: reading.restore(spec, leaf, tensors[leaf.path], None, None) for leaf in found
            }
        if self._clean:  # the clean rows, then their mixes, along each tensor's batch dimension
            tensors = {leaf.path: torch.cat([leaf.tensor, tensors[leaf.path]], leaf.dim) for leaf in found}
        if self._policies is not None:  # (a partner batch's rows dropped)
            tensors, state = self._policies.finish(found, tensors, state)
        return replace_leaves(site_value, tensors), state

    def _check_apply(self, spec: str, found: list[Leaf], n: int) -> None:
        """Refuse, in one line, a mix :meth:`_apply` cannot make exact: clean rows of a batch of one, a CUDA
        graph being captured, a ``(B, L, C)`` sequence cut by position where the model takes padding masks."""
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
            and self._site_leaves.channels_last(spec, found[0])
        ):
            raise ValueError(
                f"{type(self).__name__} at {spec!r} cuts the positions of a (B, L, C) sequence, and the "
                "model takes padding masks: their union (padding='union') would call a pasted position valid "
                "by the wrong sample's mask; blend the sequence instead (ManifoldMixup), or pass "
                "padding='keep' to hand the model its own masks unchanged"
            )

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

    def _draws(self, spec: str, n: int, pins: Pins, generator: torch.Generator) -> Draw:
        """The :class:`Draw` of a mix of ``n`` samples at ``spec``: lam and the partner index (pinned, else
        drawn from ``generator``), and whether the index is a permutation of the batch."""
        if self._policies is not None:
            drawn = self._policies.draws(self, spec, n, pins, generator)
            if drawn is not None:
                return drawn
        lam = pins.lam
        if lam is None:
            lam = self.sample_lam(n, generator)
            if type(lam) is not torch.Tensor or lam.dtype != torch.float64:
                lam = torch.as_tensor(lam, dtype=torch.float64)
        elif lam.ndim == 1 and lam.shape[0] != n:
            raise ValueError(f"pinned lam has {lam.shape[0]} values but the batch at layer {spec!r} has {n}")
        index = pins.index
        if index is None:
            index = self.draw_index(n, generator)
            permutation = self.index_is_permutation and (not self._global or self.partner_pool(n) == n)
            return Draw(spec, lam, index, generator, pins.given, permutation, weight_of(lam))
        pool = self.partner_pool(n) if self._global else n
        low, high = pins.span
        if index.shape[0] != n or (n and (low < -pool or high >= pool)):
            where = f"the batch of {n}" if pool == n else f"{pool} partners for a batch of {n}"
            raise ValueError(
                f"pinned index of length {index.shape[0]} (values {index.tolist()[:8]}...) "
                f"does not index {where} at layer {spec!r}"
            )
        if low < 0:  # counted from the end, as indexing counts them
            index = torch.where(index < 0, index + pool, index)
        return Draw(spec, lam, index, generator, pins.given, pool == n and pins.permutation, weight_of(lam))

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
        own = mixed.lam is None
        return MixState(
            spec,
            draw.lam if own else torch.as_tensor(mixed.lam, dtype=torch.float64),
            draw.index if mixed.index is None else mixed.index,
            dict(mixed.info) if mixed.info else {},
            names,
            dims,
            mixed.weights,
            shapes,
            clean,
            mixed.partner_lam,
            draw.weight if own and type(draw.weight) is float else None,
        )

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

    # ------------------------------------------------ what the collaborators are given (see _fresh)

    def _captured_leaves(self, spec: str, value) -> tuple:
        """For the gradient pass: the site's value in ``value`` and the leaves that carry its batch."""
        reading = self._site_leaves
        site_value = reading.value(spec, value)
        return site_value, reading.leaves(spec, site_value)[0]

    def _as_given(self, spec: str, leaf: Leaf, model: nn.Module) -> torch.Tensor:
        """``leaf``'s tensor as :meth:`mix` is given it (:meth:`SiteLeaves.as_given`)."""
        return self._site_leaves.as_given(spec, leaf, model)

    def _read_input(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
        """A training forward's input, read under torch.compile as an eager forward reads it: its sides
        (the map checks) and its batch size, where the model tells it."""
        reading = self._site_leaves
        reading.input_sides = reading.input_grid(args, kwargs)
        return reading.reference_batch(model, args, kwargs)

    def _unplanned(self, spec: str, value) -> tuple:
        """The site's value in ``value``, the leaves found and given and the batch size, without the plans
        (traced code neither reads nor writes them)."""
        reading = self._site_leaves
        site_value = reading.value(spec, value)
        return (site_value, *reading.leaves(spec, site_value, None, plan=False))

    def _restore(self, spec: str, leaf: Leaf, t: torch.Tensor, weight, index) -> torch.Tensor:
        """A mixed tensor of ``leaf`` given to the method as a view, put back (:meth:`SiteLeaves.restore`)."""
        return self._site_leaves.restore(spec, leaf, t, weight, index)

    def _host_begin(self, training: bool, batch: int | None) -> int:
        """``mixhook::begin`` (:mod:`.traced`): the previous compiled forward's output bound to its record,
        this forward's record opened, and (training) its decision made as an eager forward makes it; the
        chosen layer's position (-1: none)."""
        forward = self._decide(training)
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
        self._done(forward, self._state_of(spec, found, d, mixed))
        return values, self.last


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
