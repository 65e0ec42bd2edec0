"""Plans that cannot go stale (issue 68): a mixer warmed up on one kind of forward and then given another
computes what a fresh mixer computes on that forward, or refuses it exactly as a fresh mixer refuses it.

Every method of the matrix (:mod:`harness.matrix.methods`) is warmed up for three training steps (with an
eval and a ``no_grad`` forward between them), then one thing changes at a time (the batch size, down to 1;
the input's sides; the dtype; bf16 autocast; the memory format; a keyword call; activation checkpointing
around the whole forward; the model copied and attached again; a submodule replaced and attached again).
The warmed mixer's forward is compared with a fresh mixer's on the same draws (its state loaded from the
warmed one's just before): the logits, ``loss()`` and every gradient, in float64, or the same one-line
refusal. Beside them, the three defects the issue found, each against a hand-edited
forward or a fresh mixer's refusal, and every method at a portable spec (``stage:k``) against its real name.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixhook
from harness.matrix.cells import hand_setup
from harness.matrix.methods import METHODS, Cnn, Method, criterion, model
from mixhook.layouts import AmbiguousLayoutError


def _step(mixer, stream, net, x, y, loss_of, call=None):
    """One training forward and its loss, as the matrix's hand loop takes them: the logits, the loss and
    the model's (and a learned mixer's) gradients, or the error it raised as ``(type, message)``."""
    params = [*net.parameters(), *mixer.parameters()]
    for p in params:
        p.grad = None
    try:
        mixer.use_targets(y)
        if stream is not None:
            mixer.use_partners(*stream.like(x, 0, 0))
        logits = (call or net)(x)
        loss = mixer.loss(loss_of, logits, y).mean()
        loss.backward()
    except (TypeError, ValueError, RuntimeError) as e:
        return (type(e), str(e).replace(repr(mixer), "<mixer>"))
    return logits.detach(), loss.detach(), [None if p.grad is None else p.grad.clone() for p in params]


def _same(warm, fresh, tolerance: float) -> None:
    def said(outcome):
        return outcome if isinstance(outcome[0], type) else "a mix"

    if isinstance(warm[0], type) or isinstance(fresh[0], type):
        assert warm == fresh, f"the warmed mixer: {said(warm)}; a fresh one: {said(fresh)}"
        return
    (a, la, ga), (b, lb, gb) = warm, fresh
    torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(la, lb, rtol=tolerance, atol=tolerance)
    for g, h in zip(ga, gb, strict=True):
        assert (g is None) == (h is None)
        if g is not None:
            torch.testing.assert_close(g, h, rtol=tolerance, atol=tolerance)


def _changes(kind: str):
    """What changes after the warm-up: ``(name, change)``, where ``change(net, x, y)`` returns the model,
    the batch, its labels and how the model is called (``None``: ``net(x)``), and may change the model."""

    def batch(n):
        return lambda net, x, y: (net, x[:n], y[:n], None)

    def dtype(net, x, y):
        return net.float(), x.float(), (y.float() if y.is_floating_point() else y), None

    changes = [("batch of 5", batch(5)), ("batch of 1", batch(1)), ("float32", dtype)]

    def channels_last(net, x, y):
        return net, x.contiguous(memory_format=torch.channels_last), y, None

    def permuted(net, x, y):  # the same values, other strides
        return net, x.transpose(2, 3).contiguous().transpose(2, 3), y, None

    def larger(net, x, y):
        g = torch.Generator().manual_seed(3)
        return net, torch.randn(x.shape[0], 1, 12, 12, generator=g, dtype=x.dtype), y, None

    if kind != "mlp":
        changes += [("channels-last input", channels_last), ("a permuted view as input", permuted)]
    if kind == "cnn":
        changes.append(("12x12 input", larger))

    def autocast(net, x, y):
        def call(v):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return net(v)

        return net.float(), x.float(), (y.float() if y.is_floating_point() else y), call

    def checkpointed(net, x, y):  # the whole forward recomputed in backward: every hook replays
        return net, x, y, lambda v: torch.utils.checkpoint.checkpoint(net, v, use_reentrant=False)

    changes += [
        ("a keyword call", lambda net, x, y: (net, x, y, lambda v: net(x=v))),
        ("bf16 autocast", autocast),
        ("activation checkpointing", checkpointed),
    ]
    return changes


def _warmed(method: Method, net: nn.Module, x, y):
    """The method attached to ``net`` and warmed up by three training steps (and an eval and a no_grad
    forward between them): its mixer, partner stream, criterion and handle."""
    _, _, mixer, stream = hand_setup(method, n=x.shape[0])
    loss_of = criterion(method.kind)
    handle = mixer.attach(net)
    for k in range(3):
        _step(mixer, stream, net, x, y, loss_of)
        if k == 1:
            with torch.no_grad():
                net.eval()
                net(x)
                net.train()
                mixer.use_targets(y)
                if stream is not None:
                    mixer.use_partners(*stream.like(x, 0, 0))
                mixer.loss(loss_of, net(x), y)
    return mixer, stream, loss_of, handle


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_a_warmed_mixer_computes_what_a_fresh_one_does_after_each_change(method):
    from harness.matrix.methods import data

    x, y = data(method.kind, n=8)
    for name, change in _changes(method.kind):
        net = model(method.kind)
        mixer, stream, loss_of, handle = _warmed(method, net, x, y)
        net, xc, yc, call = change(net, x, y)
        state = copy.deepcopy(mixer.state_dict())
        weights = copy.deepcopy(net.state_dict())
        warm = _step(mixer, stream, net, xc, yc, loss_of, call)
        handle.remove()
        net.load_state_dict(weights)
        _, _, fresh_mixer, _ = hand_setup(method, n=x.shape[0])
        with fresh_mixer.attach(net):
            fresh_mixer.load_state_dict(state)
            fresh = _step(fresh_mixer, stream, net, xc, yc, loss_of, call)
        tolerance = 1e-5 if xc.dtype == torch.float32 else 1e-12  # (the same ops on the same draws)
        try:
            _same(warm, fresh, tolerance)
        except AssertionError as e:
            raise AssertionError(f"{method.name}, after the warm-up: {name}: {e}") from None


def test_a_model_copied_or_a_submodule_replaced_and_attached_again_is_planned_again():
    """Attached to a copy of its model, or again after a submodule was replaced, the mixer plans anew: it
    mixes the new model's layer as a fresh mixer does (CutMix at a map, which plans its layout and sides)."""
    method = Method("CutMix", lambda _: mixhook.CutMix("conv1", generator=torch.Generator().manual_seed(5)))
    from harness.matrix.methods import data

    x, y = data("cnn", n=8)
    net = model("cnn")
    mixer, stream, loss_of, handle = _warmed(method, net, x, y)
    handle.remove()
    for make in (lambda: copy.deepcopy(net), lambda: _replaced(net)):
        other = make()
        state = copy.deepcopy(mixer.state_dict())
        with mixer.attach(other):
            warm = _step(mixer, stream, other, x, y, loss_of)
        fresh_mixer = method.make("")
        with fresh_mixer.attach(other):
            fresh_mixer.load_state_dict(state)
            fresh = _step(fresh_mixer, stream, other, x, y, loss_of)
        _same(warm, fresh, 1e-12)


