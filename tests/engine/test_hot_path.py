"""The per-mix path is cheap and never waits for the device: lam drawn without a Dirichlet tensor but equal
to it, the blend's backward a gather that equals indexing's own, no value of a device tensor read on the
host anywhere in a training step, and no more aten ops per step than a minimal hand-written hook."""

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixhook import (
    AttentiveCutMix,
    CutMix,
    FMix,
    GridMix,
    ManifoldMixup,
    NoisyFeatureMixup,
    OneOf,
    PatchUp,
    ResizeMix,
    SaliencyMix,
    SmoothMix,
    TokenMix,
    blend,
    functional,
)
from mixhook.functional import beta_value, sample_beta
from tests.steps import STEPS, entries, steps


@pytest.mark.parametrize("a,b", [(2.0, 2.0), (0.2, 0.2), (1.0, 1.0), (20.0, 20.0), (2.0, 5.0), (1e-3, 1e-3)])
def test_a_beta_value_is_the_dirichlet_kernels_draw_and_leaves_the_generator_where_it_does(a, b):
    mine, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    concentration = torch.tensor([a, b], dtype=torch.float64)
    for _ in range(300):
        expected = float(torch._sample_dirichlet(concentration, generator=theirs)[0])
        assert beta_value(a, b, mine) == expected
    assert torch.equal(mine.get_state(), theirs.get_state())
    assert float(sample_beta(a, b, mine)) == float(
        torch._sample_dirichlet(concentration, generator=theirs)[0]
    )


@pytest.mark.parametrize(
    "lam", [0.3, torch.tensor(0.3, dtype=torch.float64), torch.rand(6, dtype=torch.float64)]
)
def test_the_gather_backward_is_indexings_own_gradient(lam, monkeypatch):
    monkeypatch.setattr(functional, "GATHER_FROM", 0)  # the gather from any size (else from 65536 elements)
    h = torch.randn(6, 3, 2, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([3, 0, 5, 1, 2, 4])
    assert type(blend(h, lam, index, permutation=True).grad_fn).__name__ == "_GatherBlendBackward"
    assert torch.autograd.gradcheck(lambda t: blend(t, lam, index, permutation=True), (h,))
    weight = torch.as_tensor(lam, dtype=torch.float64)
    weight = weight.view(-1, 1, 1) if weight.ndim else weight
    grad = torch.randn(6, 3, 2, dtype=torch.float64)
    (expected,) = torch.autograd.grad(weight * h + (1 - weight) * h[index], h, grad)
    (got,) = torch.autograd.grad(blend(h, lam, index, permutation=True), h, grad)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)


def test_a_pinned_index_with_repeats_keeps_the_summed_gradient():
    """Only a permutation may take the gather: a pinned index that repeats a partner is checked once, at
    pin(), and its repeated rows get indexing's summed gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 3)).double().train()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    mix = ManifoldMixup("1")
    with mix.attach(model):
        mix.pin(lam=0.25, index=[0, 0, 1, 1])
        mix.loss(F.cross_entropy, model(x), y).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    index = torch.tensor([0, 0, 1, 1])
    h = model[0](x)
    logits = model[2](0.25 * h + 0.75 * h[index])
    (0.25 * F.cross_entropy(logits, y) + 0.75 * F.cross_entropy(logits, y[index])).backward()
    for mine, theirs in zip(got, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["batch", "elem", "pair"])
def test_every_forward_of_a_planned_site_is_the_hand_edited_blend(mode):
    """A site that returned a plain tensor once is planned, and the next forwards with its signature take
    the cheap case at the top of the one path (Path._mix): each of several forwards, the first (read
    and planned) and those after it, equals the hand-edited forward with the same lam and index, logits
    and gradients in float64; the dtype changing in between is read and planned again and stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Identity(), nn.Linear(5, 3)).double().train()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    mix = ManifoldMixup("1", mode=mode)
    with mix.attach(model):
        for step in range(5):
            if step == 3:  # another dtype: a plan of its own
                model.float()
                x = x.float()
            logits = model(x)
            loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y).mean()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            last = mix.last
            lam = last.lam.to(x.dtype).view(-1, 1) if last.lam.ndim else float(last.lam)
            h = model[0](x)
            theirs = model[2](lam * h + (1 - lam) * h[last.index])
            per = (
                F.cross_entropy(theirs, y, reduction="none"),
                F.cross_entropy(theirs, y[last.index], reduction="none"),
            )
            weight = last.lam.to(x.dtype)
            expected = (weight * per[0] + (1 - weight) * per[1]).mean()
            tol = dict(rtol=1e-12, atol=1e-14) if x.dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(logits, theirs, **tol)
            torch.testing.assert_close(loss, expected, **tol)
            for mine, hand in zip(
                grads, torch.autograd.grad(expected, list(model.parameters())), strict=True
            ):
                torch.testing.assert_close(mine, hand, **tol)
        model.double()
        with pytest.raises(
            TypeError, match="batch dimension 0 has size 6, but the model's input has a batch of 3"
        ):
            model[1].register_forward_hook(
                lambda m, a, out: torch.cat([out, out]), prepend=True
            )  # (B rows become 2B)
            model(x[:3].double())


