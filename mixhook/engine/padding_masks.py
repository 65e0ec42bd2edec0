"""Padding masks downstream of a mix, a collaborator of a :class:`~mixhook.engine.mixer.Mixer` with
``padding="union"``: the outermost module called with a padding mask gets the union of the partners' masks
(:mod:`mixhook.padding`), and the calls inside it get what it hands them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import padding as masks
from .. import recompute
from ..sites import INPUT, Inputs
from . import partners
from .contract import MixState


class PaddingMasks:
    """The padding-mask hooks of one mixer: registered on the modules of its model that take padding
    masks (:meth:`register`), told when a forward begins (:meth:`begin`) and, for a mix at the model's
    input, asked for the model's arguments with their masks unioned (:meth:`at_input`).

    Args:
        mixer: the mixer whose mixes they follow (its public ``sites`` and
            :meth:`~.mixer.Mixer.partner_pool` are read).
        under_way: the training forward under way (:attr:`~.path.Path.current`), called at each module's.
        note, replayed: the mixer's channel to activation-checkpoint replay
            (:meth:`~mixhook.hooks.LayerHook._note`, :meth:`~mixhook.hooks.LayerHook._replayed`): a
            recomputation applies the same union again.
    """

    def __init__(self, mixer, under_way: Callable, note: Callable, replayed: Callable):
        self._mixer, self._under_way, self._note, self._replayed = mixer, under_way, note, replayed
        self.active = False  # whether some module of the model takes padding masks (set by register)
        self._regions: dict[str, str] = {}  # each hidden site's padding-mask region (mixhook.padding)
        self._stack: list[bool] = []  # per module call under way: whether it (or an outer one) got masks

    def register(self, model: nn.Module, handles: list[RemovableHandle]) -> bool:
        """Register the hooks on every module of ``model`` that takes padding masks; whether there was one."""
        self._regions = {
            spec: masks.region_of(model, site.layer)
            for spec, site in self._mixer.sites.items()
            if site.layer != INPUT
        }
        self.active = False
        for name, module in model.named_modules():
            if module is not model and masks.takes_masks(module):
                self.active = True
                key = f"padding mask of {name}"
                pre = recompute.hook(self._before(name, key), self._again(key))
                handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(module.register_forward_hook(recompute.hook(self._after), always_call=True))
        return self.active

    def begin(self) -> None:
        """A training forward begins: no module call is under way."""
        self._stack = []

    def at_input(
        self, model: nn.Module, args: tuple, kwargs: dict, spec: str, state: MixState, again: bool = False
    ):
        """The model's ``(args, kwargs)`` after a mix at its input (``again``: in a recomputation), with the
        masks that describe the mixed input unioned (:func:`mixhook.padding.at_input`); unless the model
        takes no mask argument, the modules inside keep what it hands them."""
        inputs = Inputs(model, args, kwargs)
        site = self._mixer.sites[spec]
        mixed = (inputs.first()[0],) if site.paths is None else tuple(inputs.key(p[0]) for p in site.paths)
        names = masks.at_input(inputs, mixed, state.index.shape[0])
        if names is None:
            return args, kwargs  # the model takes no mask: its modules decide, as for a hidden layer
        if not again:
            self._stack.append(True)  # the modules inside get the model's masks: none unions again
        if not names:
            return args, kwargs
        _refuse_clean(state, f"{type(model).__name__} (the model)", names)
        masks.check_lengths(f"{type(model).__name__} (the model)", inputs, names, _sizes(state))
        return masks.union(inputs, names, state.index, self._source)

    def _before(self, name: str, key: str):
        """Downstream of a mix, the outermost module called with a padding mask gets the union of the
        partners' masks that describe the mixed sequence, and the calls inside it get what it hands them."""

        def pre(module: nn.Module, args: tuple, kwargs: dict):
            forward = self._under_way()
            mixed = None if forward is None else forward.mixed
            if mixed is None or any(self._stack):
                self._stack.append(False)
                self._note(key)
                return None
            inputs = Inputs(module, args, kwargs)
            region = self._regions.get(forward.layer, "")
            names = masks.downstream(module, name, region, inputs, mixed.index.shape[0])
            self._stack.append(True)
            self._note(key, (mixed.index, names) if names else None)
            if not names:
                return None
            _refuse_clean(mixed, f"{type(module).__name__} {name!r}", names)
            masks.check_lengths(f"{type(module).__name__} {name!r}", inputs, names, _sizes(mixed))
            return masks.union(inputs, names, mixed.index, self._source)

        return pre

    def _again(self, key: str):
        """In a recomputation: the union the forward applied, applied again."""

        def pre(module: nn.Module, args: tuple, kwargs: dict):
            payload = self._replayed(key)
            if payload is None:
                return None
            index, names = payload
            return masks.union(Inputs(module, args, kwargs), names, index, self._source)

        return pre

    def _after(self, module: nn.Module, args: tuple, output) -> None:
        if self._stack:
            self._stack.pop()

    def _source(self, mask: torch.Tensor) -> torch.Tensor:
        """The rows a partner index indexes: the mask itself, or every rank's with partners from the
        global batch."""
        pool = self._mixer.partner_pool(mask.shape[0])
        return mask if pool == mask.shape[0] else partners.gather_labels(mask)


def _refuse_clean(state: MixState, where: str, names: tuple[str, ...]) -> None:
    """A clean+mixed mix doubles the batch, but the padding masks downstream describe its ``B`` rows."""
    if state.clean:
        raise masks.PaddingPolicyError(
            f"clean=True doubles the batch at {state.layer!r}, but {where} is called downstream with "
            f"{', '.join(names)} for the {state.index.shape[0]} input rows: a model that takes padding masks "
            "cannot be mixed with its clean batch yet; use clean=False (or a model without padding masks)"
        )


def _sizes(state: MixState) -> tuple[int, ...] | None:
    """The first mixed tensor's dimensions besides its batch dimension."""
    if not state.shapes:
        return None
    shape, dim = state.shapes[0], state.batch_dims[0]
    return tuple(size for d, size in enumerate(shape) if d != dim)
