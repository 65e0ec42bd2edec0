"""The mixers' public contract: a method written against it alone (``ChannelSwap`` below) is exact, composes
in OneOf, replays under activation checkpointing and repeats with ``pin_last``, like the built-in ones;
``mix()`` results that would leave something silently unmixed are refused; and every method in the package
comes with its module, its test and its card."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixhook
from mixhook import (
    ActivationStats,
    AttentiveCutMix,
    CutMix,
    GradScale,
    InputScale,
    ManifoldMixup,
    Mixed,
    Mixer,
    MixingHook,
    NoisyFeatureMixup,
    OneOf,
    PatchUp,
    SaliencyMix,
    TokenMix,
    attach,
)
from tests.helpers import gen, grads

ROOT = Path(__file__).resolve().parents[2]


class ChannelSwap(Mixer):
    """A method of our own, written against the public contract only: every other channel of each
    sample (the even ones or the odd ones, drawn) comes from its partner; the sample keeps the rest."""

    pin_keys = ("offset",)

    def __init__(self, layer, **kwargs):
        super().__init__(layer, alpha=1.0, **kwargs)

    def check_leaves(self, spec, leaves):
        if any(leaf.tensor.ndim != 4 or leaf.dim != 0 for leaf in leaves):
            raise TypeError(f"ChannelSwap at {spec!r} needs (B, C, H, W) maps")

    def mix(self, leaves, draw):
        offset = draw.pinned.get("offset")
        if offset is None:
            offset = int(torch.randint(2, (), generator=draw.generator))
        tensors = {}
        for leaf in leaves:
            h = leaf.tensor
            m = torch.zeros(h.shape[1], dtype=h.dtype)
            m[offset::2] = 1
            m = m.view(1, -1, 1, 1)
            tensors[leaf.path] = (1 - m) * h + m * h[draw.index]
        kept = 1 - float(m.sum()) / h.shape[1]
        return Mixed(tensors, lam=torch.tensor(kept, dtype=torch.float64), info={"offset": offset})


def convnet(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 5, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(5, 4, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).double()


def test_a_mixer_of_our_own_matches_the_hand_edited_forward_in_logits_and_gradients():
    x, y = torch.randn(4, 3, 6, 6, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    model, hand = convnet(), convnet()
    mix = ChannelSwap("0", generator=gen(1))
    with mix.attach(model.train()):
        logits = model(x)
        mix.loss(F.cross_entropy, logits, y).backward()
    last = mix.last
    assert isinstance(mix, MixingHook) and last.layer == "0" and set(last.info) == {"offset"}
    h = hand[0](x)  # the forward written by hand with the same draw
    m = torch.zeros(5, dtype=torch.double)
    m[last.info["offset"] :: 2] = 1
    m = m.view(1, -1, 1, 1)
    expected = hand[1:]((1 - m) * h + m * h[last.index])
    kept = 1 - float(m.sum()) / 5
    assert float(last.lam) == kept
    (kept * F.cross_entropy(expected, y) + (1 - kept) * F.cross_entropy(expected, y[last.index])).backward()
    torch.testing.assert_close(logits, expected, rtol=1e-12, atol=1e-12)
    for name, g in grads(hand).items():
        torch.testing.assert_close(grads(model)[name], g, rtol=1e-12, atol=1e-12)
    soft = mix.targets(y, 3)
    onehot = F.one_hot(y, 3).double()
    torch.testing.assert_close(soft.double(), kept * onehot + (1 - kept) * onehot[last.index])


def test_a_mixer_of_our_own_is_pinned_composed_and_refused_like_a_built_in_one():
    model = convnet().train()
    x = torch.randn(4, 3, 6, 6, dtype=torch.double)
    swap, mixup = ChannelSwap("0", generator=gen(1)), ManifoldMixup("2", generator=gen(2))
    with pytest.raises(TypeError, match=r"ChannelSwap.pin\(\) got unknown values \['box'\]; valid: .*offset"):
        swap.pin(box=(0, 1, 0, 1))
    both = OneOf([swap, mixup], generator=gen(3))
    chosen = set()
    with both.attach(model):
        both.pin(0, offset=1, index=[1, 0, 3, 2])
        model(x)
        assert (
            both.chosen is swap and both.last.info["offset"] == 1 and both.last.index.tolist() == [1, 0, 3, 2]
        )
        for _ in range(40):
            model(x)
            chosen.add(type(both.chosen).__name__)
            assert both.last is both.chosen.last and (mixup.last is None or swap.last is None)
        with pytest.raises(RuntimeError, match="already has a mixing regularizer attached"):
            ChannelSwap("0").attach(model)
    assert chosen == {"ChannelSwap", "ManifoldMixup"} and swap.model is None and mixup.model is None
    with pytest.raises(ValueError, match="2 mixing regularizers"):
        attach(model, ChannelSwap("0"), CutMix("0"))
    with pytest.raises(TypeError, match="needs \\(B, C, H, W\\) maps"), ChannelSwap("4").attach(model):
        model(x)


class Checkpointed(nn.Module):
    def __init__(self, use_checkpoint):
        super().__init__()
        self.net, self.use_checkpoint = convnet(), use_checkpoint

    def forward(self, x):
        body, head = self.net[:3], self.net[3:]
        h = checkpoint(body, x, use_reentrant=False) if self.use_checkpoint else body(x)
        return head(h)


def test_a_mixer_of_our_own_replays_its_draws_under_activation_checkpointing():
    x, y = torch.randn(4, 3, 6, 6, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    results = []
    for use in (False, True):
        model = Checkpointed(use).train()
        mix = ChannelSwap("net.0", generator=gen(5))
        with mix.attach(model):
            for _ in range(3):  # the offset drawn in the forward is drawn again, the same, in the recompute
                model.zero_grad()
                mix.loss(F.cross_entropy, model(x), y).backward()
                results.append((use, mix.last.info["offset"], grads(model)))
    plain, ckpt = results[:3], results[3:]
    for (_, o1, g1), (_, o2, g2) in zip(plain, ckpt, strict=True):
        assert o1 == o2
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-12, atol=1e-12)


class OwnGeneratorSwap(ChannelSwap):
    """ChannelSwap drawing its offset from the mixer's own generator instead of ``draw.generator``: what
    the contract forbids, since a repeat draws from a copy of the generator's state."""

    def mix(self, leaves, draw):
        offset = int(torch.randint(2, (), generator=self.generator))
        return super().mix(leaves, dataclasses.replace(draw, pinned={**draw.pinned, "offset": offset}))


