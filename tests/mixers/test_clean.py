"""The clean+mixed mode of every mixer (``clean=True``): the mixed layer emits the clean batch followed by
its mix, and ``loss``/``targets`` know which rows are which; checked against a hand-edited forward in
float64 (logits, loss, gradients), under activation checkpointing, in copies, eval forwards and several
forwards before their losses; what would silently go wrong is refused in one line."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import CutMix, ManifoldMixup, MixupE, OneOf, RankMixup, RegMixup
from mixhook.padding import PaddingPolicyError
from tests.helpers import SmallCNN, exact, gen, grads


def per_sample(logits, target):
    return F.cross_entropy(logits, target, reduction="none")


class Net(nn.Module):
    """stem - block - head, the block optionally under activation checkpointing."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.ckpt = ckpt
        self.stem = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = self.block(h) if self.ckpt is None else checkpoint(self.block, h, use_reentrant=self.ckpt == "re")
        return self.head(h)


def data(n=6):
    torch.manual_seed(1)
    return torch.randn(n, 6, dtype=torch.double), torch.tensor([0, 1, 2, 0, 1, 2][:n])


@pytest.mark.parametrize("layer", ["input", "stem", "block.1"])
def test_clean_mode_equals_the_hand_edited_forward_logits_loss_and_gradients(layer):
    torch.manual_seed(0)
    model = Net().double().train()
    x, y = data()
    lam, index = 0.3, torch.tensor([3, 0, 5, 1, 2, 4])
    mix = ManifoldMixup(layer, generator=gen())
    mix.clean = True
    with mix.attach(model):
        mix.pin(lam=lam, index=index)
        logits = model(x)
        loss = mix.loss(per_sample, logits, y)
        loss.mean().backward()
        soft = mix.targets(y, 3, dtype=torch.double, logits=logits)
    got = grads(model)
    assert mix.last.clean and logits.shape == (12, 3) and loss.shape == (12,)

    def hand(x):  # the forward, edited by hand: the clean rows, then their mixes, at the layer
        def both(h):
            return torch.cat([h, lam * h + (1 - lam) * h[index]])

        h = both(x) if layer == "input" else x
        h = model.stem(h)
        h = both(h) if layer == "stem" else h
        h = torch.relu(h)
        h = model.block[1](model.block[0](h))
        h = both(h) if layer == "block.1" else h
        return model.head(model.block[2](h))

    model.zero_grad()
    expected = hand(x)
    clean_ce, mixed_ce = per_sample(expected[:6], y), per_sample(expected[6:], y)
    hand_loss = torch.cat([clean_ce, lam * mixed_ce + (1 - lam) * per_sample(expected[6:], y[index])])
    hand_loss.mean().backward()
    exact(logits, expected)
    exact(loss, hand_loss)
    for name, g in grads(model).items():
        exact(got[name], g)
    one_hot = F.one_hot(y, 3).double()
    exact(soft, torch.cat([one_hot, lam * one_hot + (1 - lam) * one_hot[index]]))
    with mix.attach(model):  # a reducing criterion: the doubled batch's mean
        mix.pin(lam=lam, index=index)
        logits = model(x)
        exact(mix.loss(F.cross_entropy, logits, y), hand_loss.mean())


def test_a_region_method_keeps_the_clean_map_beside_its_paste():
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3])
    mix = CutMix("conv1", generator=gen())
    mix.clean = True
    seen = []
    model.act.register_forward_hook(lambda m, a, out: seen.append(a[0].detach()))
    with mix.attach(model):
        mix.pin(box=(2, 6, 1, 5), index=[1, 2, 3, 0])
        logits = model(x)
        assert logits.shape == (8, 5) and mix.last.clean
        loss = mix.loss(F.cross_entropy, logits, y)
    h = model.conv1(x)
    pasted = h.clone()
    pasted[:, :, 2:6, 1:5] = h[[1, 2, 3, 0]][:, :, 2:6, 1:5]
    exact(seen[0], torch.cat([h, pasted]).detach())
    lam = float(mix.last.lam)
    assert lam == 1 - 16 / 64
    clean_ce = F.cross_entropy(logits[:4], y)
    mixed = lam * F.cross_entropy(logits[4:], y) + (1 - lam) * F.cross_entropy(logits[4:], y[[1, 2, 3, 0]])
    exact(loss, (clean_ce + mixed) / 2)


@pytest.mark.parametrize("ckpt", ["re", "non"])
def test_clean_mode_under_activation_checkpointing_gives_the_gradients_without_it(ckpt):
    torch.manual_seed(0)
    plain = Net().double().train()
    other = copy.deepcopy(plain)
    other.ckpt = ckpt
    x, y = data()
    results = []
    for model in (plain, other):
        mix = RegMixup("block.1", alpha=1.0, generator=gen(4))
        with mix.attach(model):
            for _ in range(2):
                model.zero_grad()
                logits = model(x)
                mix.loss(per_sample, logits, y).mean().backward()
                results.append((logits.detach(), grads(model)))
    for (la, ga), (lb, gb) in zip(results[:2], results[2:], strict=True):
        exact(lb, la)
        for name in ga:
            exact(gb[name], ga[name])


