"""Every hook that draws at random has ``state_dict()``/``load_state_dict()`` that a user's own checkpoint
can carry (through ``torch.save`` and ``torch.load(weights_only=True)``), so a resumed run continues the same
draws bit for bit; a state of another hook is refused in one line. Under ``torch.distributed`` a regularizer
with no generator of its own draws differently on each rank, one given a generator draws from it (checked
in a job of two processes by tests/e2e/test_distributed.py), and a state records its rank."""

import io

import pytest
import torch

from mixhook import (
    ActivationStats,
    CutMix,
    GradScale,
    InputScale,
    ManifoldMixup,
    MixSchedule,
    NoisyFeatureMixup,
    OneOf,
    Ramp,
    attach,
)
from mixhook.hooks import StateError
from tests.helpers import SmallCNN, gen


def build():
    return [
        OneOf(
            [ManifoldMixup(["input", "conv1"], generator=gen(1)), CutMix("conv2", generator=gen(2))],
            generator=gen(3),
        ),
        InputScale("conv2", (0.5, 1.5), generator=gen(4)),
        ActivationStats(["conv1"], every=2),
    ]


def run(model, hooks, x, steps):
    """``steps`` training forwards: what each mixed and scaled, and what the probe recorded."""
    seen = []
    with attach(model, *hooks):
        for _ in range(steps):
            logits = model(x)
            state = hooks[0].state_for(logits)
            seen.append(
                (
                    None if state is None else (state.layer, state.lam.tolist(), state.index.tolist()),
                    hooks[1].last,
                )
            )
    return seen, [(r["step"], r["layer"]) for r in hooks[2].rows()]


def test_a_run_resumed_from_the_hooks_state_dicts_continues_the_same_draws():
    torch.manual_seed(0)
    model = SmallCNN().train()
    x = torch.randn(4, 3, 6, 6)
    hooks = build()
    run(model, hooks, x, 3)  # the first part of the run
    buffer = io.BytesIO()
    torch.save([h.state_dict() for h in hooks], buffer)
    uninterrupted = run(model, hooks, x, 4)
    resumed_hooks = build()  # a new process: hooks built from the config, then their states loaded
    buffer.seek(0)
    for hook, state in zip(resumed_hooks, torch.load(buffer, weights_only=True), strict=True):
        hook.load_state_dict(state)
    resumed = run(model, resumed_hooks, x, 4)
    assert resumed[0][0][0] is not None or resumed[0][1][0] is not None
    for (a, scale_a), (b, scale_b) in zip(uninterrupted[0], resumed[0], strict=True):
        assert a == b and torch.equal(scale_a, scale_b)
    assert resumed[1] == uninterrupted[1]  # the probe records at the same steps (every=2)


def test_nfm_and_a_schedule_have_state_dicts():
    torch.manual_seed(0)
    model = SmallCNN().train()
    x = torch.randn(4, 3, 6, 6)
    mix = NoisyFeatureMixup("conv1", generator=gen(9))
    state = mix.state_dict()
    with mix.attach(model):
        first = model(x)
    again = NoisyFeatureMixup("conv1")
    again.load_state_dict(state)
    with again.attach(model):
        torch.testing.assert_close(model(x), first)  # the same mix and the same noise
    schedule = MixSchedule(mix, prob=Ramp(0.2, 1.0, epochs=3), off_epoch=5)
    MixSchedule(mix, prob=Ramp(0.2, 1.0, epochs=3), off_epoch=5).load_state_dict(schedule.state_dict())
    with pytest.raises(StateError, match="off_epoch=5.*off_epoch=6"):
        MixSchedule(mix, prob=Ramp(0.2, 1.0, epochs=3), off_epoch=6).load_state_dict(schedule.state_dict())


