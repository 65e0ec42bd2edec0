"""A sample of the matrix (``python -m tools.matrix`` runs it whole and writes docs/matrix.md): every
method in the own loop; each workflow with the methods that need what it must give them (the labels
before the forward, a clean batch beside the mix, a partner batch, class counts, a ViT's grid through a
wrapper); the app's shipped configs that the default data could not take before. The distributed cells of
a sample (DDP, FSDP2, a momentum copy attached before FSDP) run in tests/e2e/test_distributed.py, in the
launch its other data-parallel scenarios share."""

import pytest

from harness.matrix.cells import run
from tools.matrix import BY_NAME, ROWS


@pytest.mark.parametrize("method", [m.name for m in ROWS])
def test_every_method_trains_the_same_twice_in_the_hand_loop(method):
    """The hand loop every other cell is compared with: deterministic on its draws, for every method (and
    every hook with a loss of its own)."""
    cell = run(BY_NAME[method], "own")
    assert cell.outcome == "exact", cell.line()


SAMPLE = [
    ("Balanced-MixUp", "lightning", "exact"),  # a partner batch from the training set
    ("Remix", "lightning", "exact"),  # class counts from the training set
    ("SnapMix", "lightning", "exact"),  # the labels before the forward
    ("TransMix", "lightning", "exact"),  # a ViT held by the LightningModule states its grid
    ("PuzzleMix", "hf", "exact"),  # the labels the Trainer takes out, and a lam per sample
    ("RegMixup", "hf", "exact"),  # the clean batch's 2B rows
    ("CMixup", "hf", "exact"),  # regression targets, the partners drawn from them
    ("AutoMix", "hf", "exact"),  # its Mix Block joins the Trainer's optimizer and schedule
    ("Balanced-MixUp", "hf", "exact"),  # a partner batch appended to the keyword input (pixel_values=)
    ("SaliencyPairing", "timm", "exact"),  # a policy's gradient pass in timm's step
    ("MixPro", "timm", "exact"),
    ("ManifoldMixup", "trl", "exact"),
    ("RegMixup", "trl", "refused"),  # TRL's token metrics read B rows
    ("SFTMix", "hf", "exact"),  # its loss's mixin, the paired batches, the hook in a HookCallback
    ("SFTMix", "trl", "exact"),
    ("NoiseFiT", "trl", "exact"),  # three forwards a micro-batch
    ("RandomErasing", "lightning", "exact"),  # a HookCallback beside the MixupCallback, erased then mixed
    ("Cutout", "hf", "exact"),  # the Trainer's HookCallback, at the wrapper's keyword input
    ("RandomErasing", "timm", "exact"),  # attached by hand beside MixupFn, its own stream
]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "workflow", "expected"), SAMPLE, ids=[f"{m}-{w}" for m, w, _ in SAMPLE])
def test_each_workflow_gives_the_methods_what_they_need(method, workflow, expected):
    cell = run(BY_NAME[method], workflow)
    assert cell.outcome == expected, cell.line()
    if expected == "refused":
        assert "\n" not in cell.detail and len(cell.detail) > 40


@pytest.mark.slow
@pytest.mark.parametrize("method", ["PuzzleMix", "TransMix", "CMixup"])
def test_the_shipped_configs_the_default_data_could_not_take_train_or_name_the_command_that_does(method):
    cell = run(BY_NAME[method], "app")
    assert cell.outcome == "trains", cell.line()
    where = " ".join(BY_NAME[method].where)
    if where:  # refused on digits' PreActResNet in one line naming the overrides, then run with them
        assert cell.detail.startswith("error: ") and cell.detail.count(where) == 2, cell.detail


@pytest.mark.process
@pytest.mark.slow
def test_a_method_killed_and_resumed_in_the_app_ends_identical():
    cell = run(BY_NAME["Balanced-MixUp"], "resume")  # its partner stream resumes too
    assert cell.outcome == "exact", cell.line()


def test_the_committed_table_has_every_method_and_no_failing_cell():
    from tools.matrix import ROOT

    table = (ROOT / "docs" / "matrix.md").read_text()
    for method in ROWS:
        assert f"| `{method.name}` |" in table, method.name
    assert "| fails" not in table and ", 0 fails**" in table


def test_every_mixer_and_policy_has_a_row():
    import mixhook.mixers
    import mixhook.policies
    from mixhook.engine.contract import members

    made = [m.make("") for m in ROWS if m.kind != "lm"]
    mixers = {type(h).__name__ for hook in made for h in members(hook)}
    assert set(mixhook.mixers.METHODS) <= mixers, set(mixhook.mixers.METHODS) - mixers
    policies = {type(p).__name__ for hook in made for h in members(hook) for p in getattr(h, "policies", ())}
    shipped = {n for n in mixhook.policies.__all__ if isinstance(getattr(mixhook.policies, n), type)}
    shipped -= {"Policy"}
    assert shipped - {"PartnerBatch"} <= policies, shipped - policies  # (BalancedMixup is a PartnerBatch)


def test_every_hook_with_a_loss_of_its_own_has_a_row_from_its_card():
    """A hook that trains with a loss of its own (``hook.loss(model, inputs)``) states its matrix example,
    and the Trainer mixins its card names exist: a new one is in the matrix with its module."""
    import mixhook
    from mixhook.engine.card import HOOKS
    from mixhook.integrations import lm as adapter

    for name in mixhook.__all__:  # (every hook exported, each module's card registered)
        getattr(mixhook, name)
    with_loss = {n for n, cls in HOOKS.items() if callable(getattr(cls, "loss", None))}
    assert with_loss >= {"NoiseFiT", "SFTMix"}
    assert with_loss == {m.name for m in ROWS if m.kind == "lm"}
    for name in with_loss:
        assert HOOKS[name].card.trainer and all(hasattr(adapter, t) for t in HOOKS[name].card.trainer)
