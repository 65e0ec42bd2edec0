"""``loss``, ``targets`` and ``state_for`` use the mix of the forward that produced the logits they are given:
an eval forward's logits get the plain criterion, and each of several forwards before their losses (two
views, a teacher on the same backbone, gradient-accumulation micro-batches) its own mix; what cannot be
told is refused in one line. Each case against the hand computation in float64."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import CutMix, ManifoldMixup, OneOf
from mixhook.engine.contract import ForeignLogitsError
from tests.helpers import gen, mlp


def hand(model, x, layer_index, lam, index):
    """``model`` (an nn.Sequential) with ``lam * h + (1 - lam) * h[index]`` after part ``layer_index``."""
    h = x
    for i, part in enumerate(model):
        h = part(h)
        if i == layer_index:
            h = lam * h + (1 - lam) * h[index]
    return h


def mixed_ce(logits, y, lam, index):
    return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])


X = torch.randn(6, 6, dtype=torch.float64)
Y = torch.tensor([0, 1, 2, 3, 0, 1])
PERM = torch.tensor([5, 4, 3, 2, 1, 0])


def test_an_eval_forward_after_a_training_forward_gets_the_plain_criterion():
    """HuggingFace's Trainer evaluates with the training compute_loss: the stale training draw must not
    apply to evaluation logits; the training logits keep theirs."""
    model = mlp()
    mix = ManifoldMixup("2", generator=gen())
    with mix.attach(model):
        model.train()
        mix.pin(lam=0.3, index=PERM)
        train_logits = model(X)
        model.eval()
        eval_logits = model(X)
        with torch.no_grad():
            no_grad_logits = model(X)
        assert mix.state_for(eval_logits) is None and mix.last is not None
        torch.testing.assert_close(mix.loss(F.cross_entropy, eval_logits, Y), F.cross_entropy(eval_logits, Y))
        torch.testing.assert_close(
            mix.loss(F.cross_entropy, no_grad_logits, Y), F.cross_entropy(no_grad_logits, Y)
        )
        torch.testing.assert_close(mix.targets(Y, 4, logits=eval_logits), F.one_hot(Y, 4).float())
        model.train()
        expected = mixed_ce(hand(model, X, 2, 0.3, PERM), Y, 0.3, PERM)
        torch.testing.assert_close(mix.loss(F.cross_entropy, train_logits, Y), expected)


def test_two_views_and_four_micro_batches_each_get_their_own_mix():
    model = mlp().train()
    reference = copy.deepcopy(model)
    mix = ManifoldMixup(["0", "2"], generator=gen())
    draws = [(0, 0.2, PERM), (2, 0.7, torch.tensor([1, 0, 3, 2, 5, 4])), (2, 0.5, PERM), (0, 0.9, PERM)]
    with mix.attach(model):
        outputs = []
        for layer, lam, index in draws:  # every forward before any loss
            mix.pin(layer=str(layer), lam=lam, index=index)
            outputs.append(model(X))
        total = sum(mix.loss(F.cross_entropy, logits, Y) for logits in outputs)
        total.backward()
    expected = sum(
        mixed_ce(hand(reference, X, layer, lam, index), Y, lam, index) for layer, lam, index in draws
    )
    expected.backward()
    torch.testing.assert_close(total, expected)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_teacher_on_the_same_backbone_and_derived_logits():
    """Student (mixed) and teacher (the same backbone, not mixed) forwards before the loss; the loss
    takes logits computed from the output (a head on the hooked backbone, ``.float()``, a slice)."""
    torch.manual_seed(0)
    backbone = mlp()
    head = nn.Linear(4, 3).double()
    mix = ManifoldMixup("2", generator=gen())
    with mix.attach(backbone):
        backbone.train()
        mix.pin(lam=0.4, index=PERM)
        student = head(backbone(X))
        mix.skip_next()
        with torch.no_grad():
            features = backbone(X)
            teacher = head(features)
        assert mix.state_for(features) is None  # the teacher's forward mixed nothing
        with pytest.raises(ForeignLogitsError, match="carry no autograd graph"):
            mix.state_for(teacher)  # computed without gradients from it: cannot be traced back
        state = mix.state_for(student[:, :2].float())
        assert state is not None and float(state.lam) == pytest.approx(0.4)
        loss = mix.loss(F.cross_entropy, student, Y % 3) + F.kl_div(
            student.log_softmax(1), teacher.softmax(1), reduction="batchmean"
        )
    expected = mixed_ce(head(hand(backbone, X, 2, 0.4, PERM)), Y % 3, 0.4, PERM)
    expected = expected + F.kl_div(
        head(hand(backbone, X, 2, 0.4, PERM)).log_softmax(1),
        head(backbone(X)).softmax(1),
        reduction="batchmean",
    )
    torch.testing.assert_close(loss, expected)


def test_what_cannot_be_told_is_refused_in_one_line():
    model = mlp().train()
    mix = ManifoldMixup("2", generator=gen())
    with mix.attach(model):
        first, second = model(X), model(X)
        other = copy.deepcopy(model)(X)  # a copy: no hooks
        checks = [
            (lambda: mix.loss(F.cross_entropy, other, Y), "not computed by a forward of the model"),
            (lambda: mix.loss(F.cross_entropy, (first + second) / 2, Y), "combine the outputs of 2 forwards"),
            (lambda: mix.targets(Y, 4), "pass logits="),
            (lambda: mix.loss(F.cross_entropy, first.detach().clone(), Y), "carry no autograd graph"),
            (lambda: mix.state_for([first]), "must be a tensor"),
        ]
        for call, match in checks:
            with pytest.raises((ForeignLogitsError, TypeError), match=match) as err:
                call()
            assert "\n" not in str(err.value)
        mix.loss(F.cross_entropy, first, Y)  # each claimed by its own loss: the latest is no longer in doubt
        mix.loss(F.cross_entropy, second, Y)
        torch.testing.assert_close(mix.targets(Y, 4), mix.targets(Y, 4, logits=second))


def test_skip_next_and_a_forward_that_did_not_mix_give_the_plain_criterion():
    model = mlp().train()
    mix = ManifoldMixup("2", prob=0.0, generator=gen())
    with mix.attach(model):
        mix.pin(lam=0.3, index=PERM)
        mixed = model(X)
        unmixed = model(X)  # prob 0: no mix
        mix.skip_next()
        mix.prob = 1.0
        skipped = model(X)
        assert mix.state_for(mixed) is not None
        for logits in (unmixed, skipped):
            torch.testing.assert_close(mix.loss(F.cross_entropy, logits, Y), F.cross_entropy(logits, Y))


def test_one_of_binds_each_forward_to_the_mixer_that_mixed_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
    model = nn.Sequential(model, nn.Flatten(), nn.Linear(4 * 36, 4)).double().train()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3])
    mixers = OneOf([ManifoldMixup("0.1", generator=gen(1)), CutMix("0.1", generator=gen(2))])
    with mixers.attach(model):
        mixers.pin(choice=0, lam=0.3, index=[1, 0, 3, 2])
        blended = model(x)
        mixers.pin(choice=1, lam=0.5, index=[1, 0, 3, 2], box=(0, 3, 0, 6))
        pasted = model(x)
        assert mixers.state_for(blended).lam == pytest.approx(0.3)
        assert mixers.state_for(pasted).info["box"] == (0, 3, 0, 6)
        index = torch.tensor([1, 0, 3, 2])
        torch.testing.assert_close(mixers.loss(F.cross_entropy, blended, y), mixed_ce(blended, y, 0.3, index))
        torch.testing.assert_close(mixers.loss(F.cross_entropy, pasted, y), mixed_ce(pasted, y, 0.5, index))


def test_compiled_forwards_are_bound_too():
    """Attach, then compile: two forwards before their losses each get their own mix."""
    import torch._dynamo

    torch._dynamo.reset()
    model = mlp().train()
    mix = ManifoldMixup("2", generator=gen())
    compiled = torch.compile(model, backend="eager")
    with mix.attach(model):
        mix.pin(lam=0.2, index=PERM)
        first = compiled(X)
        mix.pin(lam=0.8, index=PERM)
        second = compiled(X)
        assert float(mix.state_for(first).lam) == pytest.approx(0.2)
        assert float(mix.state_for(second).lam) == pytest.approx(0.8)
    torch._dynamo.reset()
