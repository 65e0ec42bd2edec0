"""The model zoo in the suite (``harness/zoo``): real timm, torchvision and HuggingFace models built small,
mixed at sampled layers, each case judged by an oracle mixhook does not compute (the hand edit, lam 0 and
1 against the unhooked model, padding on the unmixed sequence, eval mode). No case may be a wrong result
or an error; ``python -m tools.zoo`` runs the whole zoo and writes docs/zoo.md.

The quick tier checks the models marked ``quick`` (channels-last maps and windows, a model-level format,
padding in an encoder and in encoder-decoders) at two layers; the full suite also a broad sample
(tests/e2e/test_zoo_sample.py)."""

import pytest

from harness.zoo.catalogue import ZOO
from harness.zoo.oracles import run_model

QUICK = [m.name for m in ZOO if m.quick]
HEAVY = {"timm/maxvit_pico_rw_256", "timm/mambaout_femto"}  # over 6 s each: in the full suite only


def check(name: str, layers: int, seed: int) -> None:
    entry = next(m for m in ZOO if m.name == name)
    cases = run_model(entry, layers, seed=seed)
    bad = [
        f"{c.layer} ({c.method}): {c.outcome}: {c.detail}" for c in cases if c.outcome in ("wrong", "error")
    ]
    assert not bad, f"{name}: " + "; ".join(bad)
    assert any(c.outcome == "exact" and c.method != "eval" for c in cases), f"{name}: no case ran: {cases}"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in QUICK]
)
def test_a_quick_sample_of_the_zoo_is_exact_or_refused(name):
    check(name, layers=2, seed=1)


@pytest.mark.slow
def test_the_zoo_command_writes_its_report(tmp_path, capsys):
    from tools.zoo import main  # (python -m tools.zoo, in this process)

    out = tmp_path / "zoo.md"
    assert main(["--models", "huggingface/bart", "--layers", "1", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("[1/1] huggingface/bart: 3 exact")
    report = out.read_text()
    assert "| huggingface | 3 | 0 | 0 | 0 | 0 | 3 |" in report and "## Wrong results\n\nNone." in report


def test_the_zoo_command_refuses_a_pattern_that_matches_no_model(capsys):
    from tools.zoo import main

    assert main(["--models", "nosuch/*"]) == 2
    assert "no model matches ['nosuch/*']" in capsys.readouterr().err


PORTABLE_QUICK = ["torchvision/resnet18", "huggingface/t5"]
PORTABLE_SAMPLE = [
    "timm/resnet18", "timm/efficientnet_b0", "timm/convnext_atto", "timm/vit_tiny_patch16_224",
    "timm/hiera_tiny_224", "timm/swin_tiny_patch4_window7_224", "timm/twins_svt_small",
    "torchvision/mobilenet_v3_small", "torchvision/swin", "torchvision/maxvit", "torchvision/densenet121",
    "huggingface/llama", "huggingface/bart", "huggingface/convnext", "huggingface/albert",
]  # fmt: skip


@pytest.mark.slow  # (3 s a model)
@pytest.mark.parametrize("name", [*PORTABLE_QUICK, *PORTABLE_SAMPLE])
def test_portable_specs_resolve_to_what_the_model_states_or_are_refused(name):
    """stage:k at the stated reduction and channels on a real forward, block:k in forward order (a timm
    ViT's against forward_intermediates), Manifold Mixup at depth:0.5 as the hand edit at its real name;
    ``python -m tools.zoo --portable`` runs every model (docs/zoo-portable.md)."""
    from harness.zoo.portable import check

    what, problems = check(next(m for m in ZOO if m.name == name))
    assert not problems, f"{name} ({what}): " + "; ".join(problems)


AUTOMIX_SAMPLE = ["torchvision/resnet18", "timm/swin_tiny_patch4_window7_224"]


@pytest.mark.slow
@pytest.mark.parametrize("name", AUTOMIX_SAMPLE)
def test_automix_at_sampled_layers_is_the_hand_edit_with_its_mask_or_refused(name):
    """The zoo's AutoMix oracle (``python -m tools.zoo --methods automix`` runs every model,
    docs/zoo-automix.md) on NCHW stages and on a Swin's (B, H, W, C) stages."""
    entry = next(m for m in ZOO if m.name == name)
    cases = run_model(entry, 2, methods=("automix",), seed=1)  # (Swin: a (B, H, W, C) stage, an MLP)
    bad = [f"{c.layer}: {c.outcome}: {c.detail}" for c in cases if c.outcome in ("wrong", "error")]
    assert not bad, f"{name}: " + "; ".join(bad)
    assert any(c.outcome == "exact" and c.method == "automix" for c in cases), cases