def _conv():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.Flatten(),
        nn.Linear(1024, 5),
    )


MIXERS = {
    "manifold_layers": lambda: ManifoldMixup(["input", "0", "2"]),
    "manifold_prob": lambda: ManifoldMixup("0", prob=0.5),
    "manifold_elem": lambda: ManifoldMixup("0", mode="elem"),
    "manifold_pair": lambda: ManifoldMixup("0", mode="pair"),
    "nfm": lambda: NoisyFeatureMixup("0"),
    "cutmix_input": lambda: CutMix("input"),
    "cutmix_hidden": lambda: CutMix("0"),
    "cutmix_elem": lambda: CutMix("input", mode="elem"),
    "fmix": lambda: FMix("0"),
    "gridmix": lambda: GridMix("input"),
    "smoothmix": lambda: SmoothMix("0"),
    "resizemix": lambda: ResizeMix("input"),
    "patchup": lambda: PatchUp("0"),
    "tokenmix": lambda: TokenMix("input"),
    "saliencymix": lambda: SaliencyMix("2"),
    "attentivecutmix": lambda: AttentiveCutMix("2"),
    "oneof": lambda: OneOf([ManifoldMixup("0"), CutMix("input")]),
}


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_no_value_of_a_device_tensor_is_read_on_the_host_in_a_training_step(kind):
    """A model on the meta device has tensors whose values do not exist: any ``.item()``, ``int()``,
    ``bool()`` or ``.tolist()`` of an activation, a label or a draw moved to the model's device would
    raise. Draws, blends, ``loss`` and ``targets`` run through, so on a GPU none of them waits for it."""
    torch.manual_seed(0)
    model = _conv().to("meta").train()
    mix = MIXERS[kind]()
    x = torch.randn(6, 3, 16, 16, device="meta")
    y = torch.randint(0, 5, (6,), device="meta")
    with mix.attach(model):
        for _ in range(3):
            mix.use_targets(y)
            logits = model(x)
            mix.loss(lambda a, b: F.cross_entropy(a, b, reduction="none"), logits, y).sum().backward()
            mix.use_targets(y)
            logits = model(x)
            soft = mix.targets(y, num_classes=5, logits=logits)
            assert soft.shape == (6, 5) and soft.device.type == "meta"
            F.cross_entropy(logits, soft).backward()


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class _HandMix:
    """A minimal hand-written Manifold Mixup hook with its own generators (NumPy's Beta, torch's randperm)."""

    def __init__(self):
        import numpy as np

        self.rng = np.random.default_rng(0)
        self.g = torch.Generator().manual_seed(0)

    def __call__(self, module, args, out):
        self.lam = float(self.rng.beta(2.0, 2.0))
        self.index = torch.randperm(out.shape[0], generator=self.g)
        return self.lam * out + (1 - self.lam) * out[self.index]

    def loss(self, logits, y):
        return self.lam * F.cross_entropy(logits, y) + (1 - self.lam) * F.cross_entropy(logits, y[self.index])


def _step_ops(model, loss, x, y) -> int:
    loss(model(x), y).backward()  # warm-up
    with _Count() as count:
        loss(model(x), y).backward()
    return sum(count.ops.values())


