"""The stop on a non-finite loss, read every step or lazily from the device (mixhook/app/training/finite.py):
lazily, the non-finite step and every later one until the host reads are skipped on the device, so
the model and the optimizer end exactly where the every-step check leaves them, and the error names the
same step and layer."""

import copy

import pytest
import torch
from torch import nn

from mixhook import ManifoldMixup, OneOf
from mixhook.app.training.finite import FiniteCheck, NonFiniteLoss, _advice, check_every
from mixhook.app.training.loop import Training, train_one_epoch
from tests.toy_models import TinyConvNet

MARK = 1234.0  # a batch holding this value makes conv2 return NaN: a bad batch, bad again when replayed


class MarkedConvNet(TinyConvNet):
    """conv2 returns NaN (in training) for a batch that holds the mark, wherever a mix at the input put
    it (mixed with any partner under any lam, one of the two samples keeps at least half of it)."""

    def __init__(self):
        super().__init__(in_channels=1, num_classes=4, width=4)
        self.conv2.register_forward_hook(self._nan_if_marked)

    def forward(self, x):
        self.marked = bool((x.abs() > MARK / 3).any())
        return super().forward(x)

    def _nan_if_marked(self, module, args, output):
        return output * float("nan") if module.training and self.marked else None


def batches(bad: set[int], steps: int = 8, batch: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.randn(batch, 1, 8, 8, generator=g)
        if step in bad:
            x[0, 0, 0, 0] = MARK
        out.append((x, torch.randint(0, 4, (batch,), generator=g)))
    return out


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


def train(every: int, loader, optimizer: str, mix: bool = True, precision: str = "32"):
    torch.manual_seed(0)
    model = MarkedConvNet().train()
    opt = OPTIMIZERS[optimizer](model.parameters())
    mixup = ManifoldMixup(["input", "conv1"], generator=torch.Generator().manual_seed(5)) if mix else None
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    error = None
    with mixup.attach(model) if mix else _nothing():
        try:
            train_one_epoch(
                Training(
                    model, opt, torch.device("cpu"), mixup, progress_bar=False, precision=precision,
                    scaler=scaler, finite=FiniteCheck(every, opt),
                ),
                loader,
            )  # fmt: skip
        except NonFiniteLoss as err:
            error = err
    return model, opt, error


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def assert_same_state(a, b):
    """The same parameters and optimizer state (what a step applies; BatchNorm's running statistics are
    updated by every training forward, the bad one and the locator's replay included, and a run never
    saves them after a non-finite step)."""
    (ma, oa, _), (mb, ob, _) = a, b
    for (name, x), (_, y) in zip(ma.named_parameters(), mb.named_parameters(), strict=True):
        assert torch.equal(x, y), name
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    for key in sb.keys() - sa.keys():  # Adam skipping its first step: a fresh state (zeros), as if none
        assert all(not bool(t.any()) for t in sb[key].values()), key
    assert sa.keys() <= sb.keys()
    for key in sa:
        for name in sa[key]:
            assert torch.equal(sa[key][name], sb[key][name]), (key, name)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_without_a_non_finite_loss_the_lazy_check_trains_bit_for_bit_the_same(optimizer):
    eager, lazy = train(1, batches(set()), optimizer), train(3, batches(set()), optimizer)
    assert eager[2] is None and lazy[2] is None
    assert_same_state(eager, lazy)
    assert len(lazy[1].state) == 8  # every parameter was trained


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize(
    "bad",
    [{0}, {2}, {3}, {5}, {2, 3, 4, 5, 6, 7}],
    ids=["first step", "mid-window", "last of a window", "once, read at the epoch end", "from step 3 on"],
)
def test_a_non_finite_step_and_those_after_it_are_never_applied(optimizer, bad):
    """Lazily (read every 4 steps) the run stops with the same error as when the host reads every step,
    and the model and the optimizer are bit for bit those of the steps before the bad one: a step after
    it, finite or not, changed nothing either (a bad batch once, at step 3, is read at step 4 or 8)."""
    loader = batches(bad, steps=6 if bad == {5} else 8)
    eager, lazy = train(1, loader, optimizer), train(4, loader, optimizer)
    step = min(bad) + 1
    assert str(eager[2]) == str(lazy[2]) and eager[2].step == lazy[2].step == step
    assert str(lazy[2]) == "the loss became nan; first non-finite layer output: conv2 (Conv2d)"
    assert_same_state(eager, lazy)
    reference = train(1, loader[: min(bad)], optimizer)  # what the steps before the bad one leave
    assert reference[2] is None
    assert_same_state(reference, lazy)


def test_fp16_with_a_grad_scaler_skips_on_the_device_too():
    loader = batches({2})
    eager, lazy = (train(every, loader, "adamw", precision="fp16") for every in (1, 4))
    assert str(eager[2]) == str(lazy[2]) and lazy[2].step == 3
    assert_same_state(eager, lazy)


def test_without_a_mixer_the_error_is_the_same():
    loader = batches({1})
    eager, lazy = train(1, loader, "sgd", mix=False), train(4, loader, "sgd", mix=False)
    assert str(eager[2]) == str(lazy[2]) and lazy[2].step == 2
    assert_same_state(eager, lazy)


def test_the_replay_draws_the_bad_steps_own_mix():
    """Lazily, the mixer has drawn later steps' mixes before the host reads; the locator replays the
    bad step's own (its generator put back): the mix it leaves as ``last`` is the one of the every-step
    check, which repeats the mix just drawn."""
    loader = batches({2})
    mixups = []
    for every in (1, 4):
        torch.manual_seed(0)
        model = MarkedConvNet().train()
        opt = OPTIMIZERS["sgd"](model.parameters())
        mixup = ManifoldMixup(["input", "conv1"], generator=torch.Generator().manual_seed(5))
        with mixup.attach(model), pytest.raises(NonFiniteLoss):
            train_one_epoch(
                Training(
                    model, opt, torch.device("cpu"), mixup, progress_bar=False, finite=FiniteCheck(every, opt)
                ),
                loader,
            )
        mixups.append(mixup.last)  # after the locator's replay: the bad step's mix
    (a, b) = mixups
    assert a.layer == b.layer and torch.equal(a.index, b.index) and torch.equal(a.lam, b.lam)


def test_which_optimizers_can_be_read_lazily():
    model = nn.Linear(2, 2)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fused = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert check_every(None, fused, cpu) == 1 and check_every(None, plain, cuda) == 1
    assert check_every(None, fused, cuda) == 100 and check_every(7, fused, cpu) == 7
    assert check_every(1, plain, cpu) == 1
    with pytest.raises(ValueError) as info:
        check_every(4, plain, cuda)
    assert str(info.value) == (
        "trainer.check_finite_every=4 needs an optimizer that skips a step on the device, so that no "
        "non-finite step is applied before the host reads it: +optim.fused=true (torch.optim.SGD, Adam, "
        "AdamW); SGD here is not fused; or check every step: trainer.check_finite_every=1"
    )
    with pytest.raises(ValueError, match="FiniteCheck.every=4|check_finite_every=4"):
        FiniteCheck(4, copy.copy(plain))


@pytest.mark.slow
def test_a_learned_mixers_non_finite_loss_says_what_to_try():
    """AutoMix's Mix Block can outrun the model: the one line names the layer and then the knobs the
    method states (its own rate and momentum, a lower learning rate); a mixer without them adds nothing."""
    from mixhook import AutoMix

    torch.manual_seed(0)
    model = MarkedConvNet().train()
    mix = AutoMix("input", features="conv1", generator=torch.Generator().manual_seed(5))
    with mix.attach(model):
        opt = OPTIMIZERS["sgd"]([*model.parameters(), *mix.parameters()])
        training = Training(
            model, opt, torch.device("cpu"), mix, progress_bar=False, finite=FiniteCheck(1, opt)
        )
        with pytest.raises(NonFiniteLoss) as err:
            train_one_epoch(training, batches({1}, steps=3))
    assert str(err.value) == (
        "the loss became nan; first non-finite layer output: conv2 (Conv2d); AutoMix: its Mix Block trains "
        "beside the model; try a lower mixup.clean_weight (0.5 trains SAMix on digits), a lower optim.lr, "
        "or a lower mixup.block_lr with mixup.block_momentum=0"
    )
    assert "try" not in str(train(1, batches({1}, steps=3), "sgd")[2])
    # inside a OneOf the learned mixer says it too; a OneOf of plain mixers says nothing
    said = str(err.value)
    assert _advice(OneOf([ManifoldMixup("input"), mix])) == said[said.index("; AutoMix") :]
    assert _advice(OneOf([ManifoldMixup("input"), ManifoldMixup("input")])) == ""
