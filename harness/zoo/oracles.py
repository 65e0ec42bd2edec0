"""One model of the zoo, run through oracles that need no hand-written reference per model.

Every case mixes one sampled layer of a model with a pinned draw (a 4-cycle as the partner index, so no
sample is its own partner) and is judged against something mixhook does not compute:

- **the hand edit**: the same model with a plain forward hook on the layer that does what the method's
  formula says, on the first call of the layer (the documented rule for a layer called several times):
  ``lam * h + (1 - lam) * h[index]`` for every floating tensor the layer returns whose first dimension is
  the batch (Manifold Mixup); the box of ``h[index]`` pasted over the map's height and width, read from the
  input's own height and width (:func:`spatial_axes`), not from mixhook (CutMix); on a ViT's tokens, the
  box pasted on the patch grid the library states and the leading tokens blended by the box's lam. Logits
  and every parameter's gradient, in float64.
- **metamorphic**: with lam = 0 (or a box covering the whole map), a layer that dominates the output (the
  hand edit gives ``f(x)[index]``) must give exactly ``f(x)[index]`` and the gradients of ``f`` itself;
  with lam = 1, ``f(x)`` (both without a hand edit: the oracle is the unhooked model).
- **the same tensor**: a map cut at a layer and at the sub-module inside it that returns the very same
  tensor (a stage and its last block) gives the same result (CutMix); and for models that take padding
  masks, the same hidden state mixed at both on a padded batch (Manifold Mixup, the unions).
- **the unmixed sequence**: in an encoder-decoder, a mix at lam = 1 with only the *other* sequence padded
  per sample is ``f(x)`` (that sequence's masks, own or cross, stay each sample's own).
- **eval**: a model with every sampled layer hooked is bit-identical to the unhooked model in eval mode.
- **AutoMix** (``--methods automix``): the mask its Mix Block made, laid by hand over the map's own height
  and width as ``h (1 - m) + h[index] m`` (:func:`automix`).

Outcomes: ``exact``; ``refused`` (a one-line exception raised by mixhook itself); ``wrong`` (a silent
wrong result: the worst outcome); ``error`` (any other exception: a traceback a user would get); ``skipped``
(the oracle does not apply, said why).
"""

from __future__ import annotations

import copy
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mixhook import CutMix, ManifoldMixup

from .catalogue import B, Batch, ZooModel, criterion, logits_of, prepare

PERM = torch.tensor([1, 2, 3, 0])  # a 4-cycle
LAM = 0.3
_MIXHOOK = str(Path(__import__("mixhook").__file__).parent)


@dataclass
class Case:
    """The outcome of one oracle at one layer of one model."""

    model: str
    family: str
    layer: str
    method: str
    outcome: str  # exact | refused | wrong | error | skipped
    detail: str = ""


class Wrong(AssertionError):
    """A mixed result that differs from its oracle."""


# ------------------------------------------------------------------------------------------ one forward


@dataclass
class Result:
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]
    state: object = None


def _run(model: nn.Module, batch: Batch, loss: Callable) -> Result:
    model.zero_grad(set_to_none=True)
    logits = logits_of(model(*batch.args, **batch.kwargs))
    value, state = loss(logits)
    value.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return Result(logits.detach().clone(), grads, state)


def _mixed_loss(lam: float, labels: torch.Tensor) -> Callable:
    def loss(logits):
        mixed = lam * criterion(logits, labels) + (1 - lam) * criterion(logits, labels[PERM])
        return mixed, None

    return loss


