"""Checkpoints that resume a run exactly, and loading that cannot run code.

A checkpoint is one file (``last.pt`` in the run directory) holding everything the rest of a run
depends on: model, optimizer, LR scheduler, AMP grad scaler, the position (epoch, step), every random
state (torch CPU and CUDA, numpy, python, each hook's generator; the data order is a function of the
seed and the epoch, see :class:`mixhook.app.data.EpochSampler`), the metrics so far and the run's config.

It is written atomically (a temporary file beside it, fsynced, then renamed), so a kill at any moment
leaves either the previous checkpoint or the new one, never half of one. It is read with
``torch.load(weights_only=True)``: plain containers, numbers, strings and tensors only, so a crafted file
cannot run code while it is read.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import torch

from mixhook.hooks import LayerHook

from ..files import atomic_write

FORMAT = "mixhook-checkpoint"
VERSION = 1
FILE = "last.pt"


class CheckpointError(ValueError):
    """A file that cannot be resumed from: not a mixhook checkpoint, truncated, or for another run."""


def save(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` (the training loop's run state: position, metrics, model, optimizer, scheduler,
    scaler, random states, config) to ``path`` atomically, marked with this format and version."""
    with atomic_write(path, "wb") as f:
        torch.save({"format": FORMAT, "version": VERSION, **state}, f)


def load(path: str | os.PathLike) -> dict:
    """Read a checkpoint with ``weights_only=True``; raise :class:`CheckpointError` (one line) for a
    missing, truncated, foreign or unsafe file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # what weights_only refuses: globals, reducers, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{path} is not a mixhook checkpoint: it holds objects that weights-only loading "
            f"refuses ({first})"
        ) from None
    except Exception as err:  # a text file, a truncated zip, ...: torch.load raises many kinds
        raise CheckpointError(
            f"{path} cannot be read as a checkpoint (truncated or corrupt: {type(err).__name__})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a mixhook checkpoint (no '{FORMAT}' marker)")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{path} is a version {state.get('version')} checkpoint; this mixhook reads {VERSION}"
        )
    return state


# ------------------------------------------------------------------------------------ random states


def hook_generators(hooks) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` the hooks draw from, by a stable path (``"0.generator"``,
    ``"0.mixers.1.generator"`` for a :class:`~mixhook.OneOf`'s second mixer, ...), each once, whatever
    the hooks' per-forward state."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()  # a hook reached twice (OneOf's ``chosen`` is one of its ``mixers``) counts once

    def walk(obj, path: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for key, value in vars(obj).items():
            if isinstance(value, torch.Generator):
                found[f"{path}.{key}"] = value
            elif isinstance(value, LayerHook):
                walk(value, f"{path}.{key}")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, LayerHook):
                        walk(item, f"{path}.{key}.{i}")

    for i, hook in enumerate(hooks):
        walk(hook, str(i))
    return found


def random_states(hooks=()) -> dict:
    """The global random states (torch CPU and CUDA, numpy, python) and each hook generator's."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "python": random.getstate(),
        "hooks": {name: g.get_state() for name, g in hook_generators(hooks).items()},
    }


def restore_random_states(states: dict, hooks=()) -> None:
    """Undo :func:`random_states`: every stream continues where it was captured."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    generators = hook_generators(hooks)
    if set(generators) != set(states["hooks"]):
        raise CheckpointError(
            f"the checkpoint's hook generators {sorted(states['hooks'])} do not match this run's "
            f"{sorted(generators)}"
        )
    for name, g in generators.items():
        g.set_state(states["hooks"][name])
