"""Padding masks downstream of a mix, as hooks of a :class:`~mixhook.engine.mixer.Mixer`: the outermost
module called with a padding mask gets the union of the partners' masks (:mod:`mixhook.padding`)."""

from __future__ import annotations

import torch
from torch import nn

from .. import padding as masks
from .. import recompute
from ..sites import Inputs
from . import partners
from .contract import MixState


class PaddingMasks:
    """The padding-mask hooks of a mixer (``padding="union"``)."""

    def _input_masks(self, model: nn.Module, args: tuple, kwargs: dict, spec: str, state: MixState):
        """The model's ``(args, kwargs)`` after a mix at its input, with the masks that describe the mixed
        input unioned (:func:`mixhook.padding.at_input`); unless the model takes no mask argument, the
        modules inside keep what it hands them."""
        if self.padding != "union":
            return args, kwargs
        inputs = Inputs(model, args, kwargs)
        site = self.sites[spec]
        mixed = (inputs.first()[0],) if site.paths is None else tuple(inputs.key(p[0]) for p in site.paths)
        names = masks.at_input(inputs, mixed, state.index.shape[0])
        if names is None:
            return args, kwargs  # the model takes no mask: its modules decide, as for a hidden layer
        if not recompute.in_backward():
            self._mask_stack.append(True)  # the modules inside get the model's masks: none unions again
        if not names:
            return args, kwargs
        _refuse_clean(state, f"{type(model).__name__} (the model)", names)
        masks.check_lengths(f"{type(model).__name__} (the model)", inputs, names, _sizes(state))
        return masks.union(inputs, names, state.index, self._mask_source)

    def _mask_hooks(self, name: str):
        """Downstream of a mix, the outermost module called with a padding mask gets the union of the
        partners' masks that describe the mixed sequence (:mod:`mixhook.padding`), and the calls inside
        it get what it hands them. A recomputation applies the same union again."""
        key = f"padding mask of {name}"

        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if recompute.in_backward():
                payload = self._replayed(key)
                if payload is None:
                    return None
                index, names = payload
                return masks.union(Inputs(module, args, kwargs), names, index, self._mask_source)
            forward = self._current
            mixed = None if forward is None else forward.mixed
            if mixed is None or any(self._mask_stack):
                self._mask_stack.append(False)
                self._note(key)
                return None
            inputs = Inputs(module, args, kwargs)
            region = self._regions.get(forward.layer, "")
            names = masks.downstream(module, name, region, inputs, mixed.index.shape[0])
            self._mask_stack.append(True)
            self._note(key, (mixed.index, names) if names else None)
            if not names:
                return None
            _refuse_clean(mixed, f"{type(module).__name__} {name!r}", names)
            masks.check_lengths(f"{type(module).__name__} {name!r}", inputs, names, _sizes(mixed))
            return masks.union(inputs, names, mixed.index, self._mask_source)

        def post(module: nn.Module, args: tuple, output) -> None:
            if self._mask_stack and not recompute.in_backward():
                self._mask_stack.pop()

        return pre, post

    def _mask_source(self, mask: torch.Tensor) -> torch.Tensor:
        """The rows a partner index indexes: the mask itself, or every rank's with partners from the
        global batch."""
        pool = self.partner_pool(mask.shape[0])
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