def test_eval_forwards_and_unmixed_forwards_keep_the_batch_and_the_plain_loss():
    model = Net().double()
    x, y = data()
    mix = RegMixup("stem", generator=gen(), prob=0.0)
    with mix.attach(model):
        model.train()
        logits = model(x)  # prob 0: no mix, no doubling
        assert logits.shape == (6, 3) and mix.last is None
        exact(mix.loss(F.cross_entropy, logits, y), F.cross_entropy(logits, y))
        mix.prob = 1.0
        mixed = model(x)
        model.eval()
        plain = model(x)
        assert mixed.shape == (12, 3) and plain.shape == (6, 3)
        exact(mix.loss(F.cross_entropy, plain, y), F.cross_entropy(plain, y))  # eval before loss()
        assert mix.loss(F.cross_entropy, mixed, y).shape == ()


def test_two_forwards_before_their_losses_each_get_their_own_rows():
    torch.manual_seed(0)
    model = Net().double().train()
    x, y = data()
    mix = RegMixup("stem", alpha=1.0, generator=gen(2))
    with mix.attach(model):
        first = model(x)
        one = mix.last
        second = model(x)
        two = mix.last
        assert not torch.equal(one.index, two.index)
        for logits, state in ((first, one), (second, two)):
            lam, index = float(state.lam), state.index
            expected = torch.cat([
                per_sample(logits[:6], y),
                lam * per_sample(logits[6:], y) + (1 - lam) * per_sample(logits[6:], y[index]),
            ])  # fmt: skip
            exact(mix.loss(per_sample, logits, y), expected)


def test_one_of_gives_each_forward_the_loss_of_the_mixer_that_mixed_it():
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3])
    reg, cut = RegMixup("conv1", eta=0.5, generator=gen(1)), CutMix("conv1", generator=gen(2))
    mix = OneOf([reg, cut], generator=gen(3))
    shapes = set()
    with mix.attach(model):
        for _ in range(8):
            logits = model(x)
            loss = mix.loss(per_sample, logits, y)
            state = mix.state_for(logits)
            shapes.add(logits.shape[0])
            assert loss.shape == ((8,) if state.clean else (4,))
            if state.clean:  # eta weighs the mixed rows
                lam, index = float(state.lam), state.index
                mixed = lam * per_sample(logits[4:], y) + (1 - lam) * per_sample(logits[4:], y[index])
                exact(loss, torch.cat([per_sample(logits[:4], y), 0.5 * mixed]))
    assert shapes == {4, 8}


def test_copies_keep_the_mode():
    mix = ManifoldMixup("stem", generator=gen())
    mix.clean = True
    assert copy.deepcopy(mix).clean and pickle.loads(pickle.dumps(mix)).clean
    reg = pickle.loads(pickle.dumps(RegMixup("stem", eta=0.25)))
    assert (
        reg.clean
        and reg.eta == 0.25
        and repr(reg) == "RegMixup(layer='stem', alpha=20.0, prob=1.0, eta=0.25)"
    )
    model = Net().double().train()
    with mix.attach(model):
        twin = copy.deepcopy(model)  # a copy of the hooked model has no hooks: its batch is not doubled
        assert twin(data()[0]).shape == (6, 3) and model(data()[0]).shape == (12, 3)


class ByInputBatch(nn.Module):
    """Reshapes by the batch size read from its input, downstream of the layer: loses the doubled batch."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 4)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        b = x.shape[0]
        return self.head(self.stem(x).reshape(b, -1))


def test_what_would_silently_go_wrong_is_refused_in_one_line():
    x, y = data()
    mix = ManifoldMixup("stem", generator=gen())
    mix.clean = True
    model = ByInputBatch().double().train()
    with mix.attach(model), pytest.raises(RuntimeError, match="returned shape"):
        model(x)
    model = Net().double().train()
    with mix.attach(model):
        with pytest.raises(ValueError, match="needs at least 2 samples"):
            model(x[:1])
        logits = model(x)
        with pytest.raises(ValueError, match="must have 12 rows first"):
            mix.loss(F.cross_entropy, logits[6:], y)  # only the mixed rows: which are they?
        with pytest.raises(RuntimeError, match="before attach"):
            mix.clean = False
    with pytest.raises(ValueError, match="clean cannot be False"):
        RegMixup("stem").clean = False
    with pytest.raises(TypeError, match="True or False"):
        mix.clean = 1
    with pytest.raises(ValueError, match="eta must be"):
        RegMixup("stem", eta=-1)


def test_a_model_with_padding_masks_downstream_is_refused():
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().train()
    x = torch.randn(3, 5, 8, dtype=torch.double)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    mix = RegMixup("layers.0", generator=gen())
    with mix.attach(model), pytest.raises(PaddingPolicyError, match="clean=True doubles the batch"):
        model(x, src_key_padding_mask=pad)
    with mix.attach(model):  # without a mask there is nothing to describe the B rows
        assert model(x).shape == (6, 5, 8)


def test_the_trainer_adapter_takes_the_mode_and_trls_refuses_it():
    """The HuggingFace callback averages a clean batch's 2B rows (trained against the hand loop in
    tests/integrations/test_integrations_transformers.py); under TRL's SFTTrainer, whose token metrics read
    B rows of logits, it is refused in one line before training
    (tests/integrations/test_integrations_trl.py)."""
    pytest.importorskip("transformers")
    from mixhook.integrations.transformers import MixupCallback

    class SFTConfig:  # (TRL's arguments, as the callback recognises them)
        pass

    for mixer in (RegMixup("input"), OneOf([ManifoldMixup("input"), MixupE("input")])):
        callback = MixupCallback(mixer)
        callback._check_arguments(object())  # the Trainer's own arguments: taken
        with pytest.raises(ValueError, match="keeps the clean batch .* TRL's SFTTrainer"):
            callback._check_arguments(SFTConfig())
    assert RankMixup("input").clean