def test_a_mix_that_draws_from_its_own_generator_is_refused_where_a_repeat_would_differ():
    """Issue 97: the path swaps nothing on the mixer for a repeat (it used to swap ``mixer.generator`` for
    the length of a draw); a method that draws from ``self.generator`` rather than ``draw.generator`` is
    refused in one line in the repeat (``pin_last``, a recomputation), which would otherwise draw anew."""
    x, y = torch.randn(4, 3, 6, 6, dtype=torch.double), torch.tensor([0, 1, 2, 0])
    model = convnet().train()
    mix = OwnGeneratorSwap("0", generator=gen(5))
    with mix.attach(model):
        model(x)  # a first forward draws from the generator it is given, its own: nothing to refuse
        mix.pin_last()
        with pytest.raises(RuntimeError, match=r"OwnGeneratorSwap.mix\(\) at '0' drew from the mixer's own "):
            model(x)
    model, mix = Checkpointed(True).train(), OwnGeneratorSwap("net.0", generator=gen(5))
    with mix.attach(model):
        with pytest.raises(RuntimeError, match="draw every value from draw.generator"):
            mix.loss(F.cross_entropy, model(x), y).backward()


def every_kind():
    return [
        ("manifold", lambda: ManifoldMixup(["input", "0", "2"], generator=gen(1))),
        ("manifold-elem", lambda: ManifoldMixup("2", mode="elem", generator=gen(1))),
        ("cutmix", lambda: CutMix(["input", "0"], generator=gen(1))),
        ("patchup", lambda: PatchUp("0", block_size=3, gamma=0.6, generator=gen(1))),
        ("nfm", lambda: NoisyFeatureMixup(["input", "2"], generator=gen(1))),
        ("oneof", lambda: OneOf([CutMix("0", generator=gen(1)), NoisyFeatureMixup("2")], generator=gen(2))),
        ("own", lambda: ChannelSwap("0", generator=gen(1))),
        ("saliencymix", lambda: SaliencyMix(["0", "2"], generator=gen(1))),
        ("attentivecutmix", lambda: AttentiveCutMix("0", grid=3, top_k=2, generator=gen(1))),
        ("tokenmix", lambda: TokenMix(["input", "0"], generator=gen(1))),
    ]


def generator_states(hook):
    hooks = hook.mixers if isinstance(hook, OneOf) else []
    return [h.generator.get_state() for h in [hook, *hooks]]


