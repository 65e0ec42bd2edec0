"""The gradient of the loss at the layer a mixer would mix: one more forward and a partial backward, for the
methods that place their regions by gradient saliency."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..sharding import unshard_again
from ..sites import INPUT, Inputs, Leaf, describe, rebuild_inputs, replace_leaves
from ..transfer import to_device


class GradientPass:
    """The gradient pass of one mixer, a collaborator of its hooks: :meth:`gradient_at` runs it; while it
    runs (:attr:`running`), the mixer's hooks hand the model's input and the layers' outputs to
    :meth:`input` and :meth:`layer` instead of mixing.

    Args:
        kind: the mixer's class name (for its messages).
        sites: the mixer's sites, by spec.
        leaves: ``leaves(spec, value)``: what the mixer acts on in ``value`` (a layer's output, or the
            model's :class:`~mixhook.sites.Inputs`): the site's value and the leaves that carry the batch.
        as_given: ``as_given(spec, leaf, model)``: a leaf's tensor as the method is given it (a token grid's
            ``(B, D, gh, gw)`` map, a channels-last map's channels-first view).
    """

    def __init__(self, kind: str, sites: dict, leaves: Callable, as_given: Callable):
        self._kind, self._sites, self._leaves, self._as_given = kind, sites, leaves, as_given
        self._capture: dict | None = None  # while it runs: the spec, and the leaf whose gradient is taken
        self.running = False  # whether a pass (gradient_at, plain_forward) runs its forward now

    def gradient_at(self, model: nn.Module, args: tuple, kwargs: dict, spec: str, target) -> torch.Tensor:
        """The gradient of the summed cross-entropy of ``model(*args, **kwargs)`` against ``target``
        with respect to what the method would be given at ``spec`` (see
        :meth:`~mixhook.engine.mixer.Mixer.gradient_at`)."""
        if target is None:
            raise RuntimeError(
                f"{self._kind} needs the batch's labels for its gradient pass: call "
                "use_targets(y) before each training forward (the app's loop does)"
            )
        modes = [(m, m.training) for m in model.modules()]
        self._capture, self.running = {"spec": spec}, True
        try:
            model.eval()
            with torch.enable_grad():
                out = model(*args, **kwargs)
                logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
                if logits is None and isinstance(out, Mapping):  # a dict of outputs, as the Trainer takes
                    logits = out.get("logits")
                if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
                    raise TypeError(
                        f"{self._kind}'s gradient pass needs (B, classes) logits from the model, "
                        f"got {describe(out)}"
                    )
                leaf = self._capture.get("leaf")
                if leaf is None:
                    raise RuntimeError(f"mixup layer {spec!r} did not run in the gradient pass")
                target = to_device(target, logits.device)
                if target.shape != logits.shape[:1]:
                    raise ValueError(
                        f"use_targets(): {tuple(target.shape)} labels for a batch of {logits.shape[0]} logits"
                    )
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp16/bf16: in fp32
                loss = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
                (grad,) = torch.autograd.grad(loss, [leaf.tensor])
        finally:
            self._capture, self.running = None, False
            for module, mode in modes:
                module.training = mode
            unshard_again(model)
        return self._as_given(spec, Leaf(leaf.path, grad, leaf.dim), model)

    def plain_forward(self, model: nn.Module, args: tuple, kwargs: dict):
        """``model(*args, **kwargs)`` without gradients and without any mix: what a method that reads the
        unmixed batch's own forward needs (SnapMix's class activation maps). The model runs in eval mode, so
        no hook that acts in training (this mixer's, a ``OneOf``'s choice, its other mixers') acts and
        dropout is off, except its batch-norm layers, which normalise by the batch's statistics as in
        training but leave their running statistics (and count) untouched. Each module's mode and
        ``track_running_stats`` are restored after."""
        modes = [(m, m.training) for m in model.modules()]
        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        tracked = [m.track_running_stats for m in norms]
        self._capture, self.running = {"spec": None}, True
        try:
            model.eval()
            for m in norms:
                m.training, m.track_running_stats = True, False
            with torch.no_grad():
                return model(*args, **kwargs)
        finally:
            self._capture, self.running = None, False
            for m, mode in modes:
                m.training = mode
            for m, track in zip(norms, tracked, strict=True):
                m.track_running_stats = track
            unshard_again(model)

    def _captured(self, spec: str, value):
        """``value``'s site value with its first leaf replaced by a detached copy that requires grad (kept
        for :meth:`gradient_at`): the pass's backward stops there."""
        site_value, found = self._leaves(spec, value)
        leaf = found[0]
        fresh = leaf.tensor.detach().requires_grad_()
        self._capture["leaf"] = Leaf(leaf.path, fresh, leaf.dim)
        return replace_leaves(site_value, {leaf.path: fresh})

    def input(self, model: nn.Module, args: tuple, kwargs: dict):
        """The model's pre-hook during the pass: the input captured, where the pass is taken there."""
        spec = self._capture["spec"]
        if spec is None or self._sites[spec].layer != INPUT:
            return None
        inputs = Inputs(model, args, kwargs)
        return rebuild_inputs(inputs, self._sites[spec], self._captured(spec, inputs))

    def layer(self, spec: str, output):
        """A layer's hook during the pass: its output captured, where the pass is taken there (once)."""
        if self._capture["spec"] is None or spec != self._capture["spec"] or "leaf" in self._capture:
            return None
        return self._captured(spec, output)
