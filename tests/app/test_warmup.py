"""The learning-rate warm-up (trainer.warmup_epochs): each optimizer step's rate is the epoch scheduler's
times the linear factor of Goyal et al. 2017, the scheduler never sees the factor, and a checkpoint holds
the scheduled rate."""

import pytest
import torch
from torch import nn

from mixhook.app.data import build_data
from mixhook.app.training import Run, Settings, train
from mixhook.app.training import checkpoint as ckpt
from mixhook.app.training.warmup import Warmup


def test_the_factor_rises_linearly_from_the_start_factor_to_one_over_the_warmup_epochs():
    warmup = Warmup(epochs=2, start_factor=0.25)
    factors = [warmup.factor(k, steps=4) for k in range(10)]
    assert factors == [0.25 + 0.75 * k / 8 for k in range(8)] + [1.0, 1.0]


@pytest.mark.parametrize("schedule", ["cosine", "multistep"])
def test_every_step_trains_at_the_scheduled_rate_times_the_factor(tmp_path, schedule):
    """Through the app's loop: the rate each optimizer step uses, against the same scheduler stepped per
    epoch without a warm-up times the hand-written factor. Cosine computes its next rate from the current
    one, so a factor left in the optimizer would carry on into every later epoch."""
    torch.manual_seed(0)
    data = build_data("digits", batch_size=64, train_size=200)
    steps, epochs = len(data.train), 4
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4, momentum=0.9)

    def scheduler_of(opt):
        if schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3], gamma=0.1)

    used = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    settings = Settings(epochs=epochs, progress_bar=False, warmup_epochs=2, warmup_start_factor=0.25)
    run = Run(model, data, optimizer, scheduler_of(optimizer), torch.device("cpu"), settings)
    rows = train(run, tmp_path)["epochs"], (tmp_path / "metrics.csv").read_text().splitlines()[1:]

    twin = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
    scheduled = scheduler_of(twin)
    expected = []
    for epoch in range(epochs):
        expected += [twin.param_groups[0]["lr"] * min(1.0, 0.25 + 0.75 * k / (2 * steps))
                     for k in range(epoch * steps, (epoch + 1) * steps)]  # fmt: skip
        twin.step()  # (no gradients: nothing changes; torch wants a step before the scheduler's)
        scheduled.step()
    assert used == pytest.approx(expected, rel=1e-12)
    assert used[0] == pytest.approx(0.1) and used[2 * steps] == pytest.approx(expected[2 * steps])
    # metrics.csv's lr: the rate of each epoch's first step; the checkpoint: the scheduler's rate
    assert [float(line.split(",")[6]) for line in rows[1]] == pytest.approx(expected[::steps], rel=1e-12)
    saved = ckpt.load(tmp_path / ckpt.FILE)["optimizer"]["param_groups"][0]["lr"]
    assert saved == pytest.approx(twin.param_groups[0]["lr"], rel=1e-12)


def test_applying_twice_before_restoring_scales_the_scheduled_rate_once():
    """(The loop's step callback also runs when a non-finite step is replayed to name its layer.)"""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.4)
    warmup = Warmup(epochs=1, start_factor=0.25)
    warmup.apply(optimizer, 0, steps=4)
    warmup.apply(optimizer, 0, steps=4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    warmup.restore(optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.4
