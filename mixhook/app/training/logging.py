"""Where a run's series go besides ``metrics.csv``: ``probes.csv`` (the probes' per-layer statistics) and,
with ``trainer.logger=tensorboard``, TensorBoard event files in the run directory (the epoch metrics
and the probes' series), plus the feature-map pictures of ``probes.feature_maps``.

Probe rows are written when a checkpoint is, so after a resume ``probes.csv`` is cut back to the
checkpoint's step and TensorBoard purges the later events (``purge_step``): the series stay as an
uninterrupted run would have them.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import torch

from mixhook.probes import ActivationStats, GradStats

LOGGERS = ("csv", "tensorboard")
PROBE_COLUMNS = ["step", "epoch", "layer", *ActivationStats.STATS, "grad_norm", "param_grad_norm"]


class RunLogger:
    """Writes probe statistics and (optionally) TensorBoard scalars for one run; rank 0 only. ``probes``
    may be every hook of the run: the :class:`ActivationStats` and :class:`GradStats` among them are
    the ones logged."""

    def __init__(
        self, out_dir: str | os.PathLike, kind: str = "csv", probes=(), resume_step: int | None = None
    ):
        if kind not in LOGGERS:
            raise ValueError(f"trainer.logger={kind!r} is not a logger; valid: {', '.join(LOGGERS)}")
        self.out_dir = Path(out_dir)
        self.probes = [p for p in probes if isinstance(p, (ActivationStats, GradStats))]
        self.writer = None
        if kind == "tensorboard":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ValueError(
                    "trainer.logger=tensorboard needs the tensorboard package: "
                    "pip install -e '.[tensorboard]'"
                ) from err
            self.writer = SummaryWriter(str(self.out_dir), purge_step=resume_step)
        self._file = None
        if self.probes:
            path = self.out_dir / "probes.csv"
            kept = []
            if resume_step is not None and path.exists():  # rows after the checkpoint are redone
                kept = [r for r in csv.DictReader(open(path)) if int(r["step"]) <= resume_step]
            self._file = open(path, "w", newline="")
            self._csv = csv.DictWriter(self._file, fieldnames=PROBE_COLUMNS)
            self._csv.writeheader()
            self._csv.writerows(kept)
            self._file.flush()

    def epoch(self, row: dict) -> None:
        """One epoch's metrics (a ``metrics.csv`` row) as TensorBoard scalars at step = epoch."""
        if self.writer is None:
            return
        for key in ("train_loss", "test_loss", "test_acc", "lr"):
            self.writer.add_scalar(f"epoch/{key}", row[key], row["epoch"])
        self.writer.flush()

    def probe_rows(self, epoch: int) -> None:
        """Write what the probes recorded since the last call."""
        if self._file is None:
            return
        merged: dict[tuple[int, str], dict] = {}
        for probe in self.probes:
            for r in probe.rows():
                merged.setdefault((r["step"], r["layer"]), {"step": r["step"], "epoch": epoch}).update(r)
        for key in sorted(merged):
            row = merged[key]
            self._csv.writerow({c: row.get(c, "") for c in PROBE_COLUMNS})
            if self.writer is not None:
                for stat in PROBE_COLUMNS[3:]:
                    if isinstance(row.get(stat), float):
                        self.writer.add_scalar(f"probes/{row['layer']}/{stat}", row[stat], row["step"])
        self._file.flush()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self.writer is not None:
            self.writer.close()


@torch.no_grad()
def save_feature_maps(
    model, mixer, layers, x: torch.Tensor, path: Path, channels: int = 6, pause=(), targets=None
) -> list[str]:
    """A PNG grid per layer of the first ``channels`` channels of its feature maps for batch ``x``: each
    sample's unmixed maps beside its mixed ones (the mixer pinned to lam 0.5 with the batch reversed,
    at that layer when it is one of the mixer's). The forward runs in training mode, so the mix
    happens, and every random stream and buffer is put back afterwards, and the probes in ``pause``
    do not count it: training goes on unchanged. Layers whose output is not ``(B, C, H, W)`` are
    skipped. ``targets``: the batch's labels, for a mixer that mixes by them (gradient saliency).
    Returns ``{layer: (unmixed, mixed)}`` for the layers drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mixhook.probes import FeatureRecorder

    from .checkpoint import random_states, restore_random_states

    hooks = [mixer] if mixer is not None else []
    streams, buffers = random_states(hooks), {k: v.clone() for k, v in model.named_buffers()}
    before, after = FeatureRecorder(layers, where="before"), FeatureRecorder(layers, where="after")
    drawn, was_training = {}, model.training
    for probe in pause:
        probe.paused = True
    model.train()  # the mixers mix training forwards only
    try:
        with before.attach(model), after.attach(model):
            if mixer is not None and callable(getattr(mixer, "pin", None)):
                at = next((name for name in layers if name in getattr(mixer, "layers", ())), None)
                index = torch.arange(x.shape[0] - 1, -1, -1)
                try:
                    mixer.pin(**({"layer": at} if at else {}), lam=0.5, index=index)
                except (TypeError, ValueError):  # e.g. OneOf without a layer of one mixer: as drawn
                    pass
            if mixer is not None and targets is not None:
                mixer.use_targets(targets)  # a method that mixes by the labels' gradient needs them
            model(x)
    finally:
        model.train(was_training)
        for probe in pause:
            probe.paused = False
        restore_random_states(streams, hooks)
        for name, value in model.named_buffers():
            value.copy_(buffers[name])
    for name in layers:
        plain, mixed = before.features.get(name), after.features.get(name)
        if not isinstance(plain, torch.Tensor) or plain.ndim != 4:
            continue
        n, c = plain.shape[0], min(channels, plain.shape[1])
        fig, axes = plt.subplots(n, 2 * c, figsize=(1.2 * 2 * c, 1.2 * n + 0.6), squeeze=False)
        for i in range(n):
            for j in range(c):
                pair = [maps[i, j].float().cpu() for maps in (plain, mixed)]
                low, high = min(float(p.min()) for p in pair), max(float(p.max()) for p in pair)
                for k, image in enumerate(pair):  # one colour scale for a channel's two versions
                    ax = axes[i][j + k * c]
                    ax.imshow(image.numpy(), cmap="viridis", vmin=low, vmax=high)
                    ax.set_xticks([])
                    ax.set_yticks([])
                    if i == 0:
                        ax.set_title(f"{'mixed' if k else 'unmixed'} ch{j}", fontsize=7)
        fig.suptitle(f"{name}: unmixed (left) and mixed (right), one row per sample", fontsize=9)
        fig.savefig(path.with_name(f"{path.name}_{name}.png"), dpi=80)
        plt.close(fig)
        drawn[name] = (plain, mixed)
    return drawn
