"""The picture of what Random Erasing and Cutout do on Fashion-MNIST, drawn by the library itself:

    python docs/fashion_mnist_study/erasing.py      # -> docs/fashion_mnist_study/erasing.png

Eight training images as the study's model sees them (normalised), then the same batch through the
study's model in training mode with, in turn, ``RandomErasing("input")`` at the paper's values (random
values), ``Cutout("input", size=14)``, and ``RandomErasing("layer1")``: for the last, one channel of layer1's
14x14 map before and after (what erasing a feature map erases). Each hook's first forward, from a generator
seeded 0 (the input's) or 1 (layer1's); each rectangle erased is outlined.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mixhook import Cutout, RandomErasing
from mixhook.app.data import build_data
from mixhook.app.models import PreActResNet18

HERE = Path(__file__).resolve().parent


def seen_by(model, module, hook, x: torch.Tensor, output: bool = True) -> torch.Tensor:
    """What ``module`` gives (``output``) or takes during one training forward of ``x`` with ``hook``."""
    seen = []
    if output:
        handle = module.register_forward_hook(lambda m, a, o: seen.append(o.detach()))
    else:
        handle = module.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with hook.attach(model) if hook is not None else _nothing():
        model.train()
        model(x)
    handle.remove()
    return seen[0]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    from matplotlib.patches import Rectangle

    from mixhook.app.plots import pyplot

    plt = pyplot()
    data = build_data("fashion_mnist", batch_size=8, per_class=1000, augment=False, seed=0)
    x, y = next(iter(data.train))
    torch.manual_seed(0)
    model = PreActResNet18(1, 10, width=0.25, stride=2)
    erasing, cutout = RandomErasing("input", generator=g(0)), Cutout("input", size=14, generator=g(0))
    hidden = RandomErasing("layer1", generator=g(1))
    plain_map = seen_by(model, model.layer1, None, x)[:, :1]
    rows = [  # (title, images, the hook whose rectangles to outline, the images' value range)
        ("the images", x, None, "image"),
        ("RandomErasing(input)", seen_by(model, model.conv1, erasing, x, output=False), erasing, "image"),
        ("Cutout(input, size=14)", seen_by(model, model.conv1, cutout, x, output=False), cutout, "image"),
        ("layer1's map, channel 0", plain_map, None, "map"),
        (
            "RandomErasing(layer1)",
            seen_by(model, model.layer2, hidden, x, output=False)[:, :1],
            hidden,
            "map",
        ),
    ]
    mean, std = (v[0] for v in data.normalization)
    ranges = {
        "image": (-mean / std, (1 - mean) / std),
        "map": (float(plain_map.min()), float(plain_map.max())),
    }
    fig, axes = plt.subplots(len(rows), 8, figsize=(8, 1.15 * len(rows) + 0.4), dpi=110)
    for r, (title, images, hook, scale) in enumerate(rows):
        low, high = ranges[scale]
        for c in range(8):
            ax = axes[r, c]
            ax.imshow(images[c, 0].numpy(), cmap="gray", vmin=low, vmax=high)  # (channel 0)
            if hook is not None and int(hook.last[c, 2]):  # its rectangle, outlined
                top, left, height, width = hook.last[c].tolist()
                ax.add_patch(
                    Rectangle((left - 0.5, top - 0.5), width, height, fill=False, color="#C44E52", lw=1)
                )
            ax.set_xticks([])
            ax.set_yticks([])
        axes[r, 0].set_ylabel(title, rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle(
        "Fashion-MNIST: what the erasing hooks change (outlined: the rectangle erased)\nthe layer1 rows: "
        "channel 0 of its 14x14 map, one grey scale", fontsize=9,
    )  # fmt: skip
    fig.tight_layout()
    fig.savefig(HERE / "erasing.png")
    print(f"wrote {HERE / 'erasing.png'}")


def g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


if __name__ == "__main__":
    main()