def _replaced(net: nn.Module) -> nn.Module:
    torch.manual_seed(4)
    net.conv1 = nn.Conv2d(1, 4, 3, padding=1).double()
    return net


# ------------------------------------------------------------------------------ the three defects


class _Turning(nn.Module):
    """A block that returns its map ``(B, C, H, W)`` until ``permuted`` is set, then as ``(B, H, W, C)``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.permuted = False

    def forward(self, x):
        h = self.conv(x)
        return h.permute(0, 2, 3, 1) if self.permuted else h


class _TurningNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = _Turning(), nn.Linear(5 * 16 * 16, 3)

    def forward(self, x):
        return self.head(self.block(x).flatten(1))


@pytest.mark.parametrize("cls", [mixhook.CutMix, mixhook.FMix, mixhook.GridMix, mixhook.SmoothMix])
def test_a_map_that_turns_channels_last_after_the_warm_up_is_refused_as_a_fresh_mixer_refuses_it(cls):
    """Defect 1: after warm-up the plan was trusted and a box was pasted over W and C, silently."""
    torch.manual_seed(0)
    net = _TurningNet().double().train()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0])
    mixer = cls("block", generator=torch.Generator().manual_seed(0))
    with mixer.attach(net):
        for _ in range(3):
            mixer.loss(F.cross_entropy, net(x), y).backward()
        net.block.permuted = True
        with pytest.raises(AmbiguousLayoutError) as warm:
            net(x)
    with cls("block").attach(net), pytest.raises(AmbiguousLayoutError) as fresh:
        net(x)
    assert str(warm.value) == str(fresh.value)
    assert "16x5" in str(warm.value) and "\n" not in str(warm.value)
    net.block.permuted = False  # back again: mixed as before
    with mixer.attach(net):
        mixer.loss(F.cross_entropy, net(x), y).backward()
        assert mixer.last.shapes == (torch.Size([4, 5, 16, 16]),)


class _Shifted(nn.Module):
    """``forward(x, shift)``: a hidden layer plus an unbatched shift of its width (8, not the batch)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x, shift=None):
        return self.l2(torch.tanh(self.l1(x) + shift))


