"""The language-model hooks' room (issue 96): every module of the library's core is on docs/development.md's
map; in mixhook/lm/ no hook's module imports another's (what two share is tokens.py or protocol.py); no
docstring cites a file outside the repository; and the hooks with a loss of their own keep one contract,
``loss(model, inputs, counts=None) -> (loss, outputs)`` and a LossState as ``.last``."""

import ast
import re
from pathlib import Path

import pytest
import torch

import mixhook
from harness.language_models import tiny_llama
from mixhook import LossHook, LossState, NoiseFiT, SFTMix

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "mixhook"
SHARED = {"tokens", "protocol"}  # (what the room's hooks may import from one another's room)


def _core_map() -> str:
    doc = (ROOT / "docs" / "development.md").read_text()
    return doc[
        doc.index("mixhook/                the library core") : doc.index("mixhook/app/            the")
    ]


def test_every_module_of_the_core_is_on_the_development_map():
    """A module is named on the map by its file name (a method's module in mixers/ is one of "one module
    each"); a newcomer following a forward finds every hop there."""
    from mixhook.engine.card import METHODS

    text = _core_map()
    methods = {cls.__module__ for cls in METHODS.values()}
    missing = []
    for path in sorted(CORE.rglob("*.py")):
        relative = path.relative_to(CORE)
        if relative.parts[0] == "app" or path.name == "__init__.py":
            continue
        module = "mixhook." + ".".join(relative.with_suffix("").parts)
        if relative.parts[0] == "mixers" and module in methods:
            continue
        if not re.search(rf"(?<![\w./]){re.escape(path.name)}", text):
            missing.append(str(relative))
    assert not missing, f"not on docs/development.md's map: {missing}"


def test_no_hook_of_the_room_imports_from_another_hooks_module():
    for path in sorted((CORE / "lm").glob("*.py")):
        if path.name == "__init__.py":  # (the room's door: it exports each hook)
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                assert set(names) <= SHARED, f"{path.name} imports .{names}: put what it shares in tokens.py"


def test_the_cores_docstrings_cite_only_the_repository():
    cited = [
        str(p.relative_to(ROOT)) for p in CORE.rglob("*.py") if "shared/research" in p.read_text()
    ]  # fmt: skip
    assert not cited, cited


@pytest.mark.slow
def test_the_hooks_with_a_loss_of_their_own_keep_one_contract():
    """SFTMix and NoiseFiT are LossHooks: counts(labels) divide the sums of loss(model, inputs, counts),
    which returns (loss, outputs), and .last is a LossState of detached terms, draws and tokens."""
    from tests.lm.test_sftmix import batch

    inputs = batch(1)
    for hook in (
        SFTMix("model.norm", generator=torch.Generator().manual_seed(0)),
        NoiseFiT(["model.layers.0"], noise_std=0.5, generator=torch.Generator().manual_seed(0)),
    ):
        model = tiny_llama()
        assert isinstance(hook, LossHook) and hook.last is None
        with hook.attach(model):
            loss, outputs = hook.loss(model, inputs)
            counts = hook.counts(inputs["labels"])
            hook.generator.manual_seed(0)
            halved, _ = hook.loss(model, inputs, 2 * counts)
        assert isinstance(hook.last, LossState) and loss.ndim == 0 and outputs.logits.shape[0] == 4
        assert all(not t.requires_grad for t in hook.last.terms.values()) and hook.last.draws
        torch.testing.assert_close(halved, loss / 2, rtol=1e-6, atol=0)  # (NoiseFiT's CE: HF's, float32)
    assert {"LossHook", "LossState"} <= set(mixhook.__all__)
