"""Case: host: what an active mix costs the host, against a minimal hand-written hook with its own generators.

Four copies of a small model (Linear, Identity, Linear), with no hook, with the hand-written Manifold
Mixup hook below on the Identity (lam and the partners from its own torch generator, the blend and the
loss as the papers write them), with ``ManifoldMixup`` there, and with :class:`Floor`: mixhook's structure
(a model pre-hook that starts the forward, the layer hook that draws from a torch generator and blends, a
model hook that marks the output, a loss that finds its forward from the logits) and none of its checks
or records, what that structure costs by itself. The tensors are tiny, so the time is the host's: what a
launch-bound GPU step pays. Timed side by side: the forward alone (the hooks' calls: a "bare" active hook
call, at the model's level), the forward with its loss, and the whole step (with backward); the figure is
the mix's time over the plain model's, divided by the hand-written hook's: the ratio of the two median
added times (:func:`ratio_of_medians`; a ratio per repetition would divide by a noise-sized time). The same
for input mixup (a hand-written pre-hook on the model against ``ManifoldMixup("input")``), for CutMix at
a convolution's map (a hand-written box paste against ``CutMix``) and for Random Erasing there (a
hand-written erasing hook against ``RandomErasing``, each with a plain loss): ``scenarios``.
Counted in the same step under a dispatch mode: aten ops, copies from the CPU to another device (one per
mix at most: the partner index), and reads of a device tensor's value on the host (each a sync: none)."""

from __future__ import annotations

import collections
import math
import statistics

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.timing import median_interval
from mixhook import CutMix, ManifoldMixup, RandomErasing
from mixhook.functional import beta_value

HOST_READS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default"}
COPIES = {"aten._to_copy.default", "aten.copy_.default"}


class HandMix:
    """Manifold Mixup written by hand as a forward hook, drawing from its own ``torch.Generator`` as a careful
    user would (lam from two Gamma draws, as ``torch.distributions.Beta`` draws it, and the partners with
    ``randperm``), the blend and the loss as the papers write them."""

    def __init__(self, device, alpha: float = 2.0):
        self.generator = torch.Generator().manual_seed(0)
        self.concentration = torch.tensor([alpha, alpha], dtype=torch.float64)
        self.device = device

    def draw(self, n: int) -> None:
        g0, g1 = torch._standard_gamma(self.concentration, generator=self.generator).tolist()
        self.lam = g0 / (g0 + g1)
        self.index = torch.randperm(n, generator=self.generator).to(self.device)

    def __call__(self, module, args, out):
        self.draw(out.shape[0])
        return self.lam * out + (1 - self.lam) * out[self.index]

    def loss(self, logits, y):
        return self.lam * F.cross_entropy(logits, y) + (1 - self.lam) * F.cross_entropy(logits, y[self.index])


class HandInputMix(HandMix):
    """Input mixup written by hand as the model's forward pre-hook."""

    def __call__(self, module, args):
        x = args[0]
        self.draw(x.shape[0])
        return (self.lam * x + (1 - self.lam) * x[self.index], *args[1:])


class HandCutMix(HandMix):
    """CutMix written by hand as a forward hook on a map (the authors' box: side ratio ``sqrt(1 - lam)``, a
    uniform centre, clipped; lam corrected to the area kept)."""

    def __call__(self, module, args, out):
        self.draw(out.shape[0])
        height, width = out.shape[2:]
        ratio = (1.0 - self.lam) ** 0.5
        cut_h, cut_w = int(height * ratio), int(width * ratio)
        cy = int(torch.randint(height, (), generator=self.generator))
        cx = int(torch.randint(width, (), generator=self.generator))
        y1, y2 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
        x1, x2 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
        mixed = out.clone()
        mixed[:, :, y1:y2, x1:x2] = out[self.index, :, y1:y2, x1:x2]
        self.lam = 1.0 - (y2 - y1) * (x2 - x1) / (height * width)
        return mixed


