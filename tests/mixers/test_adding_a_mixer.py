"""docs/adding-a-mixer.md, done as a contributor does it: each of its examples (``# mixhook/mixers/<x>.py``)
written as a module of its own and imported, with no other file edited; the catalogue's table and
section, the API page, the app's ``mixup=`` group, the matrix and the gallery pick the method up from its
card, and it trains in the matrix's hand loop and in Lightning as the hand loop does."""

import importlib.util
import re
import sys

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate

from mixhook.engine.card import METHODS, unregister
from tests.helpers import ROOT

DOC = ROOT / "docs" / "adding-a-mixer.md"


def examples() -> dict[str, str]:
    """The page's modules, by file name: every Python block whose first line names one."""
    blocks = re.findall(r"```python\n(# mixhook/mixers/(\w+)\.py\n.*?)```", DOC.read_text(), re.S)
    return {name: code for code, name in blocks}


def test_the_page_shows_a_plain_and_a_region_method():
    assert set(examples()) == {"channelswap", "bandmix"}


@pytest.fixture(params=["channelswap", "bandmix"])
def added(request, tmp_path):
    """The example ``request.param`` imported from a module of its own (as ``mixhook.mixers`` imports a
    new file), the app's group told as when it is imported; everything it added taken out after."""
    name = request.param
    path = tmp_path / f"{name}_from_docs.py"
    path.write_text(examples()[name])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
        (cls,) = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == path.stem]
        from mixhook.app import schema

        schema.register()  # what importing the app does: a method defined since joins the group
        yield cls
    finally:
        for defined in [n for n, c in METHODS.items() if c.__module__ == path.stem]:
            unregister(defined)
        ConfigStore.instance().repo.get("mixup", {}).pop(f"{name}.yaml", None)
        sys.modules.pop(path.stem, None)


def test_the_registries_read_a_new_method_from_its_card(added):
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        import generated
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    name, card = added.__name__, added.card
    assert METHODS[name] is added
    table = generated.method_table()
    assert f"| [`{name}`](#{name.lower()}) | {card.paper} | {card.mixes} |" in table
    assert f"`mixup={name.lower()}`" not in table and f"`{name.lower()}`" in table
    sections = generated.method_sections()
    assert f"### {name}\n\n`{card.signature}`: {card.hook}." in sections
    assert f"![{name}](/gallery/{name}.png)" in sections
    assert f".. autoclass:: {added.__module__}.{name}\n   :exclude-members: card\n" in generated.api_methods()


def test_the_gallery_draws_it(added):
    """Its picture's two panels: the mixed image at the input and the own-content weights on the hidden
    map (BandMix's band of rows: 0 inside it, 1 outside)."""
    spec = importlib.util.spec_from_file_location("gallery", ROOT / "docs" / "gallery.py")
    gallery = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gallery)
    drawn = gallery.draw(added.__name__)
    assert drawn["mixed"].shape == (3, gallery.SIZE, gallery.SIZE)
    assert not torch.equal(drawn["mixed"], drawn["images"][0].clamp(0, 1))  # image 0 was mixed
    weights = drawn["weights"]
    if added.__name__ == "BandMix":
        assert set(weights.unique().tolist()) == {0.0, 1.0} and (weights == weights[:, :1]).all()


def test_the_apps_group_composes_it_from_its_defaults(added):
    with initialize_config_module("mixhook.app.conf", version_base=None):
        cfg = compose("config", overrides=[f"mixup={added.__name__.lower()}", "mixup.layer=layer2"])
    assert cfg.mixup._target_ == f"{added.__module__}.{added.__name__}"
    made = instantiate(cfg.mixup)
    assert type(made) is added and tuple(made.layers) == ("layer2",)
    with initialize_config_module("mixhook.app.conf", version_base=None):
        unset = compose("config", overrides=[f"mixup={added.__name__.lower()}"])
    assert unset.mixup._get_node("layer")._is_missing()  # a required argument: set on the command line


@pytest.mark.slow
def test_the_matrix_runs_it_in_the_hand_loop_and_in_lightning(added):
    from harness.matrix.cells import run
    from harness.matrix.methods import methods

    (method,) = [m for m in methods() if m.name == added.__name__]
    assert method.app == added.__name__.lower()
    for workflow in ("own", "lightning"):
        cell = run(method, workflow)
        assert cell.outcome == "exact", cell.line()


def test_the_example_mixes_as_a_hand_edited_forward(added):
    """The examples are methods, not only text: each at its card's layer, on a pinned draw, against the
    hand edit in float64 (ChannelSwap's odd channels; BandMix's rows 2 to 6 of 8)."""
    from harness.matrix.methods import data, model

    net = model(added.card.shown_on)
    x, _ = data(added.card.shown_on, n=4)
    index = torch.tensor([1, 2, 3, 0])
    mixer = added(added.card.example["layer"], generator=torch.Generator().manual_seed(0))
    pins = {"offset": 1} if added.__name__ == "ChannelSwap" else {"rows": (2, 6)}
    with mixer.attach(net):
        mixer.pin(index=index, lam=torch.tensor(0.5, dtype=torch.float64), **pins)
        out = net(x)
    if added.__name__ == "ChannelSwap":
        h = torch.nn.functional.conv2d(x, net.conv1.weight, net.conv1.bias, padding=1)
        h = torch.where((torch.arange(4) % 2 == 1).view(1, -1, 1, 1), h[index], h)
        hand = net.fc(torch.nn.functional.relu(net.conv2(torch.nn.functional.relu(h))).mean((2, 3)))
        assert float(mixer.last.lam) == 0.5
    else:
        mixed = x.clone()
        mixed[:, :, 2:6] = x[index][:, :, 2:6]
        hand = net(mixed)
        assert float(mixer.last.lam) == 0.5
    torch.testing.assert_close(out, hand, rtol=0, atol=1e-12)
