"""The public API the trainer adapters are built on (issue 46, item 5): a mix drawn before the forward
(draw_for, leaves_at), a pin forgotten (unpin, pinned), per-rank seeding handed to the caller
(seed_per_rank) and the record of forwards whose loss must be taken (forwards). Each gives what the
forward itself draws and records, on the same generator."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import CutMix, ManifoldMixup, NEFTune, OneOf, SaliencyMix
from mixhook.integrations.draws import reseed


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1)).double()


X = torch.randn(6, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cls", [ManifoldMixup, CutMix])
def test_draw_for_draws_what_the_forward_draws_from_the_same_generator(cls):
    net = model()
    mixer = cls("1", generator=torch.Generator().manual_seed(5))
    with mixer.attach(net):
        net.eval()
        leaves = mixer.leaves_at("1", net[:2](X)) if cls is CutMix else None
        assert leaves is None or [tuple(leaf.tensor.shape) for leaf in leaves] == [(6, 4, 8, 8)]
        draw, (_, mixed) = mixer.draw_for("1", 6, torch.Generator().manual_seed(5), leaves=leaves)
        net.train()
        net(X)
    assert torch.equal(draw.index, mixer.last.index)
    if cls is CutMix:  # its lam is the box's: the forward's record resolves it from the box
        assert tuple(mixed.info["box"]) == tuple(mixer.last.info["box"])
        assert float(mixed.lam) == float(mixer.last.lam)
    else:
        assert torch.equal(draw.lam, mixer.last.lam)


def test_draw_for_with_an_index_and_its_refusals():
    mixer = ManifoldMixup("1")
    flip = torch.arange(5, -1, -1)
    with mixer.attach(model()):
        draw, _ = mixer.draw_for("1", 6, index=flip)
        assert torch.equal(draw.index, flip) and draw.permutation
        with pytest.raises(ValueError, match=r"draw_for\(index=...\): needs a 1-D integer index"):
            mixer.draw_for("1", 6, index=torch.zeros(6))
        with pytest.raises(ValueError, match="does not index the batch of 6"):
            mixer.draw_for("1", 6, index=torch.arange(4))
        with pytest.raises(ValueError, match=r"draw_for\(layer='2'\): not one of"):
            mixer.draw_for("2", 6)
    saliency = SaliencyMix("1")
    with saliency.attach(model()), pytest.raises(TypeError, match="cannot be drawn before the forward"):
        saliency.draw_for("1", 6)


def test_unpin_forgets_a_pin_and_pinned_says_whether_one_waits():
    net = model().train()
    mixer = ManifoldMixup("1", prob=0.0)  # never mixes unless pinned
    with mixer.attach(net):
        assert not mixer.pinned
        mixer.pin(lam=0.3)
        assert mixer.pinned
        mixer.unpin()
        assert not mixer.pinned
        net(X)
        assert mixer.last is None  # prob=0 decided: the forgotten pin did not mix
        mixer.skip_next()
        mixer.unpin()
        mixer.pin(lam=0.3)
        net(X)
        assert float(mixer.last.lam) == 0.3 and not mixer.pinned
    one = OneOf([ManifoldMixup("1", prob=0.0), ManifoldMixup("2", prob=0.0)], p=[1.0, 0.0])
    with one.attach(model().train()) as _:
        one.pin(choice=1, lam=0.5)
        one.unpin()
        assert not any(m.pinned for m in one.mixers)


def test_seed_per_rank_is_the_callers_once_it_reseeds_and_forwards_hold_the_unclaimed_mix():
    assert ManifoldMixup("1").seed_per_rank and NEFTune().seed_per_rank
    assert not ManifoldMixup("1", generator=torch.Generator()).seed_per_rank
    mixer = ManifoldMixup("1")
    reseed(mixer, seed=3, rank=0, step=0)
    assert not mixer.seed_per_rank
    net = model().train()
    with mixer.attach(net):
        mixer.forwards.claim_all()
        logits = net(X).mean((2, 3))
        assert mixer.forwards.unclaimed() == "1" == mixer.last.layer
        mixer.loss(F.cross_entropy, logits, torch.arange(6) % 4)
        assert mixer.forwards.unclaimed() is None
