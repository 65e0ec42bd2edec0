"""Models sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``), as the hooks, the copies of a model and
the app need to know them: which modules are sharded, whether a model is, and gathering a model's
parameters again after a pass run inside its forward. Below every module that uses it; imports only torch.
"""

from __future__ import annotations

from torch import nn


def _fsdp_module() -> type | None:
    """FSDP2's module class (``None`` in a torch without it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return None
    return FSDPModule


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """``model``'s modules sharded by FSDP2 (``fully_shard``), itself included."""
    fsdp = _fsdp_module()
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` or a module in it is sharded by FSDP2 (its forwards then gather parameters with
    the other ranks: every rank must run as many)."""
    return bool(fsdp_modules(model))


def unshard_again(model: nn.Module) -> None:
    """After a pass run inside ``model``'s forward (from its pre-hook): a model sharded by FSDP2
    (``fully_shard``) had its parameters gathered by its own pre-hook for the forward that called the pass,
    and the pass's forward (or its backward's final callback) ends by sharding them again; gather them
    again, or the rest of that forward would compute with the shards."""
    fsdp = _fsdp_module()
    if fsdp is not None and isinstance(model, fsdp):
        model.unshard()
