"""Exact in low precision, for every carded method (issue 81): under bfloat16 and float16 autocast and on a
bfloat16 model, each method at each site of its reference model (and a ViT block) either mixes as it does in
float32, keeping the site's dtype, or is refused in the same one line as in float32; the loss keeps the
criterion's dtype and a per-sample lam weighs it as exactly as that dtype can.

The mixed site is compared with the same method in float32 on the same values (the low-precision site's
value, upcast) and the same draws and decisions (the low-precision forward's, pinned as ``pin_last`` would
repeat them): within ``2 * eps(site dtype) * max|h|``, the rounding of a blend in the site's dtype. A site
that stays float32 under autocast (the model's input, a ViT's residual stream) must then match float32 to
float32's rounding: a mix whose arithmetic autocast took to bfloat16 (PuzzleMix's transport, AlignMix's
alignment, before issue 81) fails by orders of magnitude. A learned mask (the ``learned`` family: AutoMix's
Mix Block) is a network's output, computed as that network runs (under autocast, in its dtype, as
OpenMixup's AMP runs it): the mix is checked against the recorded mask instead. The methods come from their
cards, so a new method is covered without editing this file; each check is shown able to fail.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from harness.matrix.methods import MODELS, criterion, data
from mixhook import ManifoldMixup
from mixhook.engine.card import METHODS, build
from mixhook.engine.contract import Mixed
from mixhook.engine.forward import detached

SITES = {
    "cnn": ("input", "conv1", "conv2"),
    "vit": ("input", "blocks.0", "blocks.1"),
    "mlp": ("input", "fc1"),
}
MODES = ("bf16", "fp16", "bf16-model")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cases(cls) -> list[tuple[str, str, dict]]:
    """``(model kind, site, extra arguments)`` of a method: every site of its reference model and, for a
    CNN method, a ViT block (its tokens as a grid where the method takes ``tokens``)."""
    if cls.__name__ == "OneOf":  # (its members name their layers)
        return [("cnn", "input", {})]
    kind = cls.card.shown_on
    found = [(kind, site, {"layer": site}) for site in SITES[kind]]
    if kind == "cnn":
        tokens = {"tokens": "auto"} if "tokens" in inspect.signature(cls).parameters else {}
        found.append(("vit", "blocks.0", {"layer": "blocks.0", **tokens}))
    return found


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _inner(mixer):
    """The mixer that mixed (a OneOf's chosen one)."""
    return getattr(mixer, "chosen", None) or mixer


def run(make, kind: str, site: str, mode: str, pins=None, value=None) -> dict:
    """One training step of the mixer ``make()`` on the reference model ``kind`` in ``mode`` (``"f32"``,
    ``"bf16"``/``"fp16"`` autocast, ``"bf16-model"``): the site's value before and after the mix, the loss
    and its criterion's value on the same logits, the state and the pins that repeat the forward; or
    ``{"refused": one line}``. ``pins``: the forward's pinned draws; ``value``: the site's value forced."""
    torch.manual_seed(0)
    net = MODELS[kind]().train()
    x, y = data(kind, n=8)
    x = x.float() if value is None or site != "input" else value
    if mode == "bf16-model":
        net, x = net.to(torch.bfloat16), x.to(torch.bfloat16)
    seen: dict = {}
    target = net if site == "input" else net.get_submodule(site)

    def before(module, args, output=None):  # (registered before the mixer's hook: the unmixed value)
        if module is target:  # (not a copy's: AutoMix's momentum copy carries the model's hooks)
            seen["h"] = args[0] if output is None else output
            return value if output is not None else None
        return None

    def after(module, args, output=None):
        if module is target:
            seen["mixed"] = args[0] if output is None else output

    register = net.register_forward_pre_hook if site == "input" else target.register_forward_hook
    register(before)
    try:
        mixer = make()
        handle = mixer.attach(net)
        register(after)
        with handle, torch.autocast("cpu", AUTOCAST.get(mode, torch.bfloat16), enabled=mode in AUTOCAST):
            if pins is not None:
                _inner(mixer).pins = pins
            mixer.use_targets(y)
            logits = net(x)
            loss = mixer.loss(criterion(kind), logits, y)
            plain = criterion(kind)(logits, y)
            state = mixer.state_for(logits)
            last = _inner(mixer).last_forward
            repeat = None if last is None else last.repeat()
        loss.mean().backward()
    except (TypeError, ValueError, RuntimeError, KeyError) as error:
        return {"refused": _one_line(error)}
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    return {
        **seen, "loss": loss, "plain": plain, "state": state, "repeat": repeat, "x": x,
        "finite": bool(torch.isfinite(loss).all()) and all(bool(torch.isfinite(g).all()) for g in grads),
    }  # fmt: skip


def _upcast(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_upcast(v) for v in value)
    if isinstance(value, dict):
        return {k: _upcast(v) for k, v in value.items()}
    return value


def recorded_mix(state, h: torch.Tensor) -> torch.Tensor:
    """A learned mask's mix of ``h`` in float64 as ``state`` recorded it: the sample's own share
    (``weights``) and the partner's (``info["mask"]``), or each sample's shares of ``k`` samples."""
    h = h.double()
    info = state.info
    if "mix_indices" in info:  # (AdAutoMix's mixes of three or more samples)
        shares = info["mask"].double()
        return sum(shares[:, i : i + 1] * h[p] for i, p in enumerate(info["mix_indices"]))
    own, partner = state.weights.double()[:, None], info["mask"].double()
    return h * own + h[state.index] * partner


def problems(make, kind: str, site: str) -> list[str]:
    """What breaks the contract for the mixer ``make()`` at ``site`` in each low-precision mode (one line
    each; empty: none)."""
    out, learned = [], _learned(make)
    base = run(make, kind, site, "f32")
    for mode in MODES:
        low = run(make, kind, site, mode)
        where = f"{site} {mode}"
        if "refused" in base or "refused" in low:
            if base.get("refused") != low.get("refused"):
                out.append(
                    f"{where}: {low.get('refused', 'mixed')} where float32 {base.get('refused', 'mixed')}"
                )
            continue
        h, mixed, state = low["h"], low["mixed"], low["state"]
        if mixed.dtype != h.dtype:
            out.append(f"{where}: the site's {h.dtype} became {mixed.dtype}")
        if low["loss"].dtype != low["plain"].dtype:
            out.append(f"{where}: the loss is {low['loss'].dtype}, its criterion {low['plain'].dtype}")
        if not low["finite"]:
            out.append(f"{where}: a loss or gradient is not finite")
        if state is None or state.lam.dtype != torch.float64:
            out.append(f"{where}: the recorded lam is not float64")
        if learned:
            n = state.index.shape[0]
            reference = recorded_mix(state, h)
            rows = mixed[-n:]
        else:
            pins = low["repeat"]
            if pins is not None:
                pins = dataclasses.replace(pins, values=_upcast(dict(pins.values)))
            forced = _upcast(detached(h))
            ref = run(make, kind, site, "f32", pins, forced if site != "input" else _upcast(low["x"]))
            if "refused" in ref:
                out.append(f"{where}: its float32 repeat was refused: {ref['refused']}")
                continue
            reference, rows = ref["mixed"].double(), mixed
        error = (rows.double() - reference).abs().max().item()
        bound = 2 * torch.finfo(h.dtype).eps * h.detach().double().abs().max().item()
        if not error <= bound:
            out.append(
                f"{where}: {error:.3g} from float32's mix on the same values and draws (bound {bound:.3g})"
            )
    return out


def _learned(make) -> bool:
    """Whether ``make()`` is a method whose mask a network of its own makes (the ``learned`` family)."""
    try:
        card = type(make()).__dict__.get("card")
    except (TypeError, ValueError):  # (refused where it is made: run() says so)
        return False
    return card is not None and card.family == "learned"


def _maker(cls, extra: dict):
    def make():
        return build(cls, generator=torch.Generator().manual_seed(5), **extra)

    return make


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_every_method_mixes_in_low_precision_as_in_float32_or_refuses_the_same(name):
    cls = METHODS[name]
    found = [
        f"{site} ({kind}): {problem}"
        for kind, site, extra in cases(cls)
        for problem in problems(_maker(cls, extra), kind, site)
    ]
    assert not found, "\n".join(found)


class _LamInAutocastDtype(ManifoldMixup):
    """Manifold Mixup with its lam rounded to the autocast dtype under autocast (a mutant)."""

    def mix(self, leaves, draw):
        h, lam = leaves[0].tensor, draw.lam.float()
        if torch.is_autocast_enabled("cpu"):
            lam = lam.to(torch.get_autocast_dtype("cpu"))
        return Mixed({leaves[0].path: lam * h + (1 - lam) * h[draw.index]})


class _TransportUnderAutocast(ManifoldMixup):
    """Manifold Mixup whose blend goes through a matmul that autocast runs in bfloat16 (a mutant: what
    PuzzleMix's transport did)."""

    def mix(self, leaves, draw):
        h = leaves[0].tensor
        moved = (h.flatten(1) @ torch.eye(h[0].numel(), dtype=h.dtype)).view(h.shape)
        return Mixed({leaves[0].path: torch.lerp(moved[draw.index], moved, float(draw.lam))})


@pytest.mark.parametrize(
    ("kind", "expected"),
    [(_LamInAutocastDtype, "from float32's mix"), (_TransportUnderAutocast, "float32 became torch.bfloat16")],
)
def test_the_check_fails_a_lam_rounded_to_bfloat16_and_a_mix_autocast_took_over(kind, expected):
    def make():
        return kind("input", alpha=1.0, generator=torch.Generator().manual_seed(5))

    found = problems(make, "cnn", "input")
    assert any(expected in line for line in found), found


def test_a_per_sample_lam_weighs_a_bfloat16_loss_as_exactly_as_bfloat16_can():
    """The loss of a per-sample lam in a bfloat16 model: bfloat16 (as the criterion), and the float64
    weighing of the criterion's two bfloat16 losses rounded once to bfloat16 (computed in float32: its own
    rounding could only tell where the exact value is within float32's spacing of a bfloat16 tie, which
    these pinned values are not); lam rounded to bfloat16 first (as the loss did before issue 81) misses it
    in 2 of 64 samples here."""
    torch.manual_seed(0)
    net = MODELS["cnn"]().to(torch.bfloat16).train()
    x, y = torch.randn(64, 1, 8, 8, dtype=torch.bfloat16), torch.arange(64) % 3
    lam = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    index = torch.randperm(64, generator=torch.Generator().manual_seed(2))
    mixer = ManifoldMixup("conv1")
    per_sample = criterion("cnn")
    with mixer.attach(net):
        mixer.pin(lam=lam, index=index)
        logits = net(x)
        loss = mixer.loss(per_sample, logits, y)
    own, partner = (per_sample(logits, t).detach() for t in (y, y[index]))
    rounded = (partner.double() + lam * (own.double() - partner.double())).to(torch.bfloat16)
    assert loss.dtype == torch.bfloat16
    assert torch.equal(loss.detach(), rounded)
    assert not torch.equal(torch.lerp(partner, own, lam.to(torch.bfloat16)), rounded)  # (the check tells)
