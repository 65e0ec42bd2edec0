"""The model's forward as the training steps and the evaluation run it: under ``torch.autocast`` in the
run's precision (:data:`PRECISIONS`), logits in float32 or wider; and the squared error of a one-output
model, the regression task's loss in both."""

from __future__ import annotations

import torch
from torch import nn

PRECISIONS = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # autocast dtype per setting


def forward(
    model: nn.Module, x: torch.Tensor, dtype, channels_last: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch as the model gets it (NHWC when ``channels_last``) and its logits in float32 or wider
    (a float64 model keeps float64), the forward under autocast in ``dtype`` (``None``: none)."""
    if channels_last and x.ndim == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        logits = model(x)
    return x, logits.to(torch.promote_types(logits.dtype, torch.float32))


def per_sample_se(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The squared error of each sample's one output."""
    return (output.squeeze(-1) - target.to(output.dtype)).square()
