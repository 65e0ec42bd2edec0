"""Calibration of a classifier's top-1 confidence: expected calibration error and reliability diagrams.

Mixup's effect on calibration is one of its headline claims (Thulasidasan et al. 2019, "On Mixup
Training: Improved Calibration and Predictive Uncertainty for Deep Neural Networks"); the app reports it
for every run. The definition is Guo et al. 2017 ("On Calibration of Modern Neural Networks"), as in
their code (gpleiss/temperature_scaling, ``_ECELoss``): the top-1 softmax confidences fall into
``bins`` equal-width bins ``(k/bins, (k+1)/bins]``, and

    ECE = sum_k (n_k / N) * |mean confidence_k - accuracy_k|.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

BINS = 15


class Calibration:
    """Per-bin counts, summed confidences and correct predictions, accumulated batch by batch on the
    logits' device (no host synchronisation until a figure is read); summed over data-parallel ranks by
    :meth:`reduce`."""

    def __init__(self, bins: int = BINS):
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
            raise ValueError(f"bins must be an integer >= 1, got {bins!r}")
        self.bins = bins
        self.count = self.confidence = self.correct = None

    @torch.no_grad()
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch: ``logits`` ``(B, classes)``, ``target`` ``(B,)`` class indices."""
        if self.count is None:
            self.count, self.confidence, self.correct = (
                torch.zeros(self.bins, dtype=torch.float64, device=logits.device) for _ in range(3)
            )
        confidence, prediction = logits.detach().to(torch.float64).softmax(1).max(1)
        edges = torch.linspace(0, 1, self.bins + 1, dtype=torch.float64, device=logits.device)
        which = torch.bucketize(confidence, edges[1:-1])  # bin k holds (edges[k], edges[k + 1]]
        self.count.index_add_(0, which, torch.ones_like(confidence))
        self.confidence.index_add_(0, which, confidence)
        self.correct.index_add_(0, which, (prediction == target).to(torch.float64))

    def reduce(self, dist) -> None:
        """Sum every rank's bins (every rank must call it at the same point)."""
        if self.count is None:
            raise ValueError("Calibration.reduce(): no batch was added")
        summed = dist.sum(torch.cat([self.count, self.confidence, self.correct]).tolist())
        self.count, self.confidence, self.correct = torch.tensor(summed, dtype=torch.float64).split(self.bins)

    def ece(self) -> float:
        """Expected calibration error, a fraction in [0, 1]."""
        total = float(self.count.sum())
        return float((self.confidence - self.correct).abs().sum()) / total if total else math.nan

    def table(self) -> dict:
        """The reliability diagram's numbers: each bin's edges, count, mean confidence and accuracy
        (``None`` for an empty bin), and the ECE."""
        count = self.count.cpu()
        mean = [
            (float(c / n), float(a / n)) if n else (None, None)
            for n, c, a in zip(count, self.confidence.cpu(), self.correct.cpu(), strict=True)
        ]
        return {
            "bins": self.bins,
            "ece": self.ece(),
            "count": [int(n) for n in count],
            "confidence": [m[0] for m in mean],
            "accuracy": [m[1] for m in mean],
        }

    def plot(self, path: str | Path, title: str = "") -> None:
        """A reliability diagram PNG: each bin's accuracy against its confidence range beside the
        diagonal of perfect calibration, the gap shaded, and the share of samples per bin below."""
        from ..files import atomic_write
        from ..plots import pyplot

        plt = pyplot()

        t = self.table()
        width = 1.0 / self.bins
        lows = [k * width for k in range(self.bins)]
        fig, (top, bottom) = plt.subplots(
            2, 1, figsize=(5.2, 6.4), dpi=110, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
        )
        accuracy = [a if a is not None else 0.0 for a in t["accuracy"]]
        confidence = [c if c is not None else 0.0 for c in t["confidence"]]
        top.bar(
            lows, accuracy, width=width, align="edge", color="#4C72B0", edgecolor="black", label="accuracy"
        )
        gaps = [c - a for c, a in zip(confidence, accuracy, strict=True)]
        top.bar(
            lows, gaps, bottom=accuracy, width=width, align="edge", facecolor="none", edgecolor="#C44E52",
            hatch="//", linewidth=0, label="gap to the bin's mean confidence",
        )  # fmt: skip
        filled = [k for k in range(self.bins) if t["count"][k]]
        top.hlines(
            [confidence[k] for k in filled], [lows[k] for k in filled], [lows[k] + width for k in filled],
            color="#C44E52", linewidth=2, label="mean confidence",
        )  # fmt: skip
        top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
        top.set_xlim(0, 1)
        top.set_ylim(0, 1)
        top.set_ylabel("accuracy")
        # above the axes, never over a bar: any region of the diagram can hold one
        top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
        n = sum(t["count"])
        heading = f"{title}\nECE ({self.bins} bins) = {100 * t['ece']:.2f}%, n = {n}".strip()
        top.set_title(heading, fontsize=9, pad=36)
        bottom.bar(lows, [c / max(n, 1) for c in t["count"]], width=width, align="edge", color="#888888")
        bottom.set_xlabel("confidence (top-1 softmax probability)")
        bottom.set_ylabel("share of samples")
        fig.tight_layout()
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format="png")
        plt.close(fig)
