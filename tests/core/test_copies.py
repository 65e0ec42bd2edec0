"""Copies of a hooked model (deepcopy, EMA, AveragedModel, pickle, torch.save) are clean models; copies of a
regularizer are detached and keep its random state. Nothing a copy runs touches the original's draws.

The EMA (timm's ``ModelEmaV3``) and SWA (``AveragedModel`` + ``update_bn``) recipes are trained with
mixing end to end and compared with the same recipes on an unhooked twin fed the same mixes by hand.
"""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import (
    ActivationStats,
    CutMix,
    GradClip,
    GradScale,
    InputScale,
    ManifoldMixup,
    OneOf,
    attach,
)
from mixhook.engine.contract import ForeignLogitsError
from tests.helpers import gen, hook_count


class Net(nn.Module):
    """conv - BN - ReLU - conv - pool - linear, with batch-norm statistics for update_bn to compute."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        return self.head(self.conv2(self.bn(self.conv1(x)).relu()).mean((2, 3)))


def every_hook():
    mixer = OneOf([ManifoldMixup(["input", "bn"], generator=gen(1)), CutMix("conv1", generator=gen(2))])
    return [
        mixer,
        InputScale("conv2", (0.5, 1.5), generator=gen(3)),
        GradScale("conv2", 0.5),
        GradClip("bn", 1.0),
        ActivationStats(["conv1"]),
    ]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_a_hooked_model_is_the_model_without_hooks(how):
    torch.manual_seed(0)
    model = Net().double().train()
    plain = copy.deepcopy(model)  # before any hook
    hooks = every_hook()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    generators = [hooks[0].generator, *(m.generator for m in hooks[0].mixers), hooks[1].generator]
    with attach(model, *hooks):
        model(x)  # a training forward, so the hooks hold per-forward state too
        states = [g.get_state() for g in generators]
        if how == "deepcopy":
            twin = copy.deepcopy(model)
        elif how == "pickle":
            twin = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            twin = torch.load(buffer, weights_only=False)
        out = twin(x)  # in training mode: nothing mixed, scaled or recorded
        plain.load_state_dict(twin.state_dict())
        torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
        assert hook_count(twin) == 0  # the copied hooks removed themselves at that first call
        assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True))
        assert hooks[4].step == 1  # the copy's forward was not counted by the original's probe
        model(x)
        assert hooks[4].step == 2 and not all(
            torch.equal(g.get_state(), s) for g, s in zip(generators, states, strict=True)
        )  # the original still draws
    assert hook_count(model) == 0 and hook_count(twin) == 0


def test_a_copied_regularizer_is_detached_and_continues_the_same_draws():
    torch.manual_seed(0)
    model, other = Net().double().train(), Net().double().train()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    mix = CutMix(["conv1", "bn"], generator=gen(7))
    with mix.attach(model):
        model(x)
        copies = [copy.deepcopy(mix), pickle.loads(pickle.dumps(mix))]
        draws = []
        for _ in range(3):
            model(x)
            draws.append((mix.last.layer, mix.last.info["box"], mix.last.index.tolist()))
    for twin in copies:
        assert twin.model is None and twin.last is not None  # detached, its configuration and state kept
        with twin.attach(other):  # the same draws follow
            seen = []
            for _ in range(3):
                other(x)
                seen.append((twin.last.layer, twin.last.info["box"], twin.last.index.tolist()))
        assert seen == draws


def test_a_copied_regularizer_keeps_its_pins_and_what_pin_last_repeats():
    """Issue 97: the pins of the next forward and the last forward's record live on the mixer's path, which
    a copy makes anew; the copy keeps both (Path.kept), so a pinned or ``pin_last`` copy mixes as the
    original would."""
    torch.manual_seed(0)
    model = Net().double().train()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    mix = CutMix("conv1", generator=gen(7))
    with mix.attach(model):
        model(x)
        first = (mix.last.info["box"], mix.last.index.tolist(), float(mix.last.lam))
        mix.pin_last()
        twins = [copy.deepcopy(mix), pickle.loads(pickle.dumps(mix))]
    for twin in twins:
        assert twin.pinned and twin.last_forward is not None and twin.last is not None
        other = Net().double().train()
        with twin.attach(other):
            other(x)  # (the repeat: the original's first mix, drawn again by nothing)
        assert (twin.last.info["box"], twin.last.index.tolist(), float(twin.last.lam)) == first
    mix.pin(lam=0.25)
    twin = copy.deepcopy(mix)
    assert twin.pins.lam is not None and float(twin.pins.lam) == 0.25 and not twin.pins.skip
    mix.unpin()
    assert twin.pinned and not mix.pinned  # (each its own)


def test_a_copy_of_a_model_and_its_attached_regularizer_refuses_the_loss_until_attached_again():
    """What Lightning's ddp_spawn does to a module holding both (pickling it to the workers): the copy
    would train unmixed if ``loss`` fell back to the plain criterion, so it refuses in one line."""

    holder = Holder().train()
    x, y = torch.randn(4, 3, 6, 6), torch.tensor([0, 1, 2, 3])
    twin = pickle.loads(pickle.dumps(holder))
    assert twin.mix.model is None and hook_count(twin.net) > 0  # detached hooks, not yet called
    with pytest.raises(ForeignLogitsError, match="not computed by a forward.*not attached") as err:
        twin.mix.loss(F.cross_entropy, twin.net(x), y)
    assert "\n" not in str(err.value)
    twin.mix.attach(twin.net)
    logits = twin.net(x)
    assert twin.mix.state_for(logits) is not None  # attached again: it mixes


def _train_with_mixing(model, steps, x, y):
    """Steps of SGD on ``model`` with ManifoldMixup at ``bn`` (pinned draws: lam, partners); returns the
    draws so that an unhooked twin can be fed the same mixes by hand."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mix = ManifoldMixup("bn", generator=gen(3))
    draws = []
    with mix.attach(model):
        for _ in range(steps):
            logits = model(x)
            state = mix.state_for(logits)
            draws.append((state.lam, state.index))
            opt.zero_grad()
            mix.loss(F.cross_entropy, logits, y).backward()
            opt.step()
            yield draws[-1]


