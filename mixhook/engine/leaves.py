"""What a site's value is to a method: the tensors that carry the batch there (its leaves), each with its
batch dimension, as the method is given them (a channels-last map as its channels-first view, a ViT block's
tokens as the map of their patch grid), and the checks that depend on the site alone, made once.

A collaborator of a :class:`~mixhook.engine.mixer.Mixer`'s hooks, made when the mixer is attached
(:class:`SiteLeaves`): what depends only on the model and the site (each map's layout, the model input's
batch dimension and first parameter, whether a map's sides are checked against the input's) is read then;
what depends on the value is planned at the first forward that returns a plain tensor there and kept with
the signature it was derived from (:class:`Plan`: the tensor's shape, strides, dtype and device, and the
input's sides its map was checked against). The mixer's one path (:meth:`~.path.Path._mix`) compares
that signature at its top, a tuple compare, and takes the plan only where it is equal; anything else is
read again here, checked as a fresh mixer checks it, and planned anew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from ..layouts import CHANNELS_LAST, SiteLayout, channels_first, channels_last, layout_facts, site_layout
from ..sites import (
    INPUT,
    BatchDims,
    Inputs,
    Leaf,
    batch_leaves,
    blendable,
    describe,
    embedding_layers,
    first_parameter,
    input_dim,
    size_along,
)


class Plan(NamedTuple):
    """What a site that returned a plain tensor is to a method, kept with the signature of that tensor: the
    next forward whose tensor has an equal signature is given its leaf without the structure walk, the
    layout's reading and the checks that depend on nothing else (the method's own ``check_leaves`` runs on
    every forward, unless it says ``checks_by_signature``)."""

    signature: tuple  # (shape, strides, dtype, device, the input's sides the map was checked against)
    dim: int  # the batch dimension
    view: bool  # a channels-last map, given to the method as its channels-first view


class SiteLeaves:
    """The leaves of one attached mixer's sites, read as its method is given them.

    Args:
        mixer: the mixer (its public ``sites``, ``layout``, ``layout_aware``, ``region_dims``, ``token_grid``
            and :meth:`~.mixer.Mixer.check_leaves` are read).
        model: the model it is attached to.
        dims: each site's :class:`~mixhook.sites.BatchDims`.
    """

    def __init__(self, mixer, model: nn.Module, dims: dict[str, BatchDims], per_layer: Callable):
        self.kind = type(mixer).__name__
        self.sites, self.model, self.dims = mixer.sites, model, dims
        self.layout_aware, self.token_grid = mixer.layout_aware, mixer.token_grid
        self.check_leaves = mixer.check_leaves
        self.layout = mixer.layout
        self._per_layer = per_layer  # (a layout given by spec, read at the site it resolved to)
        self.layouts: dict[tuple[str, int], SiteLayout] = {}  # (site, ndim): its maps' layout
        self.reads_sides = False  # whether maps are checked against the input's sides
        if self.layout_aware:
            declared = {spec: self._per_layer(self.layout, spec) for spec in self.sites}
            self.reads_sides = not any(
                declared[spec] in CHANNELS_LAST.values() for spec, s in self.sites.items() if s.layer == INPUT
            )
            for ndim in (d + 2 for d in mixer.region_dims):
                facts = layout_facts(model, ndim)
                for spec, site in self.sites.items():
                    self.layouts[spec, ndim] = site_layout(model, site, declared[spec], facts, ndim)
        first = next(iter(dims.values()), None)  # (the model's layout is fixed once it is built)
        self.input_dim: int | None = None if first is None else input_dim(model, first.seq_first)
        # the model's input by its signature: a keyword call's batch is read from it, not from the first
        # keyword given (an unbatched shift or position_ids passed first)
        self.input_name = first_parameter(model)
        self.plans: dict[str, Plan] = {}  # each site that returned a plain tensor: its plan
        self.input_sides: tuple[int, int, int] | None = None  # a training input's (ndim, H, W)

    def value(self, spec: str, value):
        """What ``spec`` acts on in a layer's output or, for ``"input"``, the model's :class:`Inputs`: with a
        selector, the whole (the selector picks), else the output or the first argument."""
        site = self.sites[spec]
        if site.layer != INPUT:
            return value
        if not len(value):
            raise TypeError(f"mixup layer {spec!r}: the model was called without arguments; nothing to mix")
        return value if site.paths is not None else value[0]

    def leaves(
        self, spec: str, value, expected: int | None = None, plan: bool = True
    ) -> tuple[list[Leaf], list[Leaf], int]:
        """The leaves that carry the batch in ``value`` (what :meth:`value` gives at ``spec``), what the
        method is given for them (the same, or with a token grid their ``(B, D, gh, gw)`` patch maps, or a
        channels-last map's channels-first view), and the batch size (checked against ``expected``, the
        model input's, where known); the method's ``check_leaves`` is run on them.

        A plain tensor read here is planned (``plan``): its :class:`Plan`, with the signature it was read
        for, is kept in :attr:`plans` for the mixer's path to take while the signature holds. Traced code
        (``plan=False``) writes no plan (a traced write of the dict would be a guard)."""
        site = self.sites[spec]
        if site.layer == INPUT:
            self.check_token_ids(spec, value)
        found, batch = batch_leaves(value, site, self.dims[spec], self.kind, inputs=site.layer == INPUT)
        if expected is not None and batch != expected:
            rule = self.layouts.get((spec, found[0].tensor.ndim))
            if rule is not None and rule.how == "windows":  # (B * windows) rows: say why
                rule.of(self.kind, spec)
            raise TypeError(
                f"{self.kind} at {spec!r}: it returned {describe(value)}, whose batch dimension "
                f"{found[0].dim} has size {batch}, but the model's input has a batch of {expected}: the "
                "layer loses or reshapes the batch dimension (or, applied to a PackedSequence's .data, sees "
                "the time steps of every sample as rows); choose another layer, or pass batch_dim"
            )
        if self.layout_aware and self.input_sides is not None and site.layer != INPUT:
            for leaf in found:
                self.check_sides(spec, leaf)
        if self.token_grid is not None:
            given = self.token_grid.to_maps(spec, found, self.model)
        elif self.layout_aware and any(self.channels_last(spec, leaf) for leaf in found):
            given = [Leaf(f.path, channels_first(f.tensor, CHANNELS_LAST[f.tensor.ndim]), 0)
                     if self.channels_last(spec, f) else f for f in found]  # fmt: skip
        else:
            given = found
        self.check_leaves(spec, given)
        if plan and type(value) is torch.Tensor and found[0].path == () and self.token_grid is None:
            signature = (value.shape, value.stride(), value.dtype, value.device, self.input_sides)
            self.plans[spec] = Plan(signature, found[0].dim, given is not found)
        return found, given, batch

    def channels_last(self, spec: str, leaf: Leaf) -> bool:
        """Whether ``leaf`` is a channels-last map (``(B, H, W, C)``; for a method that cuts them,
        ``(B, L, C)`` or ``(B, D, H, W, C)``), which a layout-aware method is given as its channels-first
        view; a map whose layout cannot be told is refused here (one line)."""
        ndim = leaf.tensor.ndim
        if not self.layout_aware or leaf.dim != 0:
            return False
        rule = self.layouts.get((spec, ndim))
        return rule is not None and rule.of(self.kind, spec) == CHANNELS_LAST[ndim]

    def channels_first(self, spec: str, t: torch.Tensor) -> torch.Tensor:
        """``t``, a map as the method is given it at ``spec`` (a value there or its gradient, batch first),
        as its channels-first view ``(B, C, ...)``, for what reduces it over its channels (a saliency). A
        layout-aware method is given that view already; for another the site's layout is read as a region
        method's would be (:func:`~mixhook.layouts.site_layout`, once per attach and number of dimensions;
        a ``(B, L, C)`` sequence the model states is channels-last; a map whose layout cannot be told is
        refused in one line). A ``(B, D)`` tensor is returned as it is."""
        if t.ndim < 3 or t.ndim > 5 or self.layout_aware or self.token_grid is not None:
            return t
        rule = self.layouts.get((spec, t.ndim))
        if rule is None:
            rule = site_layout(self.model, self.sites[spec], self._per_layer(self.layout, spec), ndim=t.ndim)
            if rule.how == "sequence":  # stated (B, L, C): channels last (only a cut needs it declared)
                rule = SiteLayout(CHANNELS_LAST[3], "sequence", basis="module")
            self.layouts[spec, t.ndim] = rule
        layout = rule.of(self.kind, spec)
        return channels_first(t, layout) if layout == CHANNELS_LAST[t.ndim] else t

    def as_given(self, spec: str, leaf: Leaf, model: nn.Module) -> torch.Tensor:
        """``leaf``'s tensor as the method is given it: a token grid's ``(B, D, gh, gw)`` map, a
        channels-last map's channels-first view, or itself."""
        if self.token_grid is not None:
            return self.token_grid.to_maps(spec, [leaf], model)[0].tensor
        if self.channels_last(spec, leaf):
            return channels_first(leaf.tensor, CHANNELS_LAST[leaf.tensor.ndim])
        return leaf.tensor

    def restore(self, spec: str, leaf: Leaf, t: torch.Tensor, weight, index) -> torch.Tensor:
        """A mixed tensor ``t`` of ``leaf``, which the method was given as a view, put back (traced): a
        token grid's map into the tokens (the leading tokens blended by ``weight`` and ``index``), a
        channels-first view into its channels-last map."""
        if self.token_grid is not None:
            return self.token_grid.from_map_traced(leaf, t, weight, index)
        return channels_last(t) if self.channels_last(spec, leaf) else t

    def model_input(self, args: tuple, kwargs: dict):
        """The model's input in a call: its first parameter by signature, wherever and in whatever order it
        is passed (positionally, or by keyword after an unbatched one); where that is no tensor (not given:
        ``inputs_embeds=`` in place of ``input_ids=``), the first floating tensor given (not an integer
        ``position_ids`` of batch 1, a mask), else the first tensor given."""
        first = args[0] if args else kwargs.get(self.input_name)
        if isinstance(first, (torch.Tensor, PackedSequence)):
            return first
        given = [v for v in (*args, *kwargs.values()) if isinstance(v, (torch.Tensor, PackedSequence))]
        floating = [v for v in given if isinstance(v, PackedSequence) or v.is_floating_point()]
        return (floating or given or [None])[0]

    def reference_batch(self, model: nn.Module, args: tuple, kwargs: dict) -> int | None:
        """The batch size of the model's input (:meth:`model_input`), to check each mixed layer against: its
        batch dimension, where the model's layout tells it (``None`` where it does not)."""
        first = self.model_input(args, kwargs)
        if isinstance(first, PackedSequence):  # its .data rows are time steps of every sample
            return int(first.batch_sizes[0])
        return size_along(first, self.input_dim)

    def input_grid(self, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        """The number of dimensions, height and width of the model's input where it is an image or a clip
        (4-D or 5-D, its height and width last, as NCHW images and both clip layouts have them) and maps'
        sides are checked against it (:meth:`check_sides`)."""
        if not self.reads_sides:
            return None
        first = args[0] if args else self.model_input(args, kwargs)
        if type(first) is not torch.Tensor or first.ndim not in (4, 5):
            return None
        return first.ndim, int(first.shape[-2]), int(first.shape[-1])

    def check_sides(self, spec: str, leaf: Leaf) -> None:
        """A map read by its model's statement, PyTorch's convention or a last-dimension op, checked
        against the input's height and width (:meth:`mixhook.layouts.SiteLayout.check_sides`)."""
        rule = self.layouts.get((spec, leaf.tensor.ndim))
        if rule is not None and leaf.dim == 0:
            rule.check_sides(self.kind, spec, leaf.tensor.shape, self.input_sides)

    def check_token_ids(self, spec: str, value) -> None:
        """Refuse, in one line, token ids (or other integers) at the model's input: nothing to blend."""
        selected = value if isinstance(value, torch.Tensor) else None
        if selected is None and isinstance(value, Inputs):
            paths = self.sites[spec].paths or ()
            picked = [value.get(value.key(p[0])) if isinstance(p[0], str) or p[0] < len(value) else None
                      for p in paths]  # fmt: skip
            selected = next((t for t in picked if isinstance(t, torch.Tensor) and not blendable(t)), None)
        if isinstance(selected, torch.Tensor) and not blendable(selected):
            embeddings = embedding_layers(self.model)
            where = (f"mix the embeddings instead: {', '.join(embeddings[:4])}, or a layer after them"
                     if embeddings else "mix a layer whose output is floating point")  # fmt: skip
            dtype = str(selected.dtype).removeprefix("torch.")
            raise TypeError(
                f"mixup layer {spec!r}: the model's input is a {dtype} tensor of shape "
                f"{tuple(selected.shape)} (token ids or labels), which cannot be blended; {where}"
            )
