"""Probes: hooks that look and never touch. They record what layers compute and what flows back through
them, with the same layer names and the same attach/remove mechanism as the regularizers.

- :class:`FeatureRecorder`: each layer's output after a forward (a feature extractor), before or after
  an attached regularizer's mix;
- :class:`ActivationStats`: per layer and step, mean, std, fraction of zeros, max |x|, non-finite count;
- :class:`GradStats`: per layer and step, the L2 norm of the gradient at the layer's output and of its
  parameters' gradients;
- :class:`ShapeTrace`: once, every module's input and output shapes and dtypes in call order.

A probe's hooks return ``None`` and only read tensors (statistics are computed under ``no_grad`` on
detached values), so outputs and gradients are bit-for-bit those of the model without it. Statistics
stay on the device as tensors until :meth:`rows` is called, so recording does not synchronise with
the GPU each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import recompute
from .hooks import LayerHook, check_state
from .sites import INPUT, Inputs, leaves, select


def _tensor(output) -> torch.Tensor | None:
    """The tensor a probe reads: ``output`` itself, or the first tensor in it (a layer's main output)."""
    if isinstance(output, torch.Tensor):
        return output
    return next((t for _, t in leaves(output) if isinstance(t, torch.Tensor)), None)


class _Probe(LayerHook):
    """Shared by the probes: ``every``-th training forward is recorded (all forwards when
    ``train_only`` is false), and :meth:`output_hooks` registers a read-only hook per layer."""

    _hooks_model = True  # its own hooks on the model (see LayerHook)

    def __init__(self, layer: str | Sequence[str], every: int = 1, train_only: bool = True):
        super().__init__(layer)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.every, self.train_only = every, train_only
        self.step = 0  # training forwards seen
        self.paused = False  # while true, forwards are neither counted nor recorded
        self._active = False

    def state_dict(self) -> dict:
        """:meth:`~mixhook.LayerHook.state_dict` with the count of training forwards seen, so that a
        resumed run records at the same steps (``every``)."""
        return {**super().state_dict(), "step": self.step}

    def load_state_dict(self, state) -> None:
        check_state(self, state, ("step",))
        self.step = int(state["step"])

    def _register_root(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        """Registered last, prepended: it runs first, ahead of any hook on the model's input."""
        begin = recompute.hook(self._on_model_input)  # (a recomputation is not a new forward)
        handles.append(model.register_forward_pre_hook(begin, prepend=True))

    def _on_model_input(self, model: nn.Module, args) -> None:
        if self.paused or (self.train_only and not model.training):
            self._active = False
            return
        self.step += 1
        self._active = (self.step - 1) % self.every == 0

    def _output_hooks(
        self, modules: dict, handles: list, record, prepend: bool = False, recomputed=None
    ) -> None:
        """``record(spec, value)`` with what each site gives (its selected element, or the output/first
        argument), once per forward: a recomputation by activation checkpointing is not recorded again
        (``recomputed(spec, value)`` is called instead, where given)."""

        def look(spec: str, value) -> None:
            record(spec, self._pick(spec, value))

        def again(spec: str, value) -> None:
            recomputed(spec, self._pick(spec, value))

        see = recompute.hook(look, again if recomputed is not None else None)
        for spec, module in modules.items():
            if self.sites[spec].layer == INPUT:  # the model's input: read before anything (input mixup)
                hook = module.register_forward_pre_hook(
                    lambda m, args, kwargs, spec=spec: see(spec, Inputs(m, args, kwargs)),
                    prepend=prepend,
                    with_kwargs=True,
                )
            else:
                hook = module.register_forward_hook(
                    lambda m, a, out, spec=spec: see(spec, out), prepend=prepend
                )
            handles.append(hook)

    def _pick(self, spec: str, value):
        """The selected element (the first tensor of a selection), or the value as the layer gave it."""
        site = self.sites[spec]
        if isinstance(value, Inputs):
            if site.paths is None:
                return value.first()[1] if len(value) else None
        elif site.paths is None:
            return value
        return next((t for _, t in select(value, site, "its output") if isinstance(t, torch.Tensor)), None)


class FeatureRecorder(_Probe):
    """After each forward, ``.features[name]`` is what layer ``name`` returned.

    Args:
        layer: a layer name or a list of them (``"input"`` included).
        detach: store detached tensors (default); ``False`` keeps them in the graph.
        to_cpu: copy them to the CPU.
        where: with a regularizer on the same layer, ``"after"`` (default) records what the layer hands
            on, the mixed output, and ``"before"`` what the layer itself computed. ``"before"`` runs
            ahead of every other hook on the layer; ``"after"`` behind those attached before it, so
            attach the recorder after the regularizer (``attach(model, mixer, recorder)``).
        train_only: record training forwards only (default ``False``: every forward).
    """

    def __init__(
        self,
        layer: str | Sequence[str],
        detach: bool = True,
        to_cpu: bool = False,
        where: str = "after",
        train_only: bool = False,
    ):
        super().__init__(layer, train_only=train_only)
        if where not in ("before", "after"):
            raise ValueError(f"where must be 'before' or 'after', got {where!r}")
        self.detach, self.to_cpu, self.where = detach, to_cpu, where
        self.features: dict[str, object] = {}

    def __repr__(self) -> str:
        return f"FeatureRecorder(layer={self._layer_spec!r}, where={self.where!r})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        self._output_hooks(modules, handles, self._record, prepend=self.where == "before")
        self._register_root(model, handles)

    def _record(self, name: str, output) -> None:
        if not self._active:
            return
        t = _tensor(output)
        if t is None:
            self.features[name] = output
            return
        t = t.detach() if self.detach else t
        self.features[name] = t.to("cpu", copy=True) if self.to_cpu else t


class ActivationStats(_Probe):
    """Per layer and recorded training step: ``mean``, ``std``, ``zeros`` (fraction exactly 0), ``max_abs``
    and ``nonfinite`` (count of NaN/inf) of the layer's output.

    Args:
        layer: a layer name or a list of them.
        every: record every ``every``-th training forward (1: all).
    """

    STATS = ("mean", "std", "zeros", "max_abs", "nonfinite")

    def __init__(self, layer: str | Sequence[str], every: int = 1):
        super().__init__(layer, every)
        self._records: list[tuple[int, str, torch.Tensor]] = []

    def __repr__(self) -> str:
        return f"ActivationStats(layer={self._layer_spec!r}, every={self.every})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        self._output_hooks(modules, handles, self._record)
        self._register_root(model, handles)

    @torch.no_grad()
    def _record(self, name: str, output) -> None:
        t = _tensor(output)
        if not self._active or t is None or not t.is_floating_point():
            return
        x = t.detach().float()
        finite = torch.isfinite(x)
        safe = torch.where(finite, x, torch.zeros((), device=x.device))
        std = safe.std() if x.numel() > 1 else torch.zeros((), device=x.device)
        zeros, nonfinite = (x == 0).float().mean(), (~finite).sum().float()
        stats = torch.stack([safe.mean(), std, zeros, safe.abs().max(), nonfinite])
        self._records.append((self.step, name, stats))

    def rows(self, clear: bool = True) -> list[dict]:
        """The recorded statistics, one dict per (step, layer): ``step, layer, mean, std, zeros,
        max_abs, nonfinite`` (statistics over the finite values; ``nonfinite`` counts the others)."""
        records, out = self._records, []
        if clear:
            self._records = []
        if not records:
            return out
        values = torch.stack([r[2] for r in records]).cpu().tolist()  # one transfer for all
        for (step, name, _), row in zip(records, values, strict=True):
            out.append({"step": step, "layer": name, **dict(zip(self.STATS, row, strict=True))})
        return out


class GradStats(_Probe):
    """Per layer and recorded training step: ``grad_norm``, the L2 norm of the gradient arriving at the
    layer's output, and ``param_grad_norm``, the L2 norm of the gradients of the layer's parameters
    (recursively), as accumulated by that backward.

    Args:
        layer: a layer name or a list of them (not ``"input"``: it has no parameters or output hook).
        every: record every ``every``-th training forward's backward (1: all).
    """

    def __init__(self, layer: str | Sequence[str], every: int = 1):
        super().__init__(layer, every)
        if any(site.layer == INPUT for site in self.sites.values()):
            raise ValueError(
                "GradStats reads gradients at layers' outputs and parameters; 'input' has neither"
            )
        self._records: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"GradStats(layer={self._layer_spec!r}, every={self.every})"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        self._output_hooks(modules, handles, self._on_output, recomputed=self._on_recomputed)
        self._register_root(model, handles)
        for name, module in modules.items():
            for p in module.parameters():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(self._param_hook(name)))

    def _on_output(self, name: str, output) -> None:
        t = _tensor(output)
        if not self._active or t is None:
            return
        if t.requires_grad:
            step = self.step
            t.register_hook(lambda g, name=name, step=step: self._add(step, name, "grad_norm", g))
        else:  # gradients off: a reentrant checkpoint's forward, whose recomputation carries the gradient
            self._note(name, self.step)

    def _on_recomputed(self, name: str, output) -> None:
        step = self._replayed(name)
        t = _tensor(output)
        if step is not None and t is not None and t.requires_grad:
            t.register_hook(lambda g, name=name, step=step: self._add(step, name, "grad_norm", g))

    def _param_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if self._active and p.grad is not None:
                self._add(self.step, name, "param_grad_norm", p.grad)

        return hook

    @torch.no_grad()
    def _add(self, step: int, name: str, key: str, grad: torch.Tensor) -> None:
        slot = self._records.setdefault((step, name), {})
        squared = grad.detach().float().pow(2).sum()
        slot[key] = slot[key] + squared if key in slot else squared  # norms combine as sums of squares

    def rows(self, clear: bool = True) -> list[dict]:
        """One dict per (step, layer): ``step, layer, grad_norm, param_grad_norm`` (NaN where none)."""
        records = self._records
        if clear:
            self._records = {}
        keys = ("grad_norm", "param_grad_norm")
        nan = torch.tensor(float("nan"))
        flat = [slot.get(k, nan).to("cpu") for slot in records.values() for k in keys]
        values = torch.stack(flat).sqrt().tolist() if flat else []
        return [
            {"step": step, "layer": name, **dict(zip(keys, values[2 * i : 2 * i + 2], strict=True))}
            for i, (step, name) in enumerate(records)
        ]


class ShapeTrace(LayerHook):
    """Records, for the first forward after attaching, every module's input and output shapes and dtypes
    in call order; ``str(trace)`` (or :meth:`table`) prints them, for shape-mismatch debugging."""

    def __init__(self):
        super().__init__("input")
        self.calls: list[tuple[str, str, str, str]] = []  # name, type, inputs, outputs
        self._done = False

    def __repr__(self) -> str:
        return "ShapeTrace()"

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        names = {m: n for n, m in model.named_modules()}
        pending: list[str] = []

        def before(module, args):
            if not self._done:
                pending.append(_shapes(args))

        def after(module, args, output):
            if self._done:
                return
            entry = (names[module] or "(model)", type(module).__name__, pending.pop(), _shapes(output))
            self.calls.append(entry)
            if module is model:
                self._done = True

        for module in names:
            handles.append(module.register_forward_pre_hook(before))
            handles.append(module.register_forward_hook(after))

    def table(self) -> str:
        head = ("module", "type", "input", "output")
        lines = [head, *self.calls]
        widths = [max(len(line[i]) for line in lines) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line[:3], widths, strict=True)) + "  " + line[3]
            for line in lines
        )

    def __str__(self) -> str:
        return self.table()


def _shapes(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        inner = [_shapes(v) for v in value]
        return inner[0] if len(inner) == 1 and isinstance(value, tuple) else f"[{', '.join(inner)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shapes(v)}" for k, v in value.items()) + "}"
    return type(value).__name__