def test_a_training_step_dispatches_at_most_two_ops_more_than_a_hand_written_hook():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16), nn.Identity(), nn.Linear(16, 4)).train()

    hand, hooked = model(), model()
    manual = _HandMix()
    hand[1].register_forward_hook(manual)
    mix = ManifoldMixup("1")
    with mix.attach(hooked):
        ours = _step_ops(hooked, lambda logits, t: mix.loss(F.cross_entropy, logits, t), x, y)
    theirs = _step_ops(hand, manual.loss, x, y)
    assert ours <= theirs + 2, (ours, theirs)


class _Copies(TorchDispatchMode):
    """Counts the copies of a CPU tensor to another device."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) == "aten._to_copy.default" and args[0].device.type == "cpu":
            target = kwargs.get("device")
            self.copies += target is not None and torch.device(target).type != "cpu"
        return func(*args, **kwargs)


@pytest.mark.parametrize("width", [4, 2048])  # 6x4x16x16: indexing's backward; 6x2048x16x16: the gather
def test_a_mix_copies_its_partner_index_to_the_device_once_and_the_loss_takes_that_copy(width):
    """On a device (meta here: the same path as CUDA's, without values) the blend needs the partner index
    there and so does the loss (the partners' targets): one copy, as a hand-written hook keeps its index
    on the device (the gather backward of a large map inverts the permutation on the device)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.Flatten(), nn.Linear(width * 256, 5))
    model = model.to("meta").train()
    x, y = torch.randn(6, 3, 16, 16, device="meta"), torch.randint(0, 5, (6,), device="meta")
    mix = ManifoldMixup("0")
    with mix.attach(model):
        for _ in range(2):
            with _Copies() as forward:
                logits = model(x)
            with _Copies() as loss:
                value = mix.loss(F.cross_entropy, logits, y)
            value.backward()
            assert (forward.copies, loss.copies) == (1, 0)


def test_an_index_changed_in_place_or_another_index_is_copied_anew():
    from mixhook.transfer import to_device

    index = torch.tensor([2, 0, 1])
    first = to_device(index, torch.device("meta"))
    assert to_device(index, torch.device("meta")) is first  # unchanged: the same copy
    index[0] = 1  # in place: its version moves
    assert to_device(index, torch.device("meta")) is not first
    assert to_device(index.clone(), torch.device("meta")) is not first  # another tensor
    with torch.inference_mode():
        frozen = torch.tensor([1, 0])
    assert to_device(frozen, torch.device("meta")).device.type == "meta"  # (no version counter: copied)


def test_one_plain_forward_and_its_loss_walk_each_step_once_and_redo_nothing_per_site():
    """Issues 57 and 83: the path a reader follows. A plain Manifold Mixup forward (the model's pre-hook
    decides, the layer's hook draws, blends and records, the output is marked) and its loss() make each
    step of the path once, once its site is planned. What is per site or per model (names, messages, the
    layout read, the packing probe, the rank's seed) is not redone per forward. (What the path costs is
    the host benchmark's, against a minimal hand-written hook: benchmarks/cases/host.py.)"""
    torch.manual_seed(0)
    widths = [8, 16, 16, 16, 16, 4]
    layers = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).train()  # 5 linear layers
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    mix = ManifoldMixup("2", generator=torch.Generator().manual_seed(0))
    with mix.attach(model):
        for _ in range(3):
            mix.loss(F.cross_entropy, model(x), y).backward()
        out = {}
        made = steps(lambda: out.setdefault("logits", model(x)))
        made += steps(lambda: out.setdefault("loss", mix.loss(F.cross_entropy, out["logits"], y)))
        assert mix.state_for(out["logits"]) is mix.last  # (the loss found this forward's mix)
        calls = entries(lambda: mix.loss(F.cross_entropy, model(x), y))
    assert dict(made) == dict.fromkeys(STEPS, 1)
    names = {name for _, name in calls}
    assert not names & {"refuse", "packing", "packed", "format_path", "seed_for_rank", "_note", "size_along"}