@pytest.mark.parametrize("layer", ["input", "l1"])
def test_a_keyword_call_whose_first_keyword_is_unbatched_mixes_the_models_input(layer):
    """Defect 2: ``net(shift=s, x=x)`` read the batch from ``shift`` (8) and refused a valid call. The batch
    is the model's first parameter, by signature, wherever it is passed; each order is the hand-edited
    forward on the same draw."""
    torch.manual_seed(0)
    net = _Shifted().double().train()
    x, s = torch.randn(4, 4, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 0])
    calls = [lambda: net(x, shift=s), lambda: net(x=x, shift=s), lambda: net(shift=s, x=x)]
    for call in calls:
        mixer = mixhook.ManifoldMixup(layer, generator=torch.Generator().manual_seed(1))
        with mixer.attach(net):
            for _ in range(2):  # (the second is planned)
                net.zero_grad()
                logits = call()
                mixer.loss(F.cross_entropy, logits, y).backward()
            lam, index = float(mixer.last.lam), mixer.last.index
        grads = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        if layer == "input":
            hand = net.l2(torch.tanh(net.l1(lam * x + (1 - lam) * x[index]) + s))
        else:
            h = net.l1(x)
            hand = net.l2(torch.tanh(lam * h + (1 - lam) * h[index] + s))
        loss = lam * F.cross_entropy(hand, y) + (1 - lam) * F.cross_entropy(hand, y[index])
        loss.backward()
        torch.testing.assert_close(logits, hand, rtol=1e-12, atol=1e-12)
        for g, p in zip(grads, net.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-12)


class _Embedded(nn.Module):
    """A language model's signature: ``forward(input_ids=None, position_ids=None, inputs_embeds=None)``."""

    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, input_ids=None, position_ids=None, inputs_embeds=None):
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h = h + 0.1 * position_ids.unsqueeze(-1).to(h.dtype)
        return self.head(torch.tanh(self.block(h))).mean(1)


def test_a_call_without_the_first_parameter_reads_its_batch_from_the_embeddings_not_the_positions():
    """``net(position_ids=p, inputs_embeds=e)``, ``p`` of batch 1 (shared by every row) passed first: the
    batch is the embeddings' (4), not the positions' (1); mixed as the hand-edited forward on the same
    draw."""
    torch.manual_seed(0)
    net = _Embedded().double().train()
    e, p = torch.randn(4, 5, 6, dtype=torch.float64), torch.arange(5)[None]
    mixer = mixhook.ManifoldMixup("block", generator=torch.Generator().manual_seed(1))
    with mixer.attach(net):
        logits = net(position_ids=p, inputs_embeds=e)
        lam, index = float(mixer.last.lam), mixer.last.index
    h = net.block(e + 0.1 * p.unsqueeze(-1).double())
    hand = net.head(torch.tanh(lam * h + (1 - lam) * h[index])).mean(1)
    torch.testing.assert_close(logits, hand, rtol=1e-12, atol=1e-12)
    assert index.shape == (4,)


class _Staged(Cnn):
    """The matrix's CNN, with its stages registered (``stage:0`` is ``conv1``, ``stage:1`` is ``conv2``)."""


mixhook.register_layers(_Staged, stages=["conv1", "conv2"])

_AT = [  # (class, layer, its other arguments): each written with real names, "stage:k" replaced below
    (mixhook.ManifoldMixup, ["input", "conv1"], {}),
    (mixhook.NoisyFeatureMixup, "conv2", {}),
    (mixhook.CutMix, "conv1", {}),
    (mixhook.FMix, "conv1", {}),
    (mixhook.GridMix, "conv1", {"grid": 2}),
    (mixhook.SmoothMix, "conv1", {}),
    (mixhook.ResizeMix, "conv1", {}),
    (mixhook.PatchUp, "conv1", {"block_size": 3}),
    (mixhook.SaliencyMix, "conv1", {}),
    (mixhook.SaliencyMix, "conv1", {"saliency": "gradient"}),
    (mixhook.AttentiveCutMix, "conv1", {"grid": 4, "top_k": 3}),
    (mixhook.PuzzleMix, "conv1", {"grids": "auto"}),
    (mixhook.SnapMix, "input", {"features": "conv2", "classifier": "fc"}),
    (mixhook.AlignMix, "conv2", {}),
    (mixhook.CatchUpMix, ["input", "conv1"], {}),
    (mixhook.AutoMix, "input", {"features": "conv1"}),
    (mixhook.SAMix, "input", {"features": "conv1"}),
    (mixhook.RegMixup, "conv1", {}),
]
_STAGES = {"conv1": "stage:0", "conv2": "stage:1"}