def leaves(value, path=()):
    """``(path, tensor)`` of every tensor in a layer's output (tuples, lists, dicts, ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, (*path, k))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from leaves(v, (*path, i))


def _batched(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.ndim >= 1 and t.shape[0] == B


def _edit(value, fn):
    """``value`` with ``fn`` applied to every floating tensor whose first dimension is the batch."""
    if _batched(value):
        return fn(value)
    if isinstance(value, dict):
        new = {k: _edit(v, fn) for k, v in value.items()}
        if type(value) is dict:
            return new
        out = copy.copy(value)  # a ModelOutput: its fields and its items alike
        for k, v in new.items():
            out[k] = v
        return out
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_edit(v, fn) for v in value)
    return value


def _first_call(edit: Callable) -> Callable:
    calls = []

    def hook(module, args, output):
        calls.append(1)
        return edit(output) if len(calls) == 1 else None

    return hook


def spatial_axes(shape, size, spatial: int = 2) -> tuple[int, ...] | None:
    """The axes of a ``(B, ...)`` map that are the input's height and width (and, for ``spatial=3``, the
    depth before them), from the shape alone: the two candidate layouts (channels first or last) put them
    at ``(2, 3)`` or ``(1, 2)``, and the pair whose sizes are the input's ``size = (H, W)`` over one stride
    is the map's (``None`` where both or neither are: a square input with as many channels as columns)."""
    height, width = size
    found = []
    for first in (2, 1):
        axes = tuple(range(first, first + spatial))
        h, w = shape[axes[-2]], shape[axes[-1]]
        if abs(h * width - w * height) <= height + width and (h > 1 or w > 1):  # (a pixel either way)
            found.append(axes)
    return found[0] if len(found) == 1 else None


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-8, atol=1e-10 * scale))


def _compare(got: Result, expected: Result, what: str) -> None:
    if not close(got.logits, expected.logits):
        diff = (
            (got.logits - expected.logits).abs().max() if got.logits.shape == expected.logits.shape else None
        )
        raise Wrong(
            f"{what}: logits differ (max {diff:.3g})" if diff is not None else f"{what}: logits shape"
        )
    for name, g in expected.grads.items():
        mine = got.grads.get(name)
        if mine is None or not close(mine, g):
            raise Wrong(f"{what}: the gradient of {name} differs")
    missing = set(got.grads) - set(expected.grads)
    if missing:
        raise Wrong(f"{what}: gradients for {sorted(missing)[:2]} where the oracle has none")


