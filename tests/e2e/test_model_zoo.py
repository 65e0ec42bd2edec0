"""Mixing at a middle block of torchvision's classifiers, a vision transformer's token outputs included:
the hooked forward blends exactly as the formula says, and gradients reach every parameter."""

import pytest
import torch
import torch.nn.functional as F

from mixhook import ManifoldMixup
from mixhook.app.models import torchvision_model

ZOO = [
    ("resnet18", "layer2", {}),
    ("resnet50", "layer2", {}),
    ("wide_resnet50_2", "layer2", {}),
    ("mobilenet_v3_small", "features.6", {}),
    ("efficientnet_b0", "features.4", {}),
    ("vit_b_16", "encoder.layers.encoder_layer_5", {"image_size": 32}),  # 2x2 patches + class token
]


@pytest.mark.parametrize(("name", "layer", "options"), ZOO, ids=[z[0] for z in ZOO])
def test_mixing_a_middle_block_matches_the_formula(name, layer, options):
    torch.manual_seed(0)
    model = torchvision_model(name, in_channels=3, num_classes=10, **options).train()
    module = model.get_submodule(layer)
    seen = {}
    module.register_forward_hook(lambda m, a, out: seen.__setitem__("raw", out.detach().clone()) or None)
    mixer = ManifoldMixup(layer)
    with mixer.attach(model):
        module.register_forward_hook(
            lambda m, a, out: seen.__setitem__("mixed", out.detach().clone()) or None
        )
        index = [2, 3, 0, 1]
        mixer.pin(lam=0.3, index=index)
        logits = model(torch.randn(4, 3, 32, 32))
        loss = mixer.loss(F.cross_entropy, logits, torch.tensor([0, 1, 2, 3]))
        loss.backward()
    raw, mixed = seen["raw"], seen["mixed"]
    assert raw.shape[0] == 4 and (raw.ndim == 3 if name.startswith("vit") else raw.ndim == 4)
    torch.testing.assert_close(mixed, 0.3 * raw + 0.7 * raw[index], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_a_users_own_model_with_its_own_arguments_through_target(tmp_path):
    import json

    from harness.app_runs import config
    from mixhook.app import run as app

    cfg = config(
        "model._target_=tests.toy_models.TinyConvNet", "+model.width=12", "mixup.layer=conv2",
        "allow_targets=[tests.toy_models.*]",
        "trainer.epochs=1", "data.train_size=100", "trainer.progress_bar=false",
    )  # fmt: skip
    run = app.build(cfg)
    assert run.model.conv2.out_channels == 12 and run.model.conv1.in_channels == 1
    for handle in run.handles:
        handle.remove()
    app.main(cfg, out_dir=str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["model"] == {"_target_": "tests.toy_models.TinyConvNet", "width": 12}


@pytest.mark.slow
def test_a_torchvision_vit_trains_in_the_app_on_cifar_sized_images(tmp_path):
    from harness.app_runs import config
    from mixhook.app import run as app
    from tests.conftest import write_cifar

    write_cifar(tmp_path / "cifar", "cifar10", per_file=2)
    cfg = config(
        "data=cifar10", f"data.root={tmp_path / 'cifar'}", "data.num_workers=0", "model=torchvision",
        "model.name=vit_b_16", "+model.image_size=32", "mixup.layer=[input,encoder.layers.encoder_layer_5]",
        "trainer.epochs=1", "trainer.batch_size=4", "trainer.progress_bar=false",
    )  # fmt: skip
    assert 0.0 <= app.main(cfg, out_dir=str(tmp_path / "run")) <= 1.0
