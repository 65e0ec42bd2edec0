"""The layer browser: which layers of a model can be mixed, and which sit inside a residual block.

``mixhook-layers model=<...> data=<...>`` (any of the app's overrides) builds the model for the
data, runs one sample batch through it, and prints every named module in call order with its output
its structure and two verdicts:

- **output**: its shape, or for a tuple, dict or ``ModelOutput`` each element (``[0]``, ``[1.0]``,
  ``[last_hidden_state]``: the selectors a layer spec takes), with the dimension along which each one
  carries the batch (``batch@1`` for a sequence-first LSTM's output and its ``h_n``);
- **mixable**: whether a mixer can blend it as a whole (every tensor in it that carries the batch, along
  its own batch dimension), and the configured method there (``mixup=cutmix``: a map it can cut), and if
  not, why;
- **inside a residual block**: some enclosing module's output also depends on that module's input by a
  path that avoids this layer (a skip connection). Mixing here blends one branch while the other carries
  the unmixed input past it, so the block's output is only partly mixed: the pitfall the Manifold Mixup
  authors warn about. A layer *on* the skip path (torchvision's ``downsample``, PreAct's ``shortcut``) is
  told from one inside the residual branch: of the block's parallel branches, it lies on the one with
  fewer modules. Mixing at the block itself (or outside it) mixes everything.

The residual test reads the autograd graph of that one forward: from the enclosing module's output it
walks back towards its input, never through the layer in question, and reports a skip if it arrives.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from mixhook import layers
from mixhook.sites import BatchDims, batch_leaves, format_path, input_batch, leaves, parse_site

USAGE = """usage: mixhook-layers [OVERRIDE ...]

Lists every layer of the experiment app's model, in call order, on one sample batch of its data: what it
returns (elements and the dimension along which each carries the batch), whether a mixer can mix it, and
whether it sits inside a residual block or on its skip path.

OVERRIDE: any of train.py's overrides; the mixable column is the configured method's verdict, e.g.
  mixhook-layers model=torchvision model.name=resnet18
  mixhook-layers mixup=cutmix        # CutMix's verdict: no 1x1 maps, no logits
  mixhook-layers model=timm model.name=vit_tiny_patch16_224 +model.img_size=8 +model.patch_size=4
  mixhook-layers data=cifar10 data.root=/path/to/data
"""


@dataclass
class LayerInfo:
    name: str
    kind: str
    output: str  # its shape, or its elements with their shapes and batch dimensions
    mixable: bool
    residual_in: str | None  # the innermost enclosing module with a skip around this layer
    calls: int = 1  # how often it ran in one forward (a mixer mixes at the first)
    on_skip: bool = False  # the layer lies on the skip path of residual_in, not in its residual branch
    why_not: str = ""  # why it cannot be mixed
    portable: str = ""  # the portable specs that reach it (stage:2 block:5), as the model states them


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
    input_dims = BatchDims(model, parse_site(layers.INPUT))
    batch = input_batch(model, x, input_dims.seq_first)
    structure, mixable, why_not = _structure(x, parse_site(layers.INPUT), input_dims, batch)
    rows = [LayerInfo(layers.INPUT, "input", structure, mixable, None, why_not=why_not)]
    for name in order:
        if not name:
            continue
        output, _, out_node = seen[name]
        structure, mixable, why_not = _structure(
            output, parse_site(name), BatchDims(model, parse_site(name)), batch
        )
        residual, on_skip = None, False
        for parent in _ancestors(name) if mixable else []:
            _, parent_in, parent_out = seen.get(parent, (None, None, None))
            if _reaches(parent_out, parent_in, blocked={out_node}):
                residual = parent or "(the model)"
                on_skip = _on_skip_path(model, names, seen, name, parent)
                break
        kind = type(model.get_submodule(name)).__name__
        rows.append(LayerInfo(name, kind, structure, mixable, residual, counts[name], on_skip, why_not))
    portable = layers.portable_names(model)
    for row in rows:
        row.portable = " ".join(portable.get(row.name, ()))
    return rows


def _structure(output, site, dims: BatchDims, batch: int | None) -> tuple[str, bool, str]:
    """What a layer returned, element by element with each batch dimension, whether it can be mixed as a
    whole, and if not why (the refusal a mixer would give)."""
    try:
        found, size = batch_leaves(output, site, dims, "a mixer")
        if batch is not None and size != batch:
            raise TypeError(f"its batch dimension has size {size}, not the batch's {batch}")
        carried, why = {leaf.path: leaf.dim for leaf in found}, ""
    except (TypeError, ValueError) as err:
        carried, why = {}, str(err).removeprefix(f"a mixer at {site.spec!r}: ")
    if isinstance(output, torch.Tensor):
        shape = str(tuple(output.shape))
        return (shape if carried.get((), 0) == 0 else f"{shape} batch@{carried[()]}"), bool(carried), why
    parts = []
    for path, value in leaves(output):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        text = f"{format_path(path)} {shape}"
        parts.append(text + (f" batch@{carried[path]}" if path in carried else ""))
    return f"{type(output).__name__}: {', '.join(parts)}", bool(carried), why


def _on_skip_path(model: nn.Module, names: dict, seen: dict, name: str, parent: str) -> bool:
    """Whether ``name`` lies on the skip path of residual block ``parent``: the child of ``parent`` that
    holds it belongs to the parallel branch with the fewest modules. Two children are on different
    branches when blocking both cuts every path from the block's output back to its input."""
    _, parent_in, parent_out = seen[parent]
    prefix = f"{parent}." if parent else ""
    children = [
        n
        for n in seen
        if n.startswith(prefix) and n and "." not in n[len(prefix) :] and seen[n][2] is not None
    ]
    mine = next((c for c in children if name == c or name.startswith(c + ".")), None)
    if mine is None:
        return False

    def branch(child: str) -> set[str]:
        return {
            c for c in children if c == child or _reaches(parent_out, parent_in, {seen[child][2], seen[c][2]})
        }

    own = branch(mine)
    return any(len(branch(c)) > len(own) for c in children if c not in own)


