"""The gradient of the loss at the layer a mixer would mix: one more forward and a partial backward, for the
methods that place their regions by gradient saliency."""

from __future__ import annotations

import torch
from torch import nn

from ..sites import INPUT, Inputs, Leaf, describe, rebuild_inputs, replace_leaves
from ..transfer import to_device


class GradientPass:
    """:meth:`gradient_at` of a :class:`~mixhook.engine.mixer.Mixer`, and the hooks' part in its pass."""

    def gradient_at(self, model: nn.Module, args: tuple, kwargs: dict, spec: str, target) -> torch.Tensor:
        """The gradient of the summed cross-entropy of ``model(*args, **kwargs)`` against ``target``
        with respect to what :meth:`mix` would be given at ``spec`` (the first leaf: a ``(B, C, H, W)``
        map, or the patch tokens' map): one more forward, in eval mode (no dropout, no batch-norm
        statistics updated; each module's own mode restored after), and a backward down to ``spec``
        only (``autograd.grad``, so no parameter's ``.grad`` changes). Other hooks active in training
        mode only do not act in it."""
        if target is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the batch's labels for its gradient pass: call "
                "use_targets(y) before each training forward (the app's loop does)"
            )
        modes = [(m, m.training) for m in model.modules()]
        self._capture = {"spec": spec}
        try:
            model.eval()
            with torch.enable_grad():
                out = model(*args, **kwargs)
                logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
                if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
                    raise TypeError(
                        f"{type(self).__name__}'s gradient pass needs (B, classes) logits from the model, "
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
            self._capture = None
            for module, mode in modes:
                module.training = mode
        grad_leaf = Leaf(leaf.path, grad, leaf.dim)
        if self.token_grid is not None:
            return self.token_grid.to_maps(spec, [grad_leaf], model)[0].tensor
        return grad.permute(0, 3, 1, 2) if self._channels_last(spec, grad_leaf) else grad

    def _capture_value(self, spec: str, site_value):
        """``site_value`` with its first leaf replaced by a detached copy that requires grad (noted in
        ``self._capture``): the gradient pass's backward stops there."""
        found = self._leaves(spec, site_value)[0]
        leaf = found[0]
        fresh = leaf.tensor.detach().requires_grad_()
        self._capture["leaf"] = Leaf(leaf.path, fresh, leaf.dim)
        return replace_leaves(site_value, {leaf.path: fresh})

    def _capture_input(self, model: nn.Module, args: tuple, kwargs: dict):
        spec = self._capture["spec"]
        if self.sites[spec].layer != INPUT:
            return None
        inputs = Inputs(model, args, kwargs)
        value = self._capture_value(spec, self._site_value(spec, inputs))
        return rebuild_inputs(inputs, self.sites[spec], value)

    def _capture_layer(self, spec: str, output):
        if spec != self._capture["spec"] or "leaf" in self._capture:
            return None
        return self._capture_value(spec, output)
