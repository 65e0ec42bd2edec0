"""Random Erasing and Cutout as hooks: in training, a rectangle of each chosen sample's image, or of its
feature map at any layer, replaced by random values or a constant; the labels are untouched.

Papers: Zhong, Zheng, Kang, Li, Yang. "Random Erasing Data Augmentation." AAAI 2020.
https://arxiv.org/abs/1708.04896 (the authors' code: zhunzhong07/Random-Erasing, ``transforms.py``;
torchvision's ``transforms.v2.RandomErasing`` and timm's ``RandomErasing`` follow it). DeVries, Taylor.
"Improved Regularization of Convolutional Neural Networks with Cutout." 2017.
https://arxiv.org/abs/1708.04552 (the authors' code: uoguelph-mlrg/Cutout, ``util/cutout.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from . import recompute
from .engine.card import HookCard
from .engine.contract import members, mixing_of
from .functional import DeviceNoise
from .hooks import LayerHook, Planned
from .layouts import NCHW, NHWC, SiteLayout, check_layout, site_layout
from .sites import INPUT, Inputs, batch_leaves, describe, replace_leaves
from .transfer import to_device

ASPECTS = ("uniform", "log")  # how the aspect ratio is drawn from `ratio`: the paper's, or torchvision's


class _Erasing(LayerHook):
    """What Random Erasing and Cutout share: in training, each sample's map at the hooked layers (the
    model's first argument at ``"input"``) gets the rectangles :meth:`boxes` draws set to ``value`` by
    :meth:`erase`, before any mixer at the same layer mixes it; the draws from the hook's own generator
    (replayed under activation checkpointing); the layouts of the maps, read when attached."""

    _hooks_model = True  # its own pre-hook on the model: the input's height and width, for the map checks
    layout = Planned()  # (the sites' layouts are read when attached)

    def __init__(self, layer, p: float, value, layout, generator, batch_dim):
        super().__init__(layer, batch_dim)
        self.p = _probability(type(self).__name__, p)
        self.value = _value(type(self).__name__, value)
        self.layout = check_layout(layout, self.specs)
        self._draw_from(generator)
        self.last: torch.Tensor | None = None

    _TRANSIENT = ("_layouts", "_grid")

    def _fresh(self) -> None:
        super()._fresh()
        self._layouts: dict[str, SiteLayout] = {}  # each site's maps' layout, read when attached
        self._grid: tuple[int, int, int] | None = None  # this forward's input: (its ndim, height, width)

    def boxes(self, n: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` samples' rectangles on a ``height x width`` map, int64 rows ``(top, left, height, width)``
        (zeros for a sample left as it is), on the generator's device."""
        raise NotImplementedError

    def erase(self, h: torch.Tensor, boxes: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``h`` (``(B, C, H, W)``) with each sample's rectangle of ``boxes`` (``(B, 4)``) set to the values,
        on ``h``'s device and in its dtype; the gradient of an erased element is zero."""
        device = h.device
        top, left, rows, cols = to_device(boxes, device).view(-1, 4, 1, 1, 1).unbind(1)  # (one copy)
        y = torch.arange(h.shape[2], device=device).view(-1, 1)
        x = torch.arange(h.shape[3], device=device)
        inside = (y >= top) & (y < top + rows) & (x >= left) & (x < left + cols)  # (B, 1, H, W)
        if self.value == "random":  # (where the map is: a generator already there draws itself, no host sync)
            values = DeviceNoise(generator).normal_(torch.empty(h.shape, device=device, dtype=h.dtype))
        else:
            fill = self.value if len(self.value) > 1 else self.value * h.shape[1]
            if len(fill) != h.shape[1]:
                raise ValueError(
                    f"{type(self).__name__}: value has {len(self.value)} numbers, one per channel, and the "
                    f"map has {h.shape[1]} channels"
                )
            values = torch.tensor(fill, dtype=h.dtype, device=device).view(1, -1, 1, 1)
        return torch.where(inside, values, h)

    def check_output(self, spec: str, output, batch: int, model_input=None) -> None:
        """Refuse, in one line, what this hook cannot erase at site ``spec``: its erasing run once on
        ``output`` (what the site gave for a sample batch: the model's first argument at ``"input"``) with
        draws of its own, the hook's generator left as it is. The app's check before training calls it."""
        if isinstance(model_input, torch.Tensor) and model_input.ndim >= 3:
            self._grid = (model_input.ndim, model_input.shape[-2], model_input.shape[-1])
        self._erased(spec, output, torch.Generator().manual_seed(0))

    # ---------------------------------------------------------------------------------- the hooks

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        self._layouts = {
            spec: site_layout(model, self.sites[spec], self._per_layer(self.layout, spec))
            for spec in self.layers
        }
        # (prepended: at the input and at any layer, the map is erased before a mixer there mixes it)
        begin = recompute.hook(self._on_model_input) if INPUT not in self.layers else None
        if begin is not None:
            handles.append(model.register_forward_pre_hook(begin, with_kwargs=True, prepend=True))
        for spec, module in modules.items():
            hook = recompute.hook(self._hook(spec), self._again(spec))
            if spec == INPUT:  # ("input" resolves to the model itself: its pre-hook)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
            else:
                handles.append(module.register_forward_hook(hook, prepend=True))

    def _reset(self) -> None:
        self._grid = None

    def _on_model_input(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        """Note the input's height and width (the maps' sides are checked against them)."""
        x = args[0] if args else next(iter(kwargs.values()), None)
        self._grid = (
            (x.ndim, x.shape[-2], x.shape[-1]) if isinstance(x, torch.Tensor) and x.ndim >= 3 else None
        )

    def _hook(self, spec: str):
        input_site = spec == INPUT

        def hook(module: nn.Module, *call):
            if not self._training:
                return None
            self._seed_for_rank()
            generator = self.generator
            self._note(spec, lambda: recompute.generator_state(generator))
            out, boxes = self._erase_call(spec, module, call, generator, input_site)
            self.last = boxes
            return out

        return hook

    def _again(self, spec: str):
        input_site = spec == INPUT

        def again(module: nn.Module, *call):
            """In a recomputation (activation checkpointing): the forward's rectangles and values again."""
            if not self._training:
                return None
            state = self._replayed(spec)
            if state is None:
                raise recompute.RecomputeError(
                    f"{type(self).__name__} at {spec!r}: the recomputed forward's erasing was not recorded"
                )
            generator = recompute.replay_generator(self.generator, state)
            return self._erase_call(spec, module, call, generator, input_site)[0]

        return again

    def _erase_call(self, spec: str, module: nn.Module, call: tuple, generator, input_site: bool):
        """The hook's return value for one call (the model's erased arguments at the input, the layer's
        erased output elsewhere) and the rectangles drawn."""
        if input_site:
            args, kwargs = call
            self._on_model_input(module, args, kwargs)
            inputs = Inputs(module, args, kwargs)
            if not len(inputs):
                raise TypeError(f"{type(self).__name__} at 'input': the model was called without an input")
            name, value = inputs.first()
            erased, boxes = self._erased(spec, value, generator)
            return inputs.rebuild({name: erased}), boxes
        _args, output = call
        return self._erased(spec, output, generator)

    def _refuse_renormalised(self, spec: str) -> None:
        """Refuse, in one line, erasing a batch-norm layer's output that a mixer on the model computes again
        (AutoMix, SAMix, AdAutoMix, a SUMix policy: their clean and mixed rows normalised apart, the layer's
        output replaced after its hooks' own, which would drop the erasing silently)."""
        if spec == INPUT or not isinstance(self._model.get_submodule(self.sites[spec].layer), _BatchNorm):
            return
        mixer = mixing_of(self._model)
        for m in members(mixer) if mixer is not None else ():
            apart = [type(p).__name__ for p in getattr(m, "policies", ()) if p.batch_norm_apart]
            if getattr(m, "batch_norm_apart", False) or apart:
                who = type(m).__name__ + (f" with {apart[0]}" if apart else "")
                raise ValueError(
                    f"{type(self).__name__} at {spec!r}: {who} normalises its clean and mixed rows apart at "
                    "each batch-norm layer, computing the layer's output again after its hooks, which would "
                    "drop the erasing; erase the layer after it (its activation, or the block's output)"
                )

    def _erased(self, spec: str, value, generator: torch.Generator):
        """``value`` (a site's output or the model's first argument) with its map erased."""
        kind = type(self).__name__
        self._refuse_renormalised(spec)
        leaves, n = batch_leaves(value, self.sites[spec], self._dims[spec], kind, inputs=spec == INPUT)
        if len(leaves) != 1 or leaves[0].tensor.ndim != 4 or leaves[0].dim != 0:
            found = describe(value)
            raise TypeError(
                f"{kind} at {spec!r} erases a rectangle of one (B, C, H, W) map, and the "
                f"{'input' if spec == INPUT else 'output'} is {found}: name a layer whose output is a map "
                "(a convolutional stage), or the input"
            )
        (leaf,) = leaves
        layout = self._layouts[spec]
        h = leaf.tensor
        name = layout.of(kind, spec)
        if name not in (NCHW, NHWC):
            raise TypeError(f"{kind} at {spec!r}: a {name} map is not a 2-D map to erase")
        layout.check_sides(kind, spec, tuple(h.shape), self._grid)
        view = h.permute(0, 3, 1, 2) if name == NHWC else h  # (B, C, H, W)
        boxes = self.boxes(n, view.shape[2], view.shape[3], generator)
        erased = self.erase(view, boxes, generator)
        if name == NHWC:
            erased = erased.permute(0, 2, 3, 1)
        return replace_leaves(value, {leaf.path: erased}), boxes


class RandomErasing(_Erasing):
    """Random Erasing (Zhong et al. 2020): in training, each sample of the batch, with probability ``p``,
    has one rectangle of its ``(B, C, H, W)`` map (the image at ``layer="input"``, or any layer's feature
    map) replaced, across all channels, by ``value``; the rest of the map, the other samples and the labels
    are untouched. Nothing changes in evaluation.

    The rectangle is the paper's (Algorithm 1 and the authors' ``transforms.py``): an area ``S_e`` drawn
    uniformly from ``scale`` times the map's ``H * W``, an aspect ratio ``r_e`` from ``ratio``, sides ``h =
    round(sqrt(S_e * r_e))`` and ``w = round(sqrt(S_e / r_e))``; where the rectangle fits (``h < H`` and
    ``w < W``), its top-left corner is drawn uniformly among the places where it lies whole, else the draw
    is repeated, up to ``attempts`` times (a sample whose every attempt fails is left as it is, as in the
    authors' code and torchvision's). ``aspect="uniform"`` draws ``r_e`` uniformly from ``ratio`` (the
    paper, the authors' code); ``"log"`` uniformly in its logarithm (torchvision's and timm's
    ``RandomErasing``, 10 attempts there).

    ``value``: ``"random"`` (each erased element ``N(0, 1)``, drawn on the map's device: torchvision's
    ``value="random"``, timm's ``mode="pixel"``; at the input, random pixels of a normalised image), a
    number (every channel), or one number per channel (the authors' Fashion-MNIST script fills with
    ``0.4914``; 0 at a normalised input is the mean pixel). Given the same rectangles and values, the
    erased map equals torchvision's ``F.erase`` of each sample (tested).

    Every draw (which samples, their rectangles, the random values' seed) comes from the hook's own
    generator, so runs are reproducible and ``state_dict()`` resumes them exactly; a recomputation under
    activation checkpointing erases the same rectangles with the same values. ``.last`` holds the last
    training forward's rectangles: ``(B, 4)`` int64 rows ``(top, left, height, width)``, ``(0, 0, 0, 0)``
    for a sample left as it was.

    With a mixer (``mixhook.attach(model, RandomErasing(...), ManifoldMixup(...))``): at one layer, the
    map is erased before it is mixed, whatever the order of attaching (the mixer mixes erased maps, as
    after a data pipeline's erasing); a mixer's own extra forwards (a saliency method's gradient pass, an
    unmixed forward) run the model in eval mode and so see the input erased once, not again.

    Args:
        layer: ``"input"`` (the model's first argument: images), or any layer whose output is a map, or a
            list of them (each erased); see :mod:`mixhook.layers`.
        p: each sample's probability of being erased (paper: 0.5).
        scale: ``(low, high)``, the erased area's range as a fraction of the map (paper: 0.02 to 0.4).
        ratio: ``(low, high)``, the aspect ratio's range (paper: ``r1 = 0.3``, so 0.3 to ``1 / 0.3``).
        value: ``"random"``, a number, or one number per channel.
        aspect: ``"uniform"`` (the paper) or ``"log"`` (torchvision, timm).
        attempts: draws of a rectangle before a sample is left as it is (authors' code: 100).
        layout: ``"NCHW"`` or ``"NHWC"`` (a dict per layer spec), where the model does not state its maps'
            layout (see :mod:`mixhook.layouts`): a ``(B, H, W, C)`` map is erased over its height and width.
        generator: as :class:`~mixhook.ManifoldMixup`.
        batch_dim: where mixhook cannot find the batch dimension itself (see :mod:`mixhook.sites`).

    Refused in one line: a layer whose output is not one 4-D map (ViT tokens, sequences: erase the image,
    or a convolutional stage), a map whose layout cannot be told, a ``value`` list of another length than
    the map's channels.
    """

    card = HookCard(
        signature='RandomErasing(layer="input", p=0.5, scale=(0.02, 0.4), ratio=(0.3, 3.33), value="random")',
        hook="forward hook (the model's pre-hook at the input), before any mixer at the same layer",
        formula=(
            "per sample with probability `p`: a rectangle of area `U(scale)·H·W` and aspect `U(ratio)` at "
            "a uniform place, all channels, set to `N(0, 1)` values (or `value`); labels unchanged"
        ),
        paper="Zhong et al. 2020",
        commands="`erasing=random`, `erasing=random erasing.layer=layer2`",
    )

    def __init__(
        self,
        layer: str | Sequence[str] = INPUT,
        p: float = 0.5,
        scale: Sequence[float] = (0.02, 0.4),
        ratio: Sequence[float] = (0.3, 1 / 0.3),
        value: str | float | Sequence[float] = "random",
        aspect: str = "uniform",
        attempts: int = 100,
        layout: str | dict | None = None,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, p, value, layout, generator, batch_dim)
        kind = type(self).__name__
        self.scale = _range(kind, "scale", scale, 0.0, 1.0)
        self.ratio = _range(kind, "ratio", ratio, 0.0, math.inf)
        if aspect not in ASPECTS:
            raise ValueError(f"{kind}: aspect must be one of {', '.join(ASPECTS)}, got {aspect!r}")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"{kind}: attempts must be an int >= 1, got {attempts!r}")
        self.aspect, self.attempts = aspect, attempts

    def __repr__(self) -> str:
        return (
            f"RandomErasing(layer={self._layer_spec!r}, p={self.p}, scale={self.scale}, "
            f"ratio={tuple(round(r, 4) for r in self.ratio)}, value={self.value!r}, aspect={self.aspect!r})"
        )

    # ------------------------------------------------------------------------------ the method

    def boxes(self, n: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` samples' rectangles on a ``height x width`` map, ``(n, 4)`` int64 rows ``(top, left,
        height, width)`` on the generator's device (zeros for a sample left as it is), drawn from
        ``generator``: a fixed number of draws whatever the outcome (each sample's chance, ``attempts``
        areas and aspect ratios, its place), so a seed gives the same rectangles on any map."""
        g, k = generator, self.attempts
        uniform = lambda *size: torch.rand(size, generator=g, device=g.device, dtype=torch.float64)  # noqa: E731
        chosen = uniform(n, 1) < self.p
        u_area, u_ratio, u_top, u_left = uniform(n, k), uniform(n, k), uniform(n, 1), uniform(n, 1)
        (s_low, s_high), (r_low, r_high) = self.scale, self.ratio
        area = (u_area * (s_high - s_low) + s_low) * (height * width)  # (the authors' arithmetic, in float64)
        if self.aspect == "uniform":
            ratio = u_ratio * (r_high - r_low) + r_low
        else:
            ratio = torch.exp(u_ratio * (math.log(r_high) - math.log(r_low)) + math.log(r_low))
        rows = torch.sqrt(area * ratio).round_().long()  # (round half to even, as Python's round)
        cols = torch.sqrt(area / ratio).round_().long()
        fits = (rows < height) & (cols < width)
        first = fits.byte().argmax(1, keepdim=True)  # the first attempt that fits (0 where none does)
        rows, cols = rows.gather(1, first), cols.gather(1, first)
        chosen &= fits.any(1, keepdim=True)
        top = (u_top * (height + 1 - rows)).long()  # (uniform over the places where it lies whole)
        left = (u_left * (width + 1 - cols)).long()
        return torch.cat([top, left, rows, cols], 1) * chosen


class Cutout(_Erasing):
    """Cutout (DeVries and Taylor 2017): in training, ``holes`` squares of side ``size`` cut out of each
    sample's map (set to ``value``, 0 by default: at a normalised input, the mean pixel), each centred on
    a pixel drawn uniformly over the whole map and clipped at its edges (so a square near an edge is
    smaller), as the authors' ``Cutout`` class; with probability ``p`` per sample (1 in the paper).

    Random Erasing's special case, but for that clipping: a fixed area and aspect ratio 1. ``size`` is in
    pixels of the map (the paper: 16 on CIFAR-10, 8 on CIFAR-100, 20 on SVHN), or a fraction of the
    map's shorter side (``0.5``), which keeps its meaning at any layer. ``.last`` holds each sample's
    first square, clipped. Everything else is :class:`RandomErasing`'s (the hooks, layouts, replay,
    state, the order beside a mixer).

    Args:
        layer: as :class:`RandomErasing`.
        size: the square's side: pixels (an int >= 1) or a fraction of the map's shorter side (in (0, 1)).
        holes: squares per sample (the authors' ``n_holes``: 1).
        p: each sample's probability of being cut (1: every sample, as the paper).
        value: as :class:`RandomErasing` (0 by default).
        layout, generator, batch_dim: as :class:`RandomErasing`.
    """

    card = HookCard(
        signature='Cutout(layer="input", size=16, holes=1, p=1.0, value=0.0)',
        hook="forward hook (the model's pre-hook at the input), before any mixer at the same layer",
        formula=(
            "per sample: `holes` squares of side `size` centred at uniform pixels, clipped at the edges, "
            "set to `value`; labels unchanged"
        ),
        paper="DeVries & Taylor 2017",
        commands="`erasing=cutout erasing.size=14`",
    )

    def __init__(
        self,
        layer: str | Sequence[str] = INPUT,
        size: int | float = 16,
        holes: int = 1,
        p: float = 1.0,
        value: str | float | Sequence[float] = 0.0,
        layout: str | dict | None = None,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, p, value, layout, generator, batch_dim)
        pixels = isinstance(size, int) and not isinstance(size, bool) and size >= 1
        fraction = isinstance(size, float) and 0 < size < 1
        if not (pixels or fraction):
            raise ValueError(
                f"Cutout: size must be the square's side in pixels (an int >= 1) or a fraction of the map's "
                f"shorter side (a float in (0, 1)), got {size!r}"
            )
        if isinstance(holes, bool) or not isinstance(holes, int) or holes < 1:
            raise ValueError(f"Cutout: holes must be an int >= 1, got {holes!r}")
        self.size, self.holes = size, holes

    def __repr__(self) -> str:
        return (
            f"Cutout(layer={self._layer_spec!r}, size={self.size}, holes={self.holes}, p={self.p}, "
            f"value={self.value!r})"
        )

    def side(self, height: int, width: int) -> int:
        """The square's side on a ``height x width`` map."""
        return self.size if isinstance(self.size, int) else max(1, round(self.size * min(height, width)))

    def boxes(self, n: int, height: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """``n`` samples' squares, ``(n, holes, 4)`` int64 rows ``(top, left, height, width)`` clipped at the
        map's edges (zeros for a sample left as it is): the authors' ``y1 = clip(y - size // 2, 0, h)``,
        ``y2 = clip(y + size // 2, 0, h)``, each centre uniform over the map."""
        g, side = generator, self.side(height, width)
        if side // 2 >= height and side // 2 >= width:
            raise _WholeMap(
                f"its {side}-pixel square covers the whole {height}x{width} map wherever it is centred, so "
                f"every sample would be erased whole; choose a size below {2 * max(height, width)} (or a "
                "fraction of the map's side: size=0.5)"
            )
        chosen = torch.rand(n, generator=g, device=g.device, dtype=torch.float64) < self.p
        centre_y = torch.randint(height, (n, self.holes), generator=g, device=g.device)
        centre_x = torch.randint(width, (n, self.holes), generator=g, device=g.device)
        top, bottom = (centre_y - side // 2).clamp(0, height), (centre_y + side // 2).clamp(0, height)
        left, right = (centre_x - side // 2).clamp(0, width), (centre_x + side // 2).clamp(0, width)
        return torch.stack([top, left, bottom - top, right - left], 2) * chosen[:, None, None]

    def erase(self, h: torch.Tensor, boxes: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """``h`` with every square of every sample cut (see :meth:`boxes`)."""
        for hole in range(boxes.shape[1]):
            h = super().erase(h, boxes[:, hole], generator)
        return h

    def _erased(self, spec: str, value, generator: torch.Generator):
        try:
            erased, boxes = super()._erased(spec, value, generator)
        except _WholeMap as err:
            raise ValueError(f"Cutout at {spec!r}: {err}") from None
        return erased, boxes[:, 0]


class _WholeMap(ValueError):
    """A Cutout square that would erase the whole map (said with its site by ``Cutout._erased``)."""


def _probability(kind: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ValueError(f"{kind}: p must be a probability in [0, 1], got {p!r}")
    return float(p)


def _range(kind: str, name: str, value, low: float, high: float) -> tuple[float, float]:
    """A ``(low, high)`` pair of numbers with ``low <= high``, both in ``(low, high]``; else one line."""
    try:
        pair = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or not all(math.isfinite(v) and low < v <= high for v in pair) or pair[0] > pair[1]:
        bound = f"<= {high:g}" if math.isfinite(high) else "finite"
        raise ValueError(
            f"{kind}: {name} must be (low, high) with {low:g} < low <= high, {bound}, got {value!r}"
        )
    return pair


def _value(kind: str, value):
    """``"random"``, or the fill as a tuple of floats (one, or one per channel)."""
    if value == "random":
        return value
    numbers = value if isinstance(value, (list, tuple)) else [value]
    if not numbers or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in numbers
    ):
        raise ValueError(
            f"{kind}: value must be 'random', a finite number or one finite number per channel, got {value!r}"
        )
    return tuple(float(v) for v in numbers)
