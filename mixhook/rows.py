"""A batch's rows gathered as partners: ``h[index]`` along the first dimension, laid out as ``h``. Below the
blends (:mod:`mixhook.functional`) and the fused blend (:mod:`mixhook.fused`), which both gather with it."""

from __future__ import annotations

import torch


def gather_rows(h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``h[index]`` along the first dimension, laid out as ``h``: ``index_select`` for a contiguous ``h``
    (the faster gather), indexing otherwise. ``index_select`` returns a contiguous tensor whatever its
    input's layout, so a channels-last map blended with it left the blend contiguous and every
    convolution after it copied its input and its gradient back to channels-last (4 copies of a
    ResNet-50 map per step, found by the CPU's op lists: ``benchmarks/run.py --device-time``)."""
    return h.index_select(0, index) if h.is_contiguous() else h[index]
