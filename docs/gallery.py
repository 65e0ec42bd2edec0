"""The catalogue's gallery: what every mixing method does to a pair of images and to a hidden feature map,
drawn by the library itself (so a picture cannot drift from the code).

    python docs/gallery.py            # (re)write docs/gallery/<Method>.png, one per method
    python docs/gallery.py --check    # exit 1, one line per picture, unless docs/gallery/ holds exactly
                                      # the pictures this would draw, as it would draw them

For each method (every class ``mixhook.mixers.METHODS`` finds, so a new mixer fails the check until its
picture is drawn): the two images (scikit-learn's bundled ``china.jpg`` and ``flower.jpg``, 64x64, sample 0
and its partner), what the method makes of image 0 when it mixes at the input, and the weight of image 0's
own content at each position of a 16x16 feature map (AlignMix's: 8x8) when it mixes at a hidden layer
(``MixState.weights``; a method that blends every position alike has ``lam`` everywhere). The titles give
lam, the weight of sample 0's own label. Every draw comes from a seeded generator, with partners pinned to
``[1, 0]``. A method that mixes no pair (its card's ``drawn`` says ``views``: AugMix) is shown by the views
it makes of each image at the input instead; one that mixes several samples per row (``parts``: Co-Mixup)
by four inputs (the two images and their mirror images, their saliency pinned to their edge strength) and
the four rows it makes of them at the input.
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mixhook.geometry import region_weights
from mixhook.mixers import METHODS

GALLERY = Path(__file__).resolve().parent / "gallery"
SIZE = 64  # pixels a side
SEED = 2  # the draw of every picture but those whose card says another
NOT_DRAWN = {n: c.card.picture for n, c in METHODS.items() if c.card.picture is not True}  # (cards say why)
TOLERANCE = 0.02  # --check: the largest mean absolute pixel difference (0..1) taken as the same picture


def images(size: int = SIZE) -> torch.Tensor:
    """The two bundled sample images of scikit-learn, centre-cropped and resized: ``(2, 3, size, size)``."""
    from sklearn.datasets import load_sample_image

    out = []
    for name in ("china.jpg", "flower.jpg"):
        image = torch.from_numpy(load_sample_image(name).copy()).permute(2, 0, 1).float() / 255
        side = min(image.shape[1:])
        top, left = (image.shape[1] - side) // 2, (image.shape[2] - side) // 2
        crop = image[:, top : top + side, left : left + side]
        out.append(F.interpolate(crop[None], size=(size, size), mode="area")[0])
    return torch.stack(out)


def convnet() -> nn.Module:
    """The image as a layer (``"image"``), then a feature map a quarter its side (``"features"``)."""
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            image=nn.Identity(),
            features=nn.Conv2d(3, 8, 4, stride=4),
            head=nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)),
        )
    )


def vit() -> nn.Module:
    """A two-block torchvision ViT on the images (8x8 patch tokens and a class token): TransMix and MixPro
    need the class token's attention."""
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(
        image_size=SIZE,
        patch_size=SIZE // 8,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=2,
    )


PICTURE_KEYS = (
    "input",
    "hidden",
    "seed",
    "size",
    "note",
    "views",
    "parts",
)  # (a card's drawn: not arguments)


def method(name: str, layer: str, hidden: bool):
    """The method ``name`` at ``layer`` with its defaults and what its card says the picture takes (its
    ``drawn``: arguments on these models, a seed)."""
    drawn = METHODS[name].card.drawn
    kwargs = {k: v for k, v in drawn.items() if k not in PICTURE_KEYS}
    kwargs.update(drawn.get("hidden" if hidden else "input", {}))
    kwargs["generator"] = torch.Generator().manual_seed(drawn.get("seed", SEED))
    return METHODS[name](layer, **kwargs)