def _ancestors(name: str) -> list[str]:
    """``"layer2.0.bn1"`` -> ``["layer2.0", "layer2", ""]`` (innermost first; ``""`` is the model)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _reaches(start, target, blocked: set) -> bool:
    """Whether the autograd graph leads from node ``start`` back to node ``target`` without passing
    through a node in ``blocked``."""
    if start is None or target is None or start in blocked:
        return False
    stack, visited = [start], {start, *blocked}
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
    head = ("layer", "portable", "type", "output", "mixable", "note")
    body = [
        (
            r.name,
            r.portable,
            r.kind,
            r.output.removeprefix("a tensor of shape "),
            "yes" if r.mixable else "no",
            _note(r),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in (head, *body)) for i in range(5)]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip((*line[:5], line[5]), (*widths, 0), strict=True))
        for line in (head, *body)
    ]
    return "\n".join(line.rstrip() for line in lines)


def _note(row: LayerInfo) -> str:
    notes = []
    if row.why_not:
        notes.append(row.why_not)
    if row.residual_in and row.on_skip:
        notes.append(
            f"on the skip path of residual block {row.residual_in}: the residual branch stays unmixed"
        )
    elif row.residual_in:
        notes.append(f"inside residual block {row.residual_in}: the skip path stays unmixed")
    if row.calls > 1:
        notes.append(f"runs {row.calls} times per forward: a mixer mixes its first output")
    return "; ".join(notes)


def _statement(model: nn.Module) -> str:
    """Where the portable column comes from, or why it is empty."""
    found = layers.describe(model)
    if found is None:
        kind = type(model).__name__
        return (
            f"portable specs: {kind} states no stages or blocks (mixhook.register_layers({kind}, ...) "
            "states them); name real layers"
        )
    parts = [f"portable specs ({found.source}): {len(found.stages)} stages, {len(found.blocks)} blocks"]
    parts += [why for why in (found.no_stages, found.no_blocks) if why]
    return "; ".join(parts)


def main(argv: list[str]) -> int:
    """``mixhook-layers [overrides]``: print the table for the app's model and data."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(USAGE, end="")
        return 0
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    from .build import build_model_and_data
    from .command_line import check_command_line
    from .conf import CONF_DIR, CONF_MODULE
    from .errors import ConfigError
    from .hydra_compat import VERSION_BASE

    problem = check_command_line(argv, str(CONF_DIR))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        with initialize_config_module(config_module=CONF_MODULE, **VERSION_BASE):
            cfg = compose(config_name="config", overrides=argv)
        model, data = build_model_and_data(cfg)
    except (ConfigError, HydraException) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    x = next(iter(data.test))[0][:2]
    rows = browse(model, x)
    try:
        method = judge_by_method(cfg, model, data, x, rows, layer_given=_sets(argv, "mixup.layer"))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{type(model).__name__} on a {data.name} batch of shape {tuple(x.shape)}:")
    print(_statement(model))
    print(method)
    print(format_table(rows))
    return 0


def _sets(argv: list[str], key: str) -> bool:
    """Whether the command line sets ``key`` (``key=...``, ``+key=...``, ``++key=...``)."""
    return any(arg.lstrip("+~").split("=", 1)[0] == key for arg in argv)


def judge_by_method(
    cfg, model: nn.Module, data, x: torch.Tensor, rows: list[LayerInfo], layer_given: bool = True
) -> str:
    """Make the mixable column the configured method's verdict (``mixup=...``): each layer a mixer can
    blend is checked by the method built at that layer, as ``train.py`` checks its layer before training
    (CutMix refuses a 1x1 map and the logits, a token method a map). The configured ``mixup`` must attach
    to the model as ``train.py`` attaches it (:class:`~mixhook.app.errors.ConfigError`, its one line,
    otherwise: an unknown ``mixup.layer``, or TransMix's ``attention`` on a CNN); the config's default
    ``mixup.layer`` only where ``layer_given`` (a browser is run to find a new model's layers). Returns the
    line that says whose verdict the column is."""
    from omegaconf import OmegaConf

    from mixhook.layers import UnknownLayerError, trace_outputs

    from .build import build_hook
    from .errors import ConfigError
    from .preflight import attach

    node = cfg.mixup
    if not node.get("_target_"):
        return "mixable: whether a mixer can blend the whole output (mixup=none: no method to ask)"
    hook = build_hook(node, "mixup", cfg.seed)
    try:
        attach(model, "mixup", hook, data).remove()
    except ConfigError as err:
        if layer_given or not str(err).startswith("mixup.layer:"):
            raise
    name = type(hook).__name__
    if "layer" not in node:
        return f"mixable: whether a mixer can blend the whole output ({name} takes no mixup.layer)"
    outputs = trace_outputs(model, [row.name for row in rows if row.mixable], x)
    for row in rows:
        if not row.mixable:
            continue
        at = build_hook(OmegaConf.merge(node, {"layer": row.name}), "mixup", cfg.seed)
        try:
            handle = at.attach(model)
            try:
                at.check_output(row.name, outputs[row.name], x.shape[0], model_input=x)
            finally:
                handle.remove()
        except (UnknownLayerError, TypeError, ValueError) as err:
            why = str(err).replace(f"{name} at {row.name!r}: ", "").replace(f"{name} at {row.name!r} ", "")
            row.mixable, row.why_not = False, why
    return f"mixable: whether mixup={name} (its other settings as configured) can mix the layer"
