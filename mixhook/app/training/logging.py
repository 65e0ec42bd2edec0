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
from typing import NamedTuple

import torch

from mixhook.layers import resolve_layers
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
        for key in ("train_loss", "test_loss", "test_acc", "test_ece", "test_balanced_acc", "lr"):
            if row.get(key) not in (None, ""):  # test_ece: missing from rows of runs before it existed
                self.writer.add_scalar(f"epoch/{key}", float(row[key]), row["epoch"])
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


class FeatureMaps(NamedTuple):
    """What :func:`save_feature_maps` drew for one layer: its maps without mixing and with the mix pinned
    at ``at`` (``None``: no mix reaches this layer), each sample's ``lam`` and partner ``index``."""

    plain: torch.Tensor
    mixed: torch.Tensor
    at: str | None
    lam: torch.Tensor | None
    index: torch.Tensor | None


def _pin_at(mixer, layer: str, index: torch.Tensor) -> None:
    """Pin ``mixer`` (a :class:`~mixhook.OneOf` through the first mixer owning ``layer``) at ``layer`` with
    the batch reversed, at lam 0.5 where the method takes a pinned lam."""
    owners = [i for i, m in enumerate(getattr(mixer, "mixers", ())) if layer in m.layers]
    choice = {"choice": owners[0]} if owners else {}
    try:
        mixer.pin(**choice, layer=layer, lam=0.5, index=index)
    except (TypeError, ValueError):  # a lam the method derives itself (e.g. from its own mask)
        mixer.pin(**choice, layer=layer, index=index)


def _image(sample: torch.Tensor):
    """A model input as something ``imshow`` draws: channels last, scaled to [0, 1] (one channel: grey)."""
    t = sample.detach().float().cpu()
    t = t if t.ndim == 2 else (t[0] if t.shape[0] not in (3,) else t.permute(1, 2, 0))
    low, high = float(t.min()), float(t.max())
    return ((t - low) / (high - low if high > low else 1.0)).numpy()


@torch.no_grad()
def save_feature_maps(
    model, mixer, layers, x: torch.Tensor, path: Path, channels: int = 4, pause=(), targets=None
) -> dict[str, FeatureMaps]:
    """A PNG per probed layer, ``<path>_<layer>.png``, one row per sample of batch ``x``: the sample and
    its mixing partner as images, then the first ``channels`` channels of the layer's maps, each channel
    unmixed beside mixed on one colour scale with its colour bar; the row says the sample's label and lam.

    "Unmixed" is a forward in which the mixer does not mix; "mixed" a forward with the mix pinned (the
    batch reversed, lam 0.5 where the method takes a pinned lam) *at that layer* when it is one of the
    mixer's layers, otherwise at the mixer's last layer that runs before it (the picture says which), so
    every layer's two panels differ by exactly one mix. A layer that no mix reaches shows its maps twice,
    titled so. The forwards run in training mode and every random stream, buffer and probe in ``pause``
    is put back: training goes on unchanged. Layers whose output is not ``(B, C, H, W)`` are skipped.
    ``targets``: the batch's labels (shown, and passed to a mixer that mixes by them)."""
    from ..plots import pyplot

    plt = pyplot()

    from mixhook.probes import FeatureRecorder

    from .checkpoint import random_states, restore_random_states

    hooks = [mixer] if mixer is not None else []
    streams, buffers = random_states(hooks), {k: v.clone() for k, v in model.named_buffers()}
    own = list(getattr(mixer, "layers", ())) if mixer is not None else []  # (real names: it is attached)
    layers = list(resolve_layers(model, layers))  # a portable spec or pattern: the layers it names here
    reverse = torch.arange(x.shape[0] - 1, -1, -1)
    was_training = model.training

    def forward(record, pin_layer=None):
        """The maps of ``record``'s layers (mixed at ``pin_layer``; unmixed when ``None``), and the mix."""
        recorder = FeatureRecorder(record)
        with recorder.attach(model):
            for name, value in model.named_buffers():
                value.copy_(buffers[name])  # each picture forward from the same statistics
            if mixer is not None:
                mixer.skip_next() if pin_layer is None else _pin_at(mixer, pin_layer, reverse)
                if targets is not None:
                    mixer.use_targets(targets)  # a method that mixes by the labels' gradient needs them
            model(x)
        return recorder.features, (mixer.last if mixer is not None and pin_layer is not None else None)

    for probe in pause:
        probe.paused = True
    model.train()  # the mixers mix training forwards only
    try:
        plain, _ = forward(list(dict.fromkeys([*layers, *own])))
        order = list(plain)  # the order in which the layers handed on their outputs
        wanted = [n for n in layers if isinstance(plain.get(n), torch.Tensor) and plain[n].ndim == 4]
        groups: dict[str | None, list[str]] = {}
        for name in wanted:
            before = [m for m in own if m in order and order.index(m) <= order.index(name)]
            groups.setdefault(name if name in own else (before[-1] if before else None), []).append(name)
        mixed = {}
        for at, names in groups.items():
            if at is None:
                mixed.update({n: (plain[n], None) for n in names})
                continue
            features, state = forward(names, at)
            mixed.update({n: (features[n], state) for n in names})
    finally:
        model.train(was_training)
        for probe in pause:
            probe.paused = False
        restore_random_states(streams, hooks)
        for name, value in model.named_buffers():
            value.copy_(buffers[name])

    drawn = {}
    for name in wanted:
        maps, state = mixed[name]
        at = state.layer if state is not None else None
        lam = None if state is None else state.lam.expand(x.shape[0]) if state.lam.ndim == 0 else state.lam
        index = None if state is None else state.index
        drawn[name] = FeatureMaps(plain[name], maps, at, lam, index)
        _draw(
            plt, name, drawn[name], x, targets, channels, path.with_name(f"{path.name}_{name}.png"), bool(own)
        )
    return drawn