def draw(name: str) -> dict:
    """What ``name`` makes of the images: the mixed image 0 and its lam at the input, the own-content
    weights of sample 0 on the hidden map and their lam."""
    card = METHODS[name].card
    x = images(card.drawn.get("size", SIZE))
    y = torch.tensor([0.0, 1.0]) if card.family == "regression" else torch.tensor([0, 1])
    if card.shown_on == "vit":
        model, image, hidden = vit(), "input", "encoder.layers.encoder_layer_0"
        first = model.conv_proj
    else:
        model, image, hidden = convnet(), "image", "features"
        first = model.features
    seen = {}
    first.register_forward_pre_hook(lambda module, args: seen.__setitem__("input", args[0].detach()))
    out = {}
    for layer in (image, hidden):
        mixer = method(name, layer, hidden=layer == hidden)
        with mixer.attach(model), torch.no_grad():
            model.train()
            mixer.pin(index=torch.tensor([1, 0]))
            mixer.use_targets(y)
            model(x)
            last = mixer.last
            lam = float(last.lam.reshape(-1)[0])
            side = last.shapes[0][-2:]  # the mixed map's height and width
            if layer == image:
                rows = seen["input"][len(x) :] if last.clean else seen["input"]  # clean+mixed: [x; mix]
                out["mixed"], out["input_lam"] = rows[0].clamp(0, 1), lam
            elif last.weights is not None:
                out["weights"], out["hidden_lam"] = last.weights[0].float(), lam
            elif "mask" in last.info:  # PuzzleMix's own-content weights per block, before its transport
                mask = last.info["mask"][:1, None].float()
                out["weights"], out["hidden_lam"] = F.interpolate(mask, size=tuple(side))[0, 0], lam
            elif "box" in last.info:  # ResizeMix: the partner resized into its box, no weights per position
                out["weights"], out["hidden_lam"] = region_weights(last.info["box"], side)[0].float(), lam
            else:
                out["weights"], out["hidden_lam"], out["uniform"] = torch.full(side, lam), lam, True
    out["images"] = x
    if "size" in card.drawn:
        out["note"] = f" ({card.drawn['size']}x{card.drawn['size']} images)"
    if "note" in card.drawn:
        out["note"] = card.drawn["note"]
    return out


def draw_views(name: str) -> dict:
    """What a method that mixes no pair makes of the images at the input: the rows its layer emits (the
    clean images, then each of its views of them)."""
    x = images(SIZE)
    rows, _ = rows_at_input(name, x)
    return {"images": x, "rows": rows}


def rows_at_input(name: str, x: torch.Tensor, **pins) -> tuple[torch.Tensor, object]:
    """The rows ``name`` at the input emits for the images ``x`` (one training forward of the convnet,
    ``pins`` pinned), clamped to [0, 1], and its ``.last``."""
    model = convnet()
    seen = {}
    model.image.register_forward_pre_hook(lambda module, args: seen.__setitem__("rows", args[0].detach()))
    mixer = method(name, "input", hidden=False)
    with mixer.attach(model), torch.no_grad():
        model.train()
        if pins:
            mixer.pin(**pins)
        model(x)
    return seen["rows"].clamp(0, 1), mixer.last


def figure_views(name: str, drawn: dict):
    """The picture of a method that mixes no pair: image 0, its first two views, image 1's first view."""
    from matplotlib.figure import Figure

    rows, n = drawn["rows"], len(drawn["images"])
    fig = Figure(figsize=(10.4, 2.9))
    axes = fig.subplots(1, 4)
    panels = [
        (rows[0], "image 0 (clean)"),
        (rows[n], "image 0, view 1"),
        (rows[2 * n], "image 0, view 2"),
        (rows[n + 1], "image 1, view 1"),
    ]
    for ax, (image, title) in zip(axes, panels, strict=True):
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(name, fontsize=12, fontweight="bold", x=0.02, ha="left")
    fig.tight_layout()
    return fig


def draw_parts(name: str) -> dict:
    """What a method that mixes several samples per row makes at the input of four: the two images and
    their mirror images, their saliency pinned to their :func:`edges`; its rows and, for each, the inputs
    it mixes and their weights (:attr:`~mixhook.MixState.mixture`)."""
    x = images(SIZE)
    x = torch.cat([x, x.flip(-1)])
    rows, last = rows_at_input(
        name, x, saliency=edges(x)
    )  # (an untrained network's gradient saliency is flat)
    indices, weights = last.mixture
    return {"images": x, "rows": rows, "indices": indices, "weights": weights}


def edges(x: torch.Tensor) -> torch.Tensor:
    """The images' edge strength (Sobel's gradient magnitude of their grey levels): ``(B, H, W)``."""
    grey = x.mean(1, keepdim=True)
    sobel = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]])
    gx = F.conv2d(grey, sobel.view(1, 1, 3, 3), padding=1)
    gy = F.conv2d(grey, sobel.T.reshape(1, 1, 3, 3), padding=1)
    return (gx.square() + gy.square()).sqrt()[:, 0]