class Holder(nn.Module):
    """A module holding a network and the regularizer attached to it in ``__init__`` (a LightningModule)."""

    def __init__(self):
        super().__init__()
        self.net = Net()
        self.mix = ManifoldMixup("bn", generator=gen())
        self.mix.attach(self.net)


class HandMixed(Net):
    """The same network with the blend after ``bn`` written into ``forward()`` (a hand edit)."""

    draw = None

    def forward(self, x):
        h = self.bn(self.conv1(x))
        if self.draw is not None:
            lam, index = self.draw
            h = lam * h + (1 - lam) * h[index]
        return self.head(self.conv2(h.relu()).mean((2, 3)))


def test_the_ema_recipe_with_mixing_equals_the_hand_edited_model():
    """timm's ModelEmaV3 deep-copies the hooked model: the average's evaluation equals the EMA of a
    hand-edited twin trained on the same mixes."""
    from timm.utils import ModelEmaV3

    torch.manual_seed(0)
    model = Net().double().train()
    hand = HandMixed().double().train()
    hand.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    ema, ema_hand = ModelEmaV3(model, decay=0.5), ModelEmaV3(hand, decay=0.5)
    opt_hand = torch.optim.SGD(hand.parameters(), lr=0.1)
    for lam, index in _train_with_mixing(model, 4, x, y):
        ema.update(model)
        hand.draw = (lam, index)
        logits = hand(x)
        opt_hand.zero_grad()
        (lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])).backward()
        opt_hand.step()
        ema_hand.update(hand)
    hand.draw = ema_hand.module.draw = None
    ema.module.eval(), ema_hand.module.eval()
    torch.testing.assert_close(ema.module(x), ema_hand.module(x), rtol=1e-10, atol=1e-12)
    ema.module.train()
    torch.testing.assert_close(ema.module(x), ema_hand.module.train()(x), rtol=1e-10, atol=1e-12)
    assert hook_count(ema.module) == 0


def test_the_swa_recipe_takes_batch_norm_statistics_from_unmixed_inputs():
    """AveragedModel deep-copies the hooked model; update_bn runs training-mode forwards on it, which must
    not mix: its running statistics equal those of the unhooked average."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    model = Net().double().train()
    x, y = torch.randn(8, 3, 6, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    swa = AveragedModel(model)
    mix_steps = _train_with_mixing(model, 3, x, y)
    for _ in mix_steps:
        swa.update_parameters(model)
    loader = [(torch.randn(8, 3, 6, 6, dtype=torch.float64),) for _ in range(3)]
    unhooked = Net().double()
    unhooked.load_state_dict(swa.module.state_dict())
    update_bn(loader, swa)
    update_bn(loader, unhooked)
    torch.testing.assert_close(swa.module.bn.running_var, unhooked.bn.running_var, rtol=0, atol=0)
    torch.testing.assert_close(swa.module.bn.running_mean, unhooked.bn.running_mean, rtol=0, atol=0)


def test_a_handle_copy_is_detached():
    model = Net()
    handle = ManifoldMixup("bn").attach(model)
    twin = pickle.loads(pickle.dumps(handle))
    assert not twin.attached
    twin.remove()  # nothing to remove
    assert handle.attached
    handle.remove()
    assert hook_count(model) == 0


def _draw_in_worker(rank, mixer, path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).train()
    with mixer.attach(model):
        model(torch.ones(6, 4))
    torch.save((float(mixer.last.lam), mixer.last.index), path)


@pytest.mark.process
@pytest.mark.slow
def test_a_regularizer_sent_to_a_spawned_worker_draws_what_the_original_draws(tmp_path):
    """torch.multiprocessing spawn (Lightning's ddp_spawn, DataLoader workers) pickles a regularizer with
    its generator; torch's own reduction of a generator fails to unpickle there (its temporary state
    tensor's shared memory is gone), mixhook's sends the state as bytes: the worker's draws are the
    original's."""
    mixer = ManifoldMixup(["0", "2"], alpha=1.0, generator=torch.Generator().manual_seed(9))
    torch.rand(3, generator=mixer.generator)  # not at the start of its stream
    torch.multiprocessing.start_processes(
        _draw_in_worker, args=(mixer, tmp_path / "draw.pt"), nprocs=1, start_method="spawn"
    )
    _draw_in_worker(0, mixer, tmp_path / "here.pt")
    (lam, index), (here_lam, here_index) = torch.load(tmp_path / "draw.pt"), torch.load(tmp_path / "here.pt")
    assert lam == here_lam and torch.equal(index, here_index)