class HandErasing:
    """Random Erasing written by hand as a forward hook on a ``(B, C, H, W)`` map, over the whole batch at
    once as a careful user would: each sample's chance, ``attempts`` areas and aspect ratios drawn from its
    own generator, the first rectangle that fits at a uniform place, ``N(0, 1)`` values, one ``where``."""

    def __init__(self, p: float = 0.5, attempts: int = 100):
        self.generator = torch.Generator().manual_seed(0)
        self.p, self.attempts = p, attempts

    def __call__(self, module, args, out):
        n, _, height, width = out.shape
        g = self.generator
        chosen = torch.rand(n, generator=g, dtype=torch.float64) < self.p
        area = (0.02 + 0.38 * torch.rand(n, self.attempts, generator=g, dtype=torch.float64)) * height * width
        ratio = 0.3 + (1 / 0.3 - 0.3) * torch.rand(n, self.attempts, generator=g, dtype=torch.float64)
        rows, cols = torch.sqrt(area * ratio).round().long(), torch.sqrt(area / ratio).round().long()
        fits = (rows < height) & (cols < width)
        first = fits.byte().argmax(1, keepdim=True)
        rows, cols = rows.gather(1, first)[:, 0], cols.gather(1, first)[:, 0]
        top = (torch.rand(n, generator=g, dtype=torch.float64) * (height - rows + 1)).long()
        left = (torch.rand(n, generator=g, dtype=torch.float64) * (width - cols + 1)).long()
        chosen &= fits.any(1)
        y = torch.arange(height).view(1, -1, 1)
        x = torch.arange(width).view(1, 1, -1)
        inside = (y >= top.view(-1, 1, 1)) & (y < (top + rows).view(-1, 1, 1)) & (x >= left.view(-1, 1, 1))
        inside &= (x < (left + cols).view(-1, 1, 1)) & chosen.view(-1, 1, 1)
        inside = inside.to(out.device)[:, None]
        values = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
        return torch.where(inside, values, out)


class Floor:
    """What mixhook's structure costs with none of its checks: the model's pre-hook starts a forward, the
    layer's hook draws lam as ``ManifoldMixup`` does (``beta_value``: torch's Dirichlet kernel) and the
    partners from one torch generator and blends (index_select, lerp), the model's hook marks the output's
    autograd node with the draw, and the loss finds the draw from the logits' node."""

    def __init__(self, model: nn.Module, layer: nn.Module, alpha: float = 2.0):
        self.generator = torch.Generator().manual_seed(0)
        self.alpha, self.current, self.marks = alpha, None, {}
        model.register_forward_pre_hook(self.begin)
        layer.register_forward_hook(self.mix)
        model.register_forward_hook(self.end)

    def begin(self, model, args):
        self.current = [None] if model.training else None

    def mix(self, module, args, out):
        if self.current is None:
            return None
        lam = beta_value(self.alpha, self.alpha, self.generator)
        index = torch.randperm(out.shape[0], generator=self.generator).to(out.device)
        self.current[0] = (lam, index)
        return torch.lerp(out.index_select(0, index), out, lam)

    def end(self, model, args, out):
        self.marks[out.grad_fn] = self.current[0]
        self.current = None

    def loss(self, logits, y):
        lam, index = self.marks.pop(logits.grad_fn)
        return torch.lerp(F.cross_entropy(logits, y[index]), F.cross_entropy(logits, y), lam)