def test_what_a_forward_skips_is_worked_out_again_where_it_changes():
    """What the cheap case keeps (a site's plan, the model's packing probe, which hops the method needs)
    holds until what it depends on changes: a layer that returns another kind of output is read again, a
    model changed and attached again is worked out again, a method's own check runs on every forward of
    the cheap case, and a model that can be given packed batches is probed at every forward."""
    from mixhook.packing import PackedBatchError

    torch.manual_seed(0)
    x = torch.randn(6, 4, dtype=torch.float64)

    class Picky(ManifoldMixup):  # its own check, in the cheap case too
        calls = 0

        def check_leaves(self, spec, leaves):
            Picky.calls += 1
            if Picky.calls == 3:
                raise TypeError("Picky refuses the third forward")

    model = nn.Sequential(nn.Linear(4, 5), nn.Identity(), nn.Linear(5, 3)).double().train()
    mix = Picky("1")
    with mix.attach(model):
        model(x), model(x)
        with pytest.raises(TypeError, match="Picky refuses the third forward"):
            model(x)

    def refuse(spec, leaves):  # a check set on one mixer, not its class: heard as well
        raise TypeError(f"this mixer refuses {spec!r}")

    mix = ManifoldMixup("1")
    mix.check_leaves = refuse
    with mix.attach(model), pytest.raises(TypeError, match="this mixer refuses '1'"):
        model(x)

    class Pair(nn.Module):  # returns a (tensor, tensor) pair: no plain tensor, no plan
        def forward(self, h):
            return h, 2 * h

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = nn.Sequential(nn.Linear(4, 5), nn.Identity()), nn.Linear(5, 3)

        def forward(self, h, **kwargs):  # takes any keyword: packed batches can reach it
            h = self.body(h)
            return self.out(h[0] if isinstance(h, tuple) else h)

    net = Head().double().train()
    mix = ManifoldMixup("body.1", generator=torch.Generator().manual_seed(0))
    with mix.attach(net):
        net(x)
        assert mix.last.elements == ("[]",)
        restarting = torch.tensor([[0, 1, 2, 0, 1, 2]] * 6)
        with pytest.raises(PackedBatchError, match="position_ids restart inside a row"):
            net(x, position_ids=restarting)
    net.body[1] = Pair()  # the model changed: attached again, its site is read again
    with mix.attach(net):
        out = net(x)
        assert mix.last.elements == ("[0]", "[1]")
        h = net.body[0](x)
        lam, index = float(mix.last.lam), mix.last.index
        torch.testing.assert_close(out, net.out(lam * h + (1 - lam) * h[index]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "name", ["ManifoldMixup (input)", "ManifoldMixup (conv1)", "CutMix", "CutMix (conv1)", "FMix (conv1)"]
)
def test_input_mixup_and_the_mask_methods_walk_the_one_short_path(name):
    """Issue 68: Manifold Mixup at a hidden layer and at the input, CutMix and FMix at the input or a
    layer: what a model does not need is decided once, not per forward: no padding masks asked for, no
    structure walked, no gradient pass, no leaf read beside the site's plan."""
    from tests.steps import CASES, walk

    (method,) = [m for m in CASES if m.name == name]
    walked = walk(method, entries)
    names = {fn for _, fn in walked["forward"] + walked["loss"]}
    assert names & {"_mix", "blend", "mix", "loss"}  # (the path measured, not an empty call)
    assert not names & {"batch_leaves", "at_input", "Inputs", "gradient_at", "leaves"}
    # no object built beside the records (whose __init__s are generated: contract.record) and a deferred
    # value's (CutMix's box weights, made if a dense target reads them)
    assert [file for file, fn in walked["forward"] + walked["loss"] if fn == "__init__"] in (
        [],
        ["engine/contract.py"],
    )


@pytest.mark.slow
def test_every_catalogue_method_walks_each_step_of_the_path_once():
    """Issue 83: every method of the catalogue (the matrix's, and the region methods at a hidden layer):
    one training forward and its loss() make each step of the path as often as the method says (each of
    its mixers starts each forward of the model, a gradient pass one of them, and records once; one draw,
    one mix, one loss), never a step twice: derived from the method (tests/steps.py), not pinned by hand.
    What a step costs is the host benchmark's (benchmarks/cases/host.py)."""
    from tests.steps import CASES, expected, made, walk

    torch.manual_seed(0)
    wrong = {}
    for method in CASES:
        walked = walk(method)
        if made(walked) != expected(walked):
            wrong[method.name] = (made(walked), expected(walked))
    assert not wrong, f"(made, expected): {wrong}"