@pytest.mark.parametrize("make", [m for _, m in every_kind()], ids=[k for k, _ in every_kind()])
def test_pin_last_repeats_the_last_mix_exactly_and_skip_next_skips_without_drawing(make):
    model = convnet().train()
    x = torch.randn(6, 3, 6, 6, dtype=torch.double)
    hook = make()
    with hook.attach(model):
        first = model(x)
        last = hook.last
        states = generator_states(hook)
        hook.pin_last()
        again = model(x)
        assert torch.equal(again, first)  # every draw repeated: lam, index, box, mask, noise
        assert hook.last.layer == last.layer and torch.equal(hook.last.lam, last.lam)
        assert torch.equal(hook.last.index, last.index) and hook.last.info.keys() == last.info.keys()
        for a, b in zip(generator_states(hook), states, strict=True):
            assert torch.equal(a, b)  # the repeat drew nothing from the mixer's own streams
        hook.skip_next()
        skipped = model(x)
        assert hook.last is None
        for a, b in zip(generator_states(hook), states, strict=True):
            assert torch.equal(a, b)  # a skipped forward draws nothing either
        model.eval()
        torch.testing.assert_close(skipped, model(x), rtol=0, atol=0)  # unmixed: the eval forward
        model.train()
        hook.pin_last()  # after a forward that did not mix: the next one does not either
        model(x)
        assert hook.last is None
        model(x)
        assert hook.last is not None  # sampling resumes


def test_mix_results_that_would_leave_something_unmixed_are_refused():
    class Forgetful(ChannelSwap):
        def mix(self, leaves, draw):
            return Mixed({})

    class Reshaping(ChannelSwap):
        def mix(self, leaves, draw):
            return Mixed({leaf.path: leaf.tensor[:, :1] for leaf in leaves})

    class Tuple(ChannelSwap):
        def mix(self, leaves, draw):
            return {leaf.path: leaf.tensor for leaf in leaves}, None

    model = convnet().train()
    x = torch.randn(2, 3, 6, 6, dtype=torch.double)
    for cls, error, message in (
        (
            Forgetful,
            RuntimeError,
            r"Forgetful.mix\(\) at '0' returned tensors for \[\] but was given \[.*\]: every",
        ),
        (
            Reshaping,
            RuntimeError,
            r"Reshaping.mix\(\) at '0' changed the shape of .* from \(2, 5, 6, 6\) to \(2, 1",
        ),
        (Tuple, TypeError, r"Tuple.mix\(\) must return a mixhook.mixers.Mixed, got tuple"),
    ):
        with pytest.raises(error, match=message), cls("0").attach(model):
            model(x)


def test_mixing_hooks_are_told_apart_by_one_class():
    mixing = [ManifoldMixup("0"), CutMix("0"), PatchUp("0"), NoisyFeatureMixup("0"), ChannelSwap("0")]
    mixing.append(OneOf([ManifoldMixup("0"), CutMix("0")]))
    assert all(isinstance(h, MixingHook) for h in mixing)
    others = [GradScale("0", 0.5), InputScale("0", 0.5), ActivationStats("0")]
    assert not any(isinstance(h, MixingHook) for h in others)
    assert mixhook.compose.mixers_of([*others, mixing[0]]) == [mixing[0]]


def test_every_method_comes_with_its_module_test_and_card():
    """What adding a mixer takes, checked: its module (one method each), its test and its card, whose
    catalogue signature names real arguments with their real defaults. The package finds the class and
    exports it from mixhook; the catalogue, the API page, the app's group and the matrix read its card
    (tests/mixers/test_adding_a_mixer.py adds one from the docs alone)."""
    import inspect

    from mixhook.engine.card import METHODS

    assert set(mixhook.mixers.DEFINED_HERE) >= {"ManifoldMixup", "NoisyFeatureMixup", "CutMix", "OneOf"}
    modules = {}
    for name, cls in mixhook.mixers.DEFINED_HERE.items():
        assert METHODS.get(name) is cls, f"{name}: no card (card = mixhook.Card(...) in its class)"
        module = cls.__module__.rsplit(".", 1)[1]
        modules.setdefault(module, []).append(name)
        assert getattr(mixhook, name) is cls and name in mixhook.__all__
        assert (ROOT / "tests" / "mixers" / f"test_{module}.py").is_file(), (
            f"{name}: no tests/mixers/test_{module}.py"
        )
        card = cls.card
        assert card.signature.startswith(f"{name}("), card.signature
        real = inspect.signature(cls).parameters
        for argument in re.findall(r"(\w+)=((?:\([^)]*\))|[^,)]+)", card.signature.removeprefix(f"{name}(")):
            key, shown = argument
            assert key in real, f"{name}.card.signature names {key}, which {name} does not take"
            assert shown.strip() == repr(real[key].default).replace("'", '"'), (
                f"{name}.card.signature shows {key}={shown}, its default is {real[key].default!r}"
            )
        assert cls.__doc__ and "mix" in cls.__doc__.lower()
    assert all(len(names) == 1 for names in modules.values()), f"one method per module: {modules}"


def test_every_matrix_method_trains_a_step_with_its_generators_on_the_batchs_device():
    """The CPU twin of tests/e2e/test_cuda.py's CUDA-generator test: every method of the matrix trains a
    step with generators of its own on the batch's device (here the CPU), its partners moved there."""
    from harness.matrix.cells import steps_with_own_generators

    assert steps_with_own_generators("cpu") == []