@pytest.mark.parametrize(
    "source, target, match",
    [
        (lambda: ManifoldMixup("conv1"), lambda: CutMix("conv1"), "a 'ManifoldMixup''s, not a CutMix's"),
        (
            lambda: CutMix("conv1"),
            lambda: CutMix("conv2"),
            r"for layers \['conv1'\], this CutMix has \['conv2'\]",
        ),
        (
            lambda: OneOf([ManifoldMixup("conv1"), CutMix("conv1")]),
            lambda: OneOf([CutMix("conv1"), ManifoldMixup("conv1")]),
            "for mixers",
        ),
        (lambda: GradScale("conv1", 2.0), lambda: InputScale("conv1", 2.0), "a 'GradScale''s"),
        (lambda: None, lambda: CutMix("conv1"), "needs the dict state_dict"),
        (lambda: InputScale("conv1", 2.0), lambda: ActivationStats("conv1"), "a 'InputScale''s"),
    ],
)
def test_a_state_of_another_hook_is_refused_in_one_line(source, target, match):
    made = source()
    state = made.state_dict() if made is not None else [1, 2]
    with pytest.raises(StateError, match=match) as err:
        target().load_state_dict(state)
    assert "\n" not in str(err.value)


def test_under_torch_distributed_a_state_records_its_rank_and_another_ranks_is_refused(tmp_path):
    """A checkpoint that keeps one copy of what every rank saved under one key (torch.distributed.checkpoint
    does, for a tensor that is not sharded) would hand one rank's stream to all: the state records the
    rank it was saved on, and loading another rank's is refused in one line, unless the loader reseeds
    every rank anyway (``without_rank``, as the Lightning adapter does)."""
    import torch.distributed as dist

    from mixhook.hooks import without_rank

    plain = ManifoldMixup("input").state_dict()
    assert "rank" not in plain  # not distributed: nothing to tell apart
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mix = ManifoldMixup("input", generator=torch.Generator().manual_seed(3))
        state = mix.state_dict()
        assert state["rank"] == 0
        mix.load_state_dict(state)
        mix.load_state_dict(plain)  # a state from no process group: any rank may load it
        theirs = {**state, "rank": 1}
        with pytest.raises(
            StateError,
            match=r"^ManifoldMixup.load_state_dict\(\): the state is rank 1's and "
            r"this process is rank 0: each rank draws from its own stream, so save each rank's",
        ):
            mix.load_state_dict(theirs)
        nested = OneOf([ManifoldMixup("input"), CutMix("input")]).state_dict()
        assert nested["rank"] == 0 and all(m["rank"] == 0 for m in nested["mixers"])
        ones = {**without_rank(nested), "rank": 1}
        with pytest.raises(StateError, match="the state is rank 1's"):
            OneOf([ManifoldMixup("input"), CutMix("input")]).load_state_dict(ones)
        OneOf([ManifoldMixup("input"), CutMix("input")]).load_state_dict(without_rank(ones))
        stripped = without_rank(nested)
        assert "rank" not in stripped and all("rank" not in m for m in stripped["mixers"])
    finally:
        dist.destroy_process_group()


def test_lam_is_carried_once_a_copy_with_another_lam_weighs_by_its_own():
    """Issue 83: a state's ``weight`` (what loss() weighs by: one CPU lam as a float) is derived from its own
    lam, made with it by the path; a copy with another lam (``dataclasses.replace``, as a policy re-weighs a
    mix) weighs by that lam, never by the float of the lam it was copied from."""
    import dataclasses

    import torch.nn.functional as F

    from mixhook import ManifoldMixup

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)).double().train()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    mix = ManifoldMixup("0", generator=torch.Generator().manual_seed(1))
    with mix.attach(net):
        logits = net(x)
    state = mix.last
    assert state.weight == float(state.lam) and type(state.weight) is float
    other = dataclasses.replace(state, lam=torch.tensor(0.25, dtype=torch.float64))
    assert other.weight == 0.25
    own, partner = F.cross_entropy(logits, y), F.cross_entropy(logits, y[state.index])
    torch.testing.assert_close(mix.mixed_loss(F.cross_entropy, logits, y, other), 0.25 * own + 0.75 * partner)
