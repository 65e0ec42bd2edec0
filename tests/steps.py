"""The steps of the forward path one training forward and its ``loss()`` walk, for every method of the
catalogue (issue 83): each mixer's start of the forward, the draw, the mix, the record and the loss, counted
as ``sys.setprofile`` "call" events of the functions that make them (:data:`STEPS`), after every site of the
method has been warmed up. Not the helpers they call: what the path costs is the host benchmark's
(``benchmarks/cases/host.py``, against a minimal hand-written hook), not a count of function entries.

``tests/engine/test_hot_path.py`` holds every case to :func:`expected`: a rule, derived from the method (how
many mixers it attaches, whether it runs a gradient pass), not a list kept by hand.
"""

from __future__ import annotations

import collections
import os
import sys
from collections.abc import Callable

import mixhook
from harness.matrix.cells import hand_setup
from harness.matrix.methods import METHODS, Method, _m, criterion, data, model
from mixhook.engine.binding import Forwards
from mixhook.engine.path import Path
from mixhook.engine.targets import LossAndTargets

# the methods at a hidden layer beside the matrix's (which mixes most of them at the input)
AT_LAYERS = [
    Method("ManifoldMixup (input)", _m(mixhook.ManifoldMixup, "input", alpha=1.0)),
    Method("ManifoldMixup (conv1)", _m(mixhook.ManifoldMixup, "conv1", alpha=1.0)),
    Method("CutMix (conv1)", _m(mixhook.CutMix, "conv1")),
    Method("FMix (conv1)", _m(mixhook.FMix, "conv1")),
    Method("GridMix (conv1)", _m(mixhook.GridMix, "conv1", grid=2)),
    Method("SmoothMix (conv1)", _m(mixhook.SmoothMix, "conv1")),
    Method("ResizeMix (conv1)", _m(mixhook.ResizeMix, "conv1")),
]
CASES = [*METHODS, *AT_LAYERS]

# The steps of the path (docs/development.md walks them hop by hop), each the function that makes it.
STEPS = {
    "begin": Path._on_model_input,  # a mixer's model pre-hook: its forward starts, or is left alone
    "draw": Path._draws,  # lam and the partners, drawn or pinned
    "mix": Path._mix,  # the site's tensors read, the method's mix(), put back
    "record": Forwards.record,  # a mixer's model hook: the output marked with what this forward mixed
    "loss": LossAndTargets.loss,  # loss(): the forward found from the logits, the targets weighed
}
_CODES = {function.__code__: step for step, function in STEPS.items()}


def _mixers(mixer) -> list:
    """The mixers ``mixer`` attaches: a ``OneOf``'s own, else itself."""
    return list(getattr(mixer, "mixers", None) or [mixer])


def _sites(mixer) -> list[str]:
    """The layers a mixer draws among (a ``OneOf``'s: its first mixer's)."""
    return list(_mixers(mixer)[0].layers)


def _calls(fn, seen: Callable) -> None:
    """Run ``fn()`` with ``seen(code)`` called at every Python function entry (``sys.setprofile``)."""

    def profile(frame, event, arg):
        if event == "call":
            seen(frame.f_code)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)


def entries(fn) -> list[tuple[str, str]]:
    """The mixhook functions ``fn()`` enters, in order, as ``(file, function)``: what a reader follows."""
    root = os.path.dirname(mixhook.__file__)
    calls = []
    _calls(fn, lambda code: code.co_filename.startswith(root) and calls.append(
        (os.path.relpath(code.co_filename, root), code.co_name)
    ))  # fmt: skip
    return calls


def steps(fn) -> collections.Counter:
    """How many times ``fn()`` makes each step of :data:`STEPS`."""
    seen: collections.Counter = collections.Counter()
    _calls(fn, lambda code: code in _CODES and seen.update((_CODES[code],)))
    return seen


def walk(method: Method, measure=steps) -> dict:
    """One training forward of ``method`` (its labels and partner batch given first, as the matrix's hand
    loop gives them) and its ``loss()``, after three steps at each of its sites, measured by ``measure``
    (:func:`steps`, or :func:`entries`): ``{"forward": ..., "loss": ..., "model_forwards": n, "mixers":
    m}``, ``n`` the model's forwards in the measured one (a gradient pass is one more)."""
    net = model(method.kind)
    x, y = data(method.kind, n=8)
    _, _, mixer, stream = hand_setup(method, n=8)
    loss_of = criterion(method.kind)

    def begin():
        mixer.use_targets(y)
        if stream is not None:
            mixer.use_partners(*stream.like(x, 0, 0))

    with mixer.attach(net):
        sites = _sites(mixer)
        pinned = len(sites) > 1 and not getattr(mixer, "mixers", None)  # (a OneOf draws its own)
        for layer in (*sites, sites[-1]):  # every site planned, the last one measured
            for _ in range(3):
                begin()
                if pinned:
                    mixer.pin(layer=layer)
                mixer.loss(loss_of, net(x), y).mean().backward()
        begin()
        if pinned:
            mixer.pin(layer=sites[-1])
        calls = [0]
        counting = net.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
        out = {}
        try:
            forward = measure(lambda: out.setdefault("logits", net(x)))
        finally:
            counting.remove()
        loss = measure(lambda: out.setdefault("loss", mixer.loss(loss_of, out["logits"], y)))
    return {"forward": forward, "loss": loss, "model_forwards": calls[0], "mixers": len(_mixers(mixer))}


def expected(walked: dict) -> dict:
    """The steps a training forward and its loss must make: each mixer starts each of the model's forwards
    (a gradient pass is one) and records once (its training forward's output); one draw, one mix (one
    site mixes); one loss."""
    mixers, forwards = walked["mixers"], walked["model_forwards"]
    return {
        "forward": {"begin": forwards * mixers, "draw": 1, "mix": 1, "record": mixers},
        "loss": {"loss": 1},
    }


def made(walked: dict) -> dict:
    """What :func:`walk` counted, as :func:`expected` says it."""
    return {"forward": dict(walked["forward"]), "loss": dict(walked["loss"])}