def classify(exc: BaseException) -> tuple[str, str]:
    """``("refused", message)`` for a one-line exception raised in mixhook, else ``("error", ...)``."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = frames[-1].filename if frames else ""
    message = str(exc)
    if where.startswith(_MIXHOOK) and "\n" not in message and message:
        return "refused", f"{type(exc).__name__}: {message}"
    origin = f"{Path(where).name}:{frames[-1].lineno}" if frames else "?"
    return "error", f"{type(exc).__name__} at {origin}: {message.splitlines()[0] if message else ''}"


# ---------------------------------------------------------------------------------------- one model


class ZooRun:
    """One model of the zoo, built once, with its plain forward and the layers it runs."""

    def __init__(self, entry: ZooModel, seed: int = 0):
        self.entry = entry
        self.pristine = prepare(entry.build(), seed)
        self.work = copy.deepcopy(self.pristine)
        self.batch = entry.batch(seed=seed)
        self.calls: dict[str, int] = {}
        self.outputs: dict[str, object] = {}
        self.versions: dict[str, list[int]] = {}
        self.plain = self._record()
        self._dominates: dict[str, bool] = {}
        again = self.plain_of(self.batch)
        if not (
            close(again.logits, self.plain.logits)
            and all(close(again.grads[n], g) for n, g in self.plain.grads.items())
        ):
            raise RuntimeError("two plain forwards differ: the model draws at random in train mode")

    def _record(self) -> Result:
        """The plain forward, noting each module's calls and first output."""
        handles = []
        for name, module in self.work.named_modules():
            if name:
                handles.append(module.register_forward_hook(self._noter(name)))
        try:
            return _run(self.work, self.batch, lambda logits: (criterion(logits, self.batch.labels), None))
        finally:
            for h in handles:
                h.remove()

    def _noter(self, name):
        def note(module, args, output):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name not in self.outputs:
                self.outputs[name] = output
                self.versions[name] = [t._version for _, t in leaves(output)]  # (in-place changes after)

        return note

    def layers(self, count: int, seed: int = 0, where: Callable | None = None) -> list[str]:
        """``count`` layers spread over the forward's call order (those that return a floating tensor with
        the batch first, and satisfy ``where``), the same ones for the same seed."""
        names = [n for n in self.outputs if any(_batched(t) for _, t in leaves(self.outputs[n]))]
        if where is not None:
            names = [n for n in names if where(self, n)]
        if len(names) <= count:
            return names
        g = torch.Generator().manual_seed(seed)
        step = len(names) / count
        picks = [int(i * step + float(torch.rand((), generator=g)) * step) for i in range(count)]
        return [names[min(p, len(names) - 1)] for p in picks]

    def first_map(self, layer: str) -> torch.Tensor | None:
        return next((t for _, t in leaves(self.outputs[layer]) if _batched(t)), None)

    # ---------------------------------------------------------------------------------- the passes

    def hand(self, layer: str, edit: Callable, loss: Callable, batch: Batch | None = None) -> Result:
        """The hand edit: a plain forward hook on ``layer`` applying ``edit`` to every floating tensor with
        the batch first that its first call returns."""
        hook = _first_call(lambda output: _edit(output, edit))
        handle = self.work.get_submodule(layer).register_forward_hook(hook)
        try:
            return _run(self.work, batch or self.batch, loss)
        finally:
            handle.remove()

    def mixhook(self, mixer, batch: Batch | None = None, **pin) -> Result:
        batch = batch or self.batch
        with mixer.attach(self.work):
            mixer.pin(**pin)

            def loss(logits):
                return mixer.loss(criterion, logits, batch.labels), mixer.state_for(logits)

            return _run(self.work, batch, loss)

    def plain_of(self, batch: Batch) -> Result:
        return _run(self.work, batch, lambda logits: (criterion(logits, batch.labels), None))

    def dominates(self, layer: str) -> bool:
        """Whether the output depends on the input only through ``layer`` (its first call): the hand edit
        at lam = 0 gives ``f(x)[index]``."""
        if layer not in self._dominates:
            zero = self.hand(layer, lambda t: t[PERM], _mixed_loss(0.0, self.batch.labels))
            self._dominates[layer] = close(zero.logits, self.plain.logits[PERM])
        return self._dominates[layer]

    def permuted_plain(self) -> Result:
        return Result(self.plain.logits[PERM], self.plain.grads)


# ---------------------------------------------------------------------------------------- the oracles


def manifold(run: ZooRun, layer: str) -> str:
    """ManifoldMixup against the hand edit (lam 0.3); lam 0 against ``f(x)[index]`` where the layer
    dominates; lam 1 against ``f(x)``."""
    labels = run.batch.labels
    hand = run.hand(layer, lambda t: LAM * t + (1 - LAM) * t[PERM], _mixed_loss(LAM, labels))
    got = run.mixhook(ManifoldMixup(layer), lam=LAM, index=PERM)
    _compare(got, hand, "lam 0.3 against the hand edit")
    notes = []
    if run.dominates(layer):
        zero = run.mixhook(ManifoldMixup(layer), lam=0.0, index=PERM)
        _compare(zero, run.permuted_plain(), "lam 0 against f(x)[index]")
        notes.append("dominates")
    one = run.mixhook(ManifoldMixup(layer), lam=1.0, index=PERM)
    _compare(one, run.plain, "lam 1 against f(x)")
    return ", ".join(notes)


def _paste(box_of: Callable) -> Callable:
    def edit(t):
        where = box_of(t)
        out = t.clone()
        out[where] = t[PERM][where]
        return out

    return edit