class Census(TorchDispatchMode):
    """Counts aten ops, CPU-to-device copies and host reads of device tensors."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.copies = 0
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops[name] += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in HOST_READS and any(t.device.type != "cpu" for t in tensors):
            self.reads += 1
        if name in COPIES:
            source = tensors[-1] if name == "aten.copy_.default" else tensors[0]
            target = tensors[0].device if name == "aten.copy_.default" else kwargs.get("device")
            if source.device.type == "cpu" and target is not None and torch.device(target).type != "cpu":
                self.copies += 1
        return func(*args, **kwargs)


def ratio_of_medians(a: list[float], b: list[float]) -> dict:
    """``median(a) / median(b)`` of two samples of *added* times (``nan`` where ``b``'s median is not above
    zero: no ratio), and as its spread, in place of a spread of the ratio, the paired difference ``a - b``
    per repetition in µs with the 95% interval of its median (``difference_us``). A ratio per repetition,
    or one of quantiles, divides by an added time that is itself noise-sized here (a difference of two
    timed runs, which can come out negative): such ratios ran from -1.9 to 2.6 in one run, and a spread of
    quartile ratios reached -9.2 on a loaded machine. The difference's denominator is not noise: it has
    none (``none``'s time cancels in it: it is ``mixhook``'s time minus ``hand``'s, each timed in the same
    repetition)."""
    median_b = statistics.median(b)
    difference = [x - y for x, y in zip(a, b, strict=True)]
    low, high = median_interval(difference)
    return {
        "median": statistics.median(a) / median_b if median_b > 0 else math.nan,
        "difference_us": {"median": statistics.median(difference), "low": low, "high": high},
        "n": len(a),
        "how": "ratio of medians; spread: the paired difference's median and its 95% interval, in us",
    }


# Manifold Mixup at a hidden layer, input mixup, CutMix at a map, Random Erasing at a map
SCENARIOS = ("layer", "input", "cutmix", "erasing")


def _variant(name: str, device, width: int, scenario: str = "layer") -> tuple[nn.Module, object]:
    """The small model of ``scenario`` with variant ``name``'s hook (none, the hand-written one, mixhook's,
    the floor: for the hidden layer only) and the loss it trains with. ``layer`` and ``input``: Linear,
    Identity, Linear on ``(B, width)``; ``cutmix``: a 3x3 convolution to 4 channels of a ``(B, 3, 8, 8)``
    image, Identity, a Linear head (the map is cut at the Identity)."""
    torch.manual_seed(0)
    if scenario in ("cutmix", "erasing"):
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Identity(), nn.Flatten(), nn.Linear(256, 4))
    else:
        model = nn.Sequential(nn.Linear(width, width), nn.Identity(), nn.Linear(width, 4))
    model = model.to(device).train()
    if scenario == "erasing" and name in ("hand", "mixhook"):  # (the labels untouched: a plain loss)
        if name == "hand":
            model[1].register_forward_hook(HandErasing())
        else:
            RandomErasing("1", generator=torch.Generator().manual_seed(0)).attach(model)
        return model, F.cross_entropy
    if name == "hand":
        if scenario == "input":
            hand = HandInputMix(device)
            model.register_forward_pre_hook(hand)
        else:
            hand = (HandCutMix if scenario == "cutmix" else HandMix)(device)
            model[1].register_forward_hook(hand)
        return model, hand.loss
    if name == "mixhook":
        mix = CutMix("1") if scenario == "cutmix" else ManifoldMixup("input" if scenario == "input" else "1")
        mix.attach(model)
        return model, lambda logits, t: mix.loss(F.cross_entropy, logits, t)
    if name == "floor":
        return model, Floor(model, model[1]).loss
    return model, F.cross_entropy


def _timed(what: str, model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor, calls: int):
    """``calls`` of ``what`` (``forward``, ``forward_and_loss`` or ``step``) as one timed call."""

    def call():
        for _ in range(calls):
            out = model(x)
            if what != "forward":
                value = loss(out, y)
                if what == "step":
                    value.backward()

    return call


def host(device, timer, reps: int, calls: int, batch: int = 8, width: int = 16) -> dict:
    """Manifold Mixup at a hidden layer (the top level, with the floor), and in ``scenarios`` input mixup
    and CutMix at a map, each against its hand-written hook."""
    out = scenario("layer", device, timer, reps, calls, batch, width)
    others = [name for name in SCENARIOS if name != "layer"]
    out["scenarios"] = {name: scenario(name, device, timer, reps, calls, batch, width) for name in others}
    return out


def scenario(kind: str, device, timer, reps: int, calls: int, batch: int = 8, width: int = 16) -> dict:
    """One scenario (:data:`SCENARIOS`): the added times, the census and the path of mixhook's forward."""
    shape = (batch, 3, 8, 8) if kind in ("cutmix", "erasing") else (batch, width)
    x = torch.randn(*shape, device=device)
    y = torch.randint(0, 4, (batch,), device=device)
    names = ("none", "hand", "mixhook", "floor") if kind == "layer" else ("none", "hand", "mixhook")
    variants = {name: _variant(name, device, width, kind) for name in names}
    out = {"batch": batch, "width": width, "calls": calls, "scenario": kind}
    for what in ("forward", "forward_and_loss", "step"):
        calls_of = {n: _timed(what, model, loss, x, y, calls) for n, (model, loss) in variants.items()}
        times = timer.side_by_side(calls_of, reps=reps, inner=1, warmup=1)
        added = {
            n: [(t - b) / calls * 1e6 for t, b in zip(times[n], times["none"], strict=True)] for n in variants
        }
        out[what] = {
            "added_us": {n: statistics.median(added[n]) for n in names[1:]},
            "plain_us": 1e6 * statistics.median(times["none"]) / calls,
            "mixhook_vs_hand": ratio_of_medians(added["mixhook"], added["hand"]),
        }
        if "floor" in variants:
            out[what]["floor_vs_hand"] = ratio_of_medians(added["floor"], added["hand"])
    census = {}
    for name, (model, loss) in variants.items():
        loss(model(x), y).backward()  # warm
        with Census() as seen:
            loss(model(x), y).backward()
        census[name] = {
            "aten_ops": sum(seen.ops.values()),
            "copies_to_device": seen.copies,
            "host_reads": seen.reads,
        }
    out["census"] = census
    out["extra_ops_vs_hand"] = census["mixhook"]["aten_ops"] - census["hand"]["aten_ops"]
    model, loss = variants["mixhook"]
    out["entries"] = entries(model, loss, x, y)
    return out


def entries(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The mixhook functions one training forward and its ``loss()`` enter (``sys.setprofile`` "call"
    events whose code lives under ``mixhook/``), and the files they are in: the path a reader follows."""
    import os
    import sys

    import mixhook

    root = os.path.dirname(mixhook.__file__)
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.append(f"{os.path.relpath(frame.f_code.co_filename, root)}:{frame.f_code.co_name}")

    loss(model(x), y).backward()  # (planned)
    sys.setprofile(profile)
    try:
        loss(model(x), y)
    finally:
        sys.setprofile(None)
    return {"count": len(seen), "files": len({s.split(":")[0] for s in seen}), "functions": seen}