def figure_parts(name: str, drawn: dict):
    """The picture of a method that mixes several samples per row: the four inputs above, its four rows
    below, each titled by the inputs it mixes and their weights."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.4, 5.4))
    axes = fig.subplots(2, 4)
    for i in range(4):
        mirrored = " (mirrored)" if i > 1 else ""
        terms = [
            f"{float(w):.2f}·in {int(k)}"
            for k, w in zip(drawn["indices"][:, i], drawn["weights"][:, i], strict=True)
            if w > 0
        ]
        for ax, image, title in (
            (axes[0, i], drawn["images"][i], f"input {i}{mirrored}"),
            (axes[1, i], drawn["rows"][i], f"row {i}: " + " + ".join(terms)),
        ):
            ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
            ax.set_title(title, fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(name, fontsize=12, fontweight="bold", x=0.02, ha="left")
    fig.text(0.98, 0.97, "saliency: the images' edge strength, pinned", fontsize=9, ha="right", va="top")
    fig.tight_layout()
    return fig


def figure(name: str, drawn: dict):
    """The method's picture: a matplotlib ``Figure`` of its own (no pyplot state to close)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.4, 2.9))
    axes = fig.subplots(1, 4, gridspec_kw={"width_ratios": [1, 1, 1, 1.25]})
    panels = [
        (drawn["images"][0], "image 0 (own)"),
        (drawn["images"][1], "image 1 (its partner)"),
        (drawn["mixed"], f"image 0 mixed at the input\nlam {drawn['input_lam']:.2f}{drawn.get('note', '')}"),
    ]
    for ax, (image, title) in zip(axes, panels, strict=False):
        ax.imshow(image.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_title(title, fontsize=9)
    weights = drawn["weights"].numpy()
    shown = axes[3].imshow(weights, vmin=0, vmax=1, cmap="viridis", interpolation="nearest")
    extra = ", the same everywhere" if drawn.get("uniform") else ""
    side = "x".join(map(str, weights.shape))
    axes[3].set_title(
        f"own-content weight, {side} hidden map\nlam {drawn['hidden_lam']:.2f}{extra}", fontsize=9
    )
    fig.colorbar(shown, ax=axes[3], fraction=0.046, pad=0.04)
    for ax in axes:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(name, fontsize=12, fontweight="bold", x=0.02, ha="left")
    fig.tight_layout()
    return fig


def render(out: Path) -> list[Path]:
    """Draw every method's picture into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in sorted(METHODS):
        if name in NOT_DRAWN:
            continue
        path = out / f"{name}.png"
        drawn = METHODS[name].card.drawn
        if drawn.get("views"):
            fig = figure_views(name, draw_views(name))
        elif drawn.get("parts"):
            fig = figure_parts(name, draw_parts(name))
        else:
            fig = figure(name, draw(name))
        fig.savefig(path, dpi=80, metadata={"Software": None})
        paths.append(path)
    return paths


def check(gallery: Path = GALLERY, drawn_into: Path | None = None) -> list[str]:
    """One line per picture of ``gallery`` that is not what ``render`` draws now (missing, extra, changed);
    ``drawn_into``: a directory ``render`` has already drawn into (else it draws into a temporary one)."""
    import tempfile

    from matplotlib.image import imread

    with tempfile.TemporaryDirectory() as scratch:
        paths = sorted(drawn_into.glob("*.png")) if drawn_into else render(Path(scratch))
        drawn = {p.name: imread(p) for p in paths}
    committed = {p.name: p for p in sorted(gallery.glob("*"))} if gallery.exists() else {}
    problems = [
        f"{gallery.name}/{n}: not drawn: run python docs/gallery.py" for n in drawn if n not in committed
    ]
    problems += [
        f"{gallery.name}/{n}: not a picture docs/gallery.py draws" for n in committed if n not in drawn
    ]
    for n in sorted(set(drawn) & set(committed)):
        mine = imread(committed[n])
        if mine.shape != drawn[n].shape or float(np.abs(mine - drawn[n]).mean()) > TOLERANCE:
            problems.append(
                f"{gallery.name}/{n}: differs from what the library draws now: run python docs/gallery.py"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare docs/gallery/ with what would be drawn")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for line in problems:
            print(f"error: docs/{line}", file=sys.stderr)
        return 1 if problems else 0
    for path in render(GALLERY):
        print(path.relative_to(GALLERY.parents[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