def _per_sample(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def _stage(value):
    if isinstance(value, list):
        return [_STAGES.get(v, v) for v in value]
    return _STAGES.get(value, value)


@pytest.mark.parametrize(("cls", "layer", "kwargs"), _AT, ids=[f"{c.__name__}-{k}" for c, _, k in _AT])
def test_every_method_at_a_portable_spec_trains_as_at_its_real_name(cls, layer, kwargs):
    """Defect 3 and item 5: a portable spec is resolved before any collaborator records a name (the
    gradient pass of SaliencyMix(saliency="gradient") kept the layer table from before attach: KeyError),
    so each method at ``stage:k`` (its layer, and ``features=``) draws, mixes and trains as at the real
    name, over two steps on the same draws."""
    from harness.matrix.methods import data

    x, y = data("cnn", n=8)
    runs = []
    for spelled in (False, True):
        torch.manual_seed(0)
        net = _Staged().double().train()
        named = {k: _stage(v) if spelled and k == "features" else v for k, v in kwargs.items()}
        mixer = cls(_stage(layer) if spelled else layer, generator=torch.Generator().manual_seed(5), **named)
        with mixer.attach(net):
            if spelled:
                assert set(mixer.layers) <= {"input", "conv1", "conv2"}
            opt = torch.optim.SGD([*net.parameters(), *mixer.parameters()], lr=0.1)
            for _ in range(2):
                mixer.use_targets(y)
                mixer.loss(_per_sample, net(x), y).mean().backward()
                opt.step()
                opt.zero_grad()
        runs.append([p.detach().clone() for p in (*net.parameters(), *mixer.parameters())])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------ compile routes (item 7)


def test_a_make_fx_trace_of_a_training_forward_is_refused_in_one_line():
    """torch.compiler.precompile (make_fx) would bake one forward's draws into an artifact that replays them
    at every call: refused in one line in training; an eval forward traces as the model does."""
    from torch.fx.experimental.proxy_tensor import make_fx

    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).train()
    x = torch.randn(6, 4)
    mix = mixhook.ManifoldMixup("1")
    with mix.attach(net):
        for trace in (lambda: make_fx(net)(x), lambda: torch.compiler.precompile(net, x, backend="eager")):
            with pytest.raises(RuntimeError, match="traced by make_fx") as refused:
                trace()
            assert "\n" not in str(refused.value)
        net.eval()
        graph = make_fx(net)(x)
        torch.testing.assert_close(graph(x), net(x))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["PuzzleMix", "SnapMix"])
def test_model_compile_with_a_mixer_that_runs_between_graphs_mixes_as_eager(method):
    """``model.compile()`` (the module method) with a mixer whose hooks run between graphs
    (``torch.compiler.disable``: pytorch/pytorch#142358 let such a hook make the module skip compiling):
    the forward mixes, and its logits, loss and gradients equal the eager forward's on the same draws."""
    from harness.matrix.methods import BY_NAME, data

    x, y = data("cnn", n=8)
    runs = []
    for compiled in (False, True):
        net = model("cnn")
        mixer = BY_NAME[method].make("")
        with mixer.attach(net):
            if compiled:
                net.compile(backend="eager")
            runs.append(_step(mixer, None, net, x, y, criterion("cnn")))
            assert mixer.last is not None
    _same(runs[1], runs[0], 1e-12)


@pytest.mark.parametrize(
    ("make", "setting", "value"),
    [
        (lambda: mixhook.ManifoldMixup("0"), "partners", "global"),
        (lambda: mixhook.ManifoldMixup("0"), "padding", "keep"),
        (lambda: mixhook.CutMix("0"), "layout", "NHWC"),
        (lambda: mixhook.FMix("0"), "spectrum", "authors"),
        (lambda: mixhook.GridMix("0"), "grid", 3),
    ],
)
def test_a_setting_the_plans_depend_on_is_refused_while_attached_and_taken_before(make, setting, value):
    """What is worked out at attach (which hops a forward takes, the layouts, the checks made once per
    signature) reads these settings: set while attached, refused in one line (the plans would go on with
    the old value, silently); the same value again is no change; detached, the setting is taken."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 64, 3))
    mixer = make()
    before = getattr(mixer, setting)
    with mixer.attach(net):
        setattr(mixer, setting, before)
        with pytest.raises(RuntimeError, match=f"{setting} was planned on when it was attached") as refused:
            setattr(mixer, setting, value)
        assert "\n" not in str(refused.value) and getattr(mixer, setting) == before
    setattr(mixer, setting, value)
    assert getattr(mixer, setting) == value