def _map_axes(run: ZooRun, layer: str, t: torch.Tensor) -> tuple[int, ...] | str:
    """The position axes of the map ``t`` at ``layer`` (an audio model's ``(B, C, L)`` or ``(B, L, C)``: the
    frames outnumber the channels; a 4-D or 5-D map's: its sides read from the input's), or what the case
    says where they cannot be told (or where mixhook must refuse the tensor, checked)."""
    if t.ndim == 3 and run.entry.kind == "audio":
        a, b = t.shape[1], t.shape[2]
        axes = (2,) if b >= 4 * a else (1,) if a >= 4 * b else None
        return axes or f"skipped: the positions of {tuple(t.shape)} cannot be told from its sides"
    if t.ndim not in (4, 5):
        return _expect_refusal(run, layer, f"a {t.ndim}-D tensor")
    axes = spatial_axes(t.shape, run.entry.size, t.ndim - 2)
    if axes is None:  # mixhook must refuse it, or the case cannot be judged
        got = run.mixhook(CutMix(layer), index=PERM)
        shape = tuple(got.state.weights.shape[1:])
        return f"skipped: the sides of {tuple(t.shape)} cannot be told from the input's (cut as {shape})"
    return axes


def cutmix(run: ZooRun, layer: str) -> str:
    """CutMix with a pinned box, against the box pasted by hand over the map's own height and width (read
    from the input's); the whole map against ``f(x)[index]`` where the layer dominates. A ViT's tokens with
    ``tokens="auto"``, against the box pasted on the library's stated patch grid."""
    t = run.first_map(layer)
    if t is None:
        return "skipped: no floating tensor with the batch first"
    if t.ndim == 3 and run.entry.grid is not None:
        return _token_cutmix(run, layer, t)
    axes = _map_axes(run, layer, t)
    if isinstance(axes, str):  # (what the case says instead: skipped, or the refusal it checked)
        return axes
    sides = [t.shape[a] for a in axes]
    if min(sides) < 2:
        return _expect_refusal(run, layer, f"a map of sides {sides}")
    bounds = [(0, math.ceil(s / 2)) for s in sides[:-1]] + [(sides[-1] // 3, sides[-1])]
    box = tuple(v for pair in bounds for v in pair)
    lam = 1 - math.prod(b - a for a, b in bounds) / math.prod(sides)

    def where(x):
        index = [slice(None)] * x.ndim
        for axis, (a, b) in zip(axes, bounds, strict=True):
            index[axis] = slice(a, b)
        return tuple(index)

    got = run.mixhook(CutMix(layer), index=PERM, box=box)  # (first: it refuses what has several maps)
    hand = run.hand(layer, _paste(where), _mixed_loss(lam, run.batch.labels))
    _compare(got, hand, f"a box over axes {axes}")
    weights = got.state.weights
    if tuple(weights.shape[-len(sides) :]) != tuple(sides):
        raise Wrong(f"weights of shape {tuple(weights.shape)} for a {sides} map")
    same = _same_tensor(run, layer)
    if same is not None:  # the very same map, cut at the module inside that returns it
        _compare(run.mixhook(CutMix(same), index=PERM, box=box), got, f"cut at {same!r} (the same tensor)")
    if run.dominates(layer):
        whole = tuple(v for s in sides for v in (0, s))
        full = run.mixhook(CutMix(layer), index=PERM, box=whole)
        _compare(full, run.permuted_plain(), "the whole map against f(x)[index]")
        return "dominates"
    return ""


def _token_cutmix(run: ZooRun, layer: str, t: torch.Tensor) -> str:
    rows, cols, prefix = run.entry.grid(run.pristine)
    if t.shape[1] not in (rows * cols, rows * cols + prefix):
        return _expect_refusal(run, layer, f"{t.shape[1]} tokens, not the {rows}x{cols} grid")
    lead = t.shape[1] - rows * cols
    r, c = (0, math.ceil(rows / 2)), (cols // 3, cols)
    lam = 1 - (r[1] - r[0]) * (c[1] - c[0]) / (rows * cols)

    def edit(x):
        grid = x[:, lead:].unflatten(1, (rows, cols)).clone()
        partner = x[PERM][:, lead:].unflatten(1, (rows, cols))
        grid[:, r[0] : r[1], c[0] : c[1]] = partner[:, r[0] : r[1], c[0] : c[1]]
        head = lam * x[:, :lead] + (1 - lam) * x[PERM][:, :lead]
        return torch.cat([head, grid.flatten(1, 2)], dim=1)

    got = run.mixhook(CutMix(layer, tokens="auto"), index=PERM, box=(*r, *c))
    hand = run.hand(layer, edit, _mixed_loss(lam, run.batch.labels))
    _compare(got, hand, f"tokens on the {rows}x{cols} grid")
    return "tokens"


def _expect_refusal(run: ZooRun, layer: str, what: str) -> str:
    """A map CutMix cannot cut: it must refuse (a mix would be a wrong result the oracle cannot judge)."""
    run.mixhook(CutMix(layer), index=PERM)
    raise Wrong(f"CutMix cut {what} without refusing")


def padding(run: ZooRun, layer: str) -> str:
    """On a padded batch: the layer and its sub-module that returns the very same tensor mix alike; in an
    encoder-decoder, lam 1 with only the other sequence padded is ``f(x)``."""
    entry = run.entry
    if entry.kind not in ("text", "causal", "seq2seq"):
        return "skipped: no padding masks"
    notes = []
    same = _same_tensor(run, layer)
    if same is not None:
        padded = entry.batch("source")
        at_layer = run.mixhook(ManifoldMixup(layer), padded, lam=LAM, index=PERM)
        inside = run.mixhook(ManifoldMixup(same), padded, lam=LAM, index=PERM)
        _compare(inside, at_layer, f"mixed at {same!r} (the same tensor)")
        notes.append(f"same as {same}")
    if entry.kind == "seq2seq":
        in_decoder = "decoder" in layer.split(".")
        other = entry.batch("source" if in_decoder else "target")
        got = run.mixhook(ManifoldMixup(layer), other, lam=1.0, index=PERM)
        _compare(got, run.plain_of(other), "lam 1 with the unmixed sequence padded")
        notes.append("source padded" if in_decoder else "target padded")
    return ", ".join(notes) if notes else "skipped: no sub-module returns the same tensor"


def _same_tensor(run: ZooRun, layer: str) -> str | None:
    """A module inside ``layer`` whose first call returns the one tensor with the batch that ``layer``
    returns (and nothing else that carries the batch), unchanged since (not a tensor changed in place
    after: ``x = bn2(x); x += shortcut`` returns bn2's tensor with other values)."""
    mine = [
        (t, v)
        for (_, t), v in zip(leaves(run.outputs[layer]), run.versions[layer], strict=True)
        if _batched(t)
    ]
    if len(mine) != 1:
        return None
    for name, output in run.outputs.items():
        theirs = [(t, v) for (_, t), v in zip(leaves(output), run.versions[name], strict=True) if _batched(t)]
        if name.startswith(f"{layer}.") and len(theirs) == 1 and theirs[0][0] is mine[0][0]:
            return name if theirs[0][1] == mine[0][1] else None
    return None


def automix(run: ZooRun, layer: str) -> str:
    """AutoMix with its mask's layer and its features both at ``layer`` (the channels stated from the map,
    the Mix Block's weights drawn large enough that the mask varies over the map), against the hand edit
    ``h (1 - m) + h[index] m`` with the mask it recorded, laid over the map's own height and width (read
    from the input's): a mask laid over the wrong axes is a wrong result. Only the mixed loss (no clean
    rows, no Mix Block losses), whose weights are lam's."""
    from mixhook import AutoMix

    t = run.first_map(layer)
    if t is None:
        return "skipped: no floating tensor with the batch first"
    if t.ndim == 3 and run.entry.grid is not None:
        return "skipped: tokens (AutoMix mixes a ViT's input; feature_tokens= reads its features)"
    options = {"clean_weight": 0.0, "block_weight": 0.0, "mask_loss": 0.0, "lam_margin": 0.0}
    if t.ndim != 4:
        run.mixhook(AutoMix(layer, layer, channels=t.shape[1], **options), lam=LAM, index=PERM)
        raise Wrong(f"AutoMix mixed a {t.ndim}-D tensor without refusing")
    axes = spatial_axes(t.shape, run.entry.size, 2)
    if axes is None:  # (a 1x1 map, sides the input's do not tell: the oracle cannot lay the mask)
        return f"skipped: the sides of {tuple(t.shape)} cannot be told from the input's"
    channels = t.shape[({1, 2, 3} - set(axes)).pop()]
    mix = AutoMix(layer, layer, channels=channels, generator=torch.Generator().manual_seed(0), **options)
    for p in mix.mix_block.parameters():
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    got = run.mixhook(mix, lam=LAM, index=PERM)
    m = mix.last.info["mask"].detach()  # (B, 1, H, W): the partner's share, channels first
    share = m.permute(0, 2, 3, 1) if axes == (1, 2) else m
    hand = run.hand(layer, lambda h: h * (1 - share) + h[PERM] * share, _mixed_loss(LAM, run.batch.labels))
    _compare(got, hand, f"the recorded mask over axes {axes}")
    return "" if float(m.std()) > 1e-6 else "a constant mask (a 1x1 map)"


ORACLES = {"manifold": manifold, "cutmix": cutmix, "padding": padding, "automix": automix}


def judge(run: ZooRun, layer: str, method: str) -> Case:
    entry = run.entry
    try:
        detail = ORACLES[method](run, layer)
        outcome = "skipped" if detail.startswith("skipped") else "exact"
        detail = detail.removeprefix("skipped: ")
    except Wrong as exc:
        outcome, detail = "wrong", str(exc)
    except Exception as exc:  # noqa: BLE001 (every exception is an outcome to report)
        outcome, detail = classify(exc)
    return Case(entry.name, entry.family, layer, method, outcome, detail)


def eval_identical(run: ZooRun, layers: list[str]) -> Case:
    """Every sampled layer hooked (ManifoldMixup and CutMix): eval mode is bit-identical."""
    entry = run.entry
    model = run.work
    model.eval()
    try:
        with torch.no_grad():
            plain = logits_of(model(*run.batch.args, **run.batch.kwargs))
            with ManifoldMixup(layers).attach(model):
                hooked = logits_of(model(*run.batch.args, **run.batch.kwargs))
        outcome = "exact" if torch.equal(plain, hooked) else "wrong"
        detail = "" if outcome == "exact" else "eval output differs"
    except Exception as exc:  # noqa: BLE001
        outcome, detail = classify(exc)
    finally:
        model.train()
    return Case(entry.name, entry.family, "(every sampled layer)", "eval", outcome, detail)


def methods_of(entry: ZooModel) -> tuple[str, ...]:
    """The oracles that apply to a model's kind."""
    if entry.kind in ("text", "causal", "seq2seq"):
        return ("manifold", "padding")
    return ("manifold", "cutmix")


def run_model(entry: ZooModel, count: int = 9, methods=None, seed: int = 0) -> list[Case]:
    """Every oracle of ``methods`` (by default those of the model's kind) at ``count`` sampled layers of
    ``entry``, and the eval check."""
    try:
        run = ZooRun(entry, seed)
    except Exception as exc:  # noqa: BLE001
        return [Case(entry.name, entry.family, "", "build", "error", classify(exc)[1])]
    layers = run.layers(count, seed)
    cases = [judge(run, layer, method) for layer in layers for method in (methods or methods_of(entry))]
    cases.append(eval_identical(run, layers))
    return cases
