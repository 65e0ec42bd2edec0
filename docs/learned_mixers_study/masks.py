"""What AutoMix's and SAMix's Mix Blocks learn on digits: the masks for four fixed pairs of test images
after the first epoch and at the end of a run, drawn from the mixer itself (``AutoMix.masks``).

    python docs/learned_mixers_study/masks.py          # about 2 minutes on 2 CPU cores -> masks.png here
    python docs/learned_mixers_study/masks.py --block-lr 0.005   # the Mix Block's own lr (momentum 0)
                                                                 # -> masks_block_lr.png

Each mixer trains the study's model (``model=resnet32`` on 300 of scikit-learn's digits, 8x8 images) through
the app's own build and training loop, with its shipped config (``mixup=automix``, ``mixup=samix``) but for
``mixup.features=layer2`` (4x4 features on digits: the last stage's are 2x2, too coarse to show much of a
mask) and ``EPOCHS`` epochs. The picture's rows are the pairs (image ``a``, its partner ``b``), its columns
each mixer's partner share ``m`` at ``lam = 0.5`` after epoch 1 and after the last epoch (0: all ``a``, 1:
all ``b``), and the image the model trains on then, ``a (1 - m) + b m``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
EPOCHS = 20
PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7))  # positions in the test batch, by class (0 with 1, 2 with 3, ...)


def config(mixer: str, block_lr: float | None = None):
    from hydra import compose, initialize_config_module

    own = [] if block_lr is None else [f"mixup.block_lr={block_lr}", "mixup.block_momentum=0"]
    with initialize_config_module("mixhook.app.conf", version_base=None):
        return compose(
            "config",
            overrides=[
                *own,
                f"mixup={mixer}", "mixup.features=layer2", f"trainer.epochs={EPOCHS}", "model=resnet32",
                "data.train_size=300", "trainer.progress_bar=false", "seed=0",
            ],
        )  # fmt: skip


def test_pairs(data) -> torch.Tensor:
    """One test image of each class 0..7 (the first of each), in the model's input format."""
    x, y = next(iter(data.test))
    picked = [int((y == c).nonzero()[0]) for c in range(8)]
    return x[picked]


def train(mixer: str, block_lr: float | None = None) -> dict[str, torch.Tensor]:
    """The masks and mixed images of ``PAIRS`` after epoch 1 and after the last."""
    from mixhook.app.build import build
    from mixhook.app.training.loop import Training, train_one_epoch

    run = build(config(mixer, block_lr))
    mix, x = run.mixup, test_pairs(run.data)
    index = torch.arange(len(x))
    for a, b in PAIRS:
        index[a], index[b] = b, a
    training = Training(run.model, run.optimizer, run.device, mix, progress_bar=False)
    out = {}
    for epoch in range(1, EPOCHS + 1):
        train_one_epoch(training, run.data.train)
        if run.scheduler is not None:
            run.scheduler.step()
        if epoch in (1, EPOCHS):
            m = mix.masks(x.to(run.device), 0.5, index).cpu()
            out[f"mask{epoch}"], out[f"mixed{epoch}"] = m[:, 0], x * (1 - m) + x[index] * m
    out["x"] = x
    for handle in run.handles:
        handle.remove()
    return out


def figure(results: dict[str, dict], note: str = ""):
    from matplotlib.figure import Figure

    names = list(results)
    columns = ["a", "b"] + [
        f"{n}\n{w}" for n in names for w in ("mask, epoch 1", "mixed", f"mask, epoch {EPOCHS}", "mixed")
    ]
    fig = Figure(figsize=(1.25 * len(columns), 1.4 * len(PAIRS) + 0.6))
    axes = fig.subplots(len(PAIRS), len(columns))
    for row, (a, b) in enumerate(PAIRS):
        first = results[names[0]]["x"]
        panels = [(first[a, 0], "gray", None), (first[b, 0], "gray", None)]
        for n in names:
            r = results[n]
            for epoch in (1, EPOCHS):
                panels += [
                    (r[f"mask{epoch}"][a], "viridis", (0, 1)),
                    (r[f"mixed{epoch}"][a, 0], "gray", None),
                ]
        for col, (image, cmap, limits) in enumerate(panels):
            ax = axes[row, col]
            kwargs = {"vmin": limits[0], "vmax": limits[1]} if limits else {}
            ax.imshow(image.numpy(), cmap=cmap, interpolation="nearest", **kwargs)
            ax.set_xticks([])
            ax.set_yticks([])
            if row == 0:
                ax.set_title(columns[col], fontsize=8)
    fig.suptitle(
        f"The Mix Blocks' partner share m (lam 0.5; 0 = a, 1 = b) on digits, after epoch 1 and {EPOCHS}"
        + note,
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-lr", type=float, default=None, help="the Mix Block's own learning rate")
    block_lr = parser.parse_args(argv).block_lr
    results = {name: train(name, block_lr) for name in ("automix", "samix")}
    path = HERE / ("masks.png" if block_lr is None else "masks_block_lr.png")
    note = "" if block_lr is None else f" (block_lr {block_lr:g}, momentum 0)"
    figure({"AutoMix": results["automix"], "SAMix": results["samix"]}, note).savefig(path, dpi=90)
    for name, r in results.items():
        for epoch in (1, EPOCHS):
            m = r[f"mask{epoch}"]
            print(
                f"{name} epoch {epoch}: mask mean {float(m.mean()):.3f}, "
                f"std over positions {float(m.std((1, 2)).mean()):.3f}"
            )
    print(path.relative_to(ROOT))


if __name__ == "__main__":
    main()
