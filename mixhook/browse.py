"""The layer browser: which layers of a model can be mixed, and which sit inside a residual block.

``python -m mixhook.layers model=<...> data=<...>`` (any of the app's overrides) builds the model for the
data, runs one sample batch through it, and prints every named module in call order with its output
and two verdicts:

- **mixable**: it returns a tensor whose first dimension is the batch, which every mixer can blend;
- **inside a residual block**: some enclosing module's output also depends on that module's input by a
  path that avoids this layer (a skip connection). Mixing here blends one branch while the skip path
  carries the unmixed input past it, so the block's output is only partly mixed: the pitfall the
  Manifold Mixup authors warn about. Mixing at the block itself (or outside it) mixes everything.

The residual test reads the autograd graph of that one forward: from the enclosing module's output it
walks back towards its input, never through the layer in question, and reports a skip if it arrives.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from . import layers
from .mixing import describe


@dataclass
class LayerInfo:
    name: str
    kind: str
    output: str
    mixable: bool
    residual_in: str | None  # the innermost enclosing module with a skip around this layer
    calls: int = 1  # how often it ran in one forward (a mixer mixes at the first)


def browse(model: nn.Module, x: torch.Tensor) -> list[LayerInfo]:
    """Run ``model(x)`` once (eval mode, gradients recorded, no parameter changed) and describe every
    named module that ran, in call order, preceded by ``input``."""
    names = {module: name for name, module in model.named_modules()}
    seen: dict[str, tuple] = {}  # name -> (output, input node, output node), first call only
    order: list[str] = []
    inputs: list = []  # input nodes of the calls under way (calls nest)
    counts: dict[str, int] = {}
    handles = []

    def node(t):
        return t.grad_fn if isinstance(t, torch.Tensor) else None

    def before(module, args):  # before the module runs: an in-place op may change its input's node
        inputs.append(node(next((a for a in args if isinstance(a, torch.Tensor)), None)))

    def after(module, args, output):
        name = names[module]
        if name not in seen:
            seen[name] = (output, inputs[-1], node(output))
            order.append(name)
        counts[name] = counts.get(name, 0) + 1
        inputs.pop()

    was_training = model.training
    try:
        for module in names:
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after))
        model.eval()
        with torch.enable_grad():
            x = x.detach().clone().requires_grad_(True)
            model(x.view_as(x))  # the view gives the model's input a node of its own
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    rows = [LayerInfo(layers.INPUT, "input", describe(x), True, None)]
    for name in order:
        if not name:
            continue
        output, _, out_node = seen[name]
        mixable = isinstance(output, torch.Tensor) and output.ndim >= 1 and output.shape[0] == x.shape[0]
        residual = None
        for parent in _ancestors(name) if mixable else []:
            _, parent_in, parent_out = seen.get(parent, (None, None, None))
            if _reaches(parent_out, parent_in, blocked=out_node):
                residual = parent or "(the model)"
                break
        kind = type(model.get_submodule(name)).__name__
        rows.append(LayerInfo(name, kind, describe(output), mixable, residual, counts[name]))
    return rows


def _ancestors(name: str) -> list[str]:
    """``"layer2.0.bn1"`` -> ``["layer2.0", "layer2", ""]`` (innermost first; ``""`` is the model)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _reaches(start, target, blocked) -> bool:
    """Whether the autograd graph leads from node ``start`` back to node ``target`` without passing
    through node ``blocked``."""
    if start is None or target is None or start is blocked:
        return False
    stack, visited = [start], {start, blocked}
    while stack:
        current = stack.pop()
        if current is target:
            return True
        for nxt, _ in current.next_functions:
            if nxt is not None and nxt not in visited:
                visited.add(nxt)
                stack.append(nxt)
    return False


def format_table(rows: list[LayerInfo]) -> str:
    """The browser's table: one line per layer."""
    head = ("layer", "type", "output", "mixable", "note")
    body = [
        (
            r.name,
            r.kind,
            r.output.removeprefix("a tensor of shape "),
            "yes" if r.mixable else "no",
            _note(r),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(4)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip((*line[:4], line[4]), (*widths, 0), strict=True))
        for line in (head, *body)
    ]
    return "\n".join(line.rstrip() for line in lines)


def _note(row: LayerInfo) -> str:
    notes = []
    if row.residual_in:
        notes.append(f"inside residual block {row.residual_in}: the skip path stays unmixed")
    if row.calls > 1:
        notes.append(f"runs {row.calls} times per forward: a mixer mixes its first output")
    return "; ".join(notes)


def main(argv: list[str]) -> int:
    """``python -m mixhook.layers [overrides]``: print the table for the app's model and data."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from . import app

    conf = Path(__file__).resolve().parents[1] / "conf"
    problem = app.check_command_line(argv, str(conf))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose(config_name="config", overrides=argv)
        model, data = app.build_model_and_data(cfg)
    except (app.ConfigError, HydraException) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    x = next(iter(data.test))[0][:2]
    print(f"{type(model).__name__} on a {data.name} batch of shape {tuple(x.shape)}:")
    print(format_table(browse(model, x)))
    return 0