def _draw(plt, name: str, maps: FeatureMaps, x, targets, channels: int, file: Path, mixing: bool) -> None:
    from matplotlib import gridspec

    n, c = maps.plain.shape[0], min(channels, maps.plain.shape[1])
    widths = [1, 1] + [1, 1, 0.08, 0.25] * c
    fig = plt.figure(figsize=(1.6 * sum(widths), 1.6 * n + 0.9))
    grid = gridspec.GridSpec(n, len(widths), figure=fig, width_ratios=widths, wspace=0.05, hspace=0.3)
    for i in range(n):
        label = f"y={int(targets[i])} " if targets is not None else ""
        weight = f"\nlam={float(maps.lam[i]):.2f}" if maps.lam is not None else ""
        ax = fig.add_subplot(grid[i, 0])
        ax.imshow(_image(x[i]), cmap="gray")
        ax.set_ylabel(f"#{i} {label}{weight}", fontsize=8)
        ax.set_title("input" if i == 0 else "", fontsize=8)
        ax2 = fig.add_subplot(grid[i, 1])
        if maps.index is not None:
            j = int(maps.index[i])
            ax2.imshow(_image(x[j]), cmap="gray")
            ax2.set_title(
                f"partner #{j}" + (f" y={int(targets[j])}" if targets is not None else ""), fontsize=8
            )
        else:
            ax2.axis("off")
            ax2.text(0.5, 0.5, "not mixed", ha="center", va="center", fontsize=8)
        for a in (ax, ax2):
            a.set_xticks([])
            a.set_yticks([])
        for j in range(c):
            pair = [m[i, j].float().cpu() for m in (maps.plain, maps.mixed)]
            low, high = min(float(p.min()) for p in pair), max(float(p.max()) for p in pair)
            for k, image in enumerate(pair):  # one colour scale for a channel's two versions
                ax = fig.add_subplot(grid[i, 2 + 4 * j + k])
                shown = ax.imshow(image.numpy(), cmap="viridis", vmin=low, vmax=high)
                ax.set_xticks([])
                ax.set_yticks([])
                if i == 0:
                    ax.set_title(f"ch{j} {'mixed' if k else 'unmixed'}", fontsize=8)
            bar = fig.colorbar(shown, cax=fig.add_subplot(grid[i, 4 + 4 * j]))
            bar.ax.tick_params(labelsize=6)
    if maps.at is None:
        how = "no mixer" if not mixing else "no mix reaches this layer: the mixer's layers run after it"
    elif maps.at == name:
        how = f"mixed at {name} itself"
    else:
        how = f"mixed at {maps.at}, upstream of {name}"
    fig.suptitle(f"{name}, each channel unmixed | mixed: {how}; partner = the sample mixed in", fontsize=10)
    fig.savefig(file, dpi=90, bbox_inches="tight")
    plt.close(fig)
