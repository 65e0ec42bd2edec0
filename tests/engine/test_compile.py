"""torch.compile with mixhook's hooks: no recompiles after warm-up, and the hook-guard pitfall is caught.

Dynamo's own tracing and guards are what is tested; the "eager" backend runs the captured graphs
without code generation, so these tests take seconds.
"""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from mixhook import ManifoldMixup
from mixhook.engine.card import METHODS, build, methods_with, traits_of
from tests.helpers import SmallCNN

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # (tests/conftest.py)


def test_compiled_training_with_three_layers_stops_compiling_after_warm_up():
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = SmallCNN().train()
    mix = ManifoldMixup(["input", "conv1", "conv2"], generator=torch.Generator().manual_seed(0))
    mix.attach(model)
    compiled = torch.compile(model, backend=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    counts, layers, lams = [], set(), set()
    # no frame recompiled up to dynamo's limit (a traced append to the list of recent forwards did: a
    # recompile per forward until dynamo gave up on that frame and ran it eagerly)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(30):
            loss = mix.loss(F.cross_entropy, compiled(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            counts.append(len(graphs))
            layers.add(mix.last.layer)
            lams.add(float(mix.last.lam))
    assert layers == {"input", "conv1", "conv2"} and len(lams) == 30
    assert counts[-1] == counts[9] > 0  # nothing compiled after the first 10 steps
    mix.remove()


@pytest.mark.slow
def test_a_hooked_twin_of_a_compiled_model_is_caught_not_silently_unmixed():
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(0)
    plain, hooked = SmallCNN().train(), SmallCNN().train()
    torch.compile(plain, backend="eager")(x)  # compiled first, without hooks
    mix = ManifoldMixup("conv2")
    with mix.attach(hooked):
        # refused before a loss is taken: the traced path checks when it next runs on the host (the loss,
        # or the next forward), the path between graphs at the forward's end
        with pytest.raises(RuntimeError, match="skip_nnmodule_hook_guards = False"):
            mix.loss(F.cross_entropy, torch.compile(hooked, backend="eager")(x), torch.zeros(4).long())
        torch._dynamo.reset()
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):  # set before compiling either
            torch.compile(plain, backend="eager")(x)
            torch.compile(hooked, backend="eager")(x)
        assert mix.last is not None and mix.last.layer == "conv2"


def _every_hook():
    from mixhook import (
        ActivationStats,
        AugMix,
        CutMix,
        Cutout,
        FeatureRecorder,
        GradClip,
        GradScale,
        GradStats,
        InputScale,
        NoisyFeatureMixup,
        PatchUp,
        PuzzleMix,
        RandomErasing,
        SaliencyMix,
        SnapMix,
    )

    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    by_hand = {  # (the methods that take more than a layer here)
        "method-PuzzleMix": lambda: PuzzleMix("conv1", grids=(2, 4), saliency="activation", generator=g()),
        "method-SnapMix": lambda: SnapMix("conv1", features="conv2", classifier="head", generator=g()),
        "method-AugMix": lambda: AugMix(
            mean=[0.5], std=[0.05], generator=g()
        ),  # (the input's N(0, 1) as pixels)
    }
    return {
        "manifold": lambda: ManifoldMixup(["input", "conv1", "conv2"], generator=g()),
        "cutmix": lambda: CutMix("conv1", generator=g()),
        "patchup": lambda: PatchUp("conv1", block_size=3, generator=g()),
        "nfm": lambda: NoisyFeatureMixup(["input", "conv2"], generator=g()),
        "input_scale": lambda: InputScale("conv2", factor=[0.5, 1.5], generator=g()),
        "grad_scale": lambda: GradScale("conv2", factor=-0.5),
        "random_erasing": lambda: RandomErasing(["input", "conv1"], p=0.7, generator=g()),
        "cutout": lambda: Cutout("conv1", size=3, holes=2, generator=g()),
        "grad_clip": lambda: GradClip("conv1", max_norm=0.01),
        "features": lambda: FeatureRecorder(["conv1", "conv2"]),
        "activations": lambda: ActivationStats(["conv1", "conv2"]),
        "gradients": lambda: GradStats(["conv1", "conv2"]),
        **{  # every method of the package at its defaults, so a new one is checked compiled too
            f"method-{name}": (lambda cls=cls: cls("conv1", generator=g()))
            for name, cls in METHODS.items()
            if cls.card.family not in ("composition", "learned")
            and "attention" not in traits_of(cls)
            and f"method-{name}" not in by_hand
        },  # (the methods that read a ViT's attention: below)
        **{  # (the learned methods read their features at conv2)
            f"method-{name}": (lambda name=name: METHODS[name]("conv1", features="conv2", generator=g()))
            for name in methods_with(family="learned")
        },
        **by_hand,
        "cutmix-elem": lambda: CutMix("conv1", mode="elem", generator=g()),
        "saliencymix-gradient": lambda: SaliencyMix(["input", "conv2"], saliency="gradient", generator=g()),
    }


def _compiled_cases() -> list:
    """Every hook of :func:`_every_hook`; those whose hooks run between graphs (their lam or mix follows
    the network's values: saliency, a host solver, a clean batch) are in the slow tier: dynamo traces each
    of their graph breaks' resumptions, seconds each."""
    cases = []
    for kind, make in _every_hook().items():
        between = not getattr(make(), "traceable", True)
        cases.append(pytest.param(kind, marks=pytest.mark.slow) if between else kind)
    return cases


@pytest.mark.parametrize("kind", _compiled_cases())
def test_every_regularizer_and_probe_computes_the_same_compiled(kind):
    """Attach, then compile: three training steps give the eager run's losses, gradients and records."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = SmallCNN().train()
        hook = _every_hook()[kind]()
        hook.attach(model)
        net = torch.compile(model, backend="eager") if compiled else model
        x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
        losses, grads = [], []
        for _ in range(3):
            model.zero_grad()
            if hasattr(hook, "use_targets"):  # for gradient saliency; C-Mixup pairs by regression labels
                hook.use_targets(y.double() if type(hook).__name__ == "CMixup" else y)
            logits = net(x)
            if hasattr(hook, "loss"):  # per sample: also for one lam per sample
                per_sample = hook.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y)
            else:
                per_sample = F.cross_entropy(logits, y, reduction="none")
            loss = per_sample.mean()
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in model.parameters()])
        records = hook.rows() if hasattr(hook, "rows") else getattr(hook, "features", None)
        hook.remove()
        results.append((losses, grads, records))
    (eager_losses, eager_grads, eager_records), (losses, grads, records) = results
    torch.testing.assert_close(losses, eager_losses)
    torch.testing.assert_close(grads, eager_grads)
    if isinstance(records, list):
        assert [(r["step"], r["layer"]) for r in records] == [(r["step"], r["layer"]) for r in eager_records]
        for a, b in zip(records, eager_records, strict=True):
            assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) for k in a if isinstance(a[k], float))
    elif isinstance(records, dict):
        torch.testing.assert_close(records, eager_records)


@pytest.mark.slow
@pytest.mark.parametrize("name", methods_with("attention"))
def test_attention_methods_on_a_vit_compute_the_same_compiled(name):
    """Every method that reads a ViT's attention (its card's trait), as its card's example on a timm ViT
    (the matrix's: ``blocks.1.attn``), attached then compiled: the eager run's label weights, losses and
    gradients (the attention read recomputes the qkv projection under no_grad; SMMix's and MergeMix's
    unmixed forward runs the compiled model once more)."""
    import timm

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = timm.create_model(
            "vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=16, patch_size=2, embed_dim=12,
            depth=2, num_heads=2,
        ).train()  # fmt: skip
        mix = build(METHODS[name], generator=torch.Generator().manual_seed(3))
        mix.attach(model)
        net = torch.compile(model, backend="eager") if compiled else model
        x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
        steps = []
        for _ in range(3):
            model.zero_grad()
            logits = net(x)
            loss = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y).mean()
            loss.backward()
            steps.append((mix.last.lam.clone(), loss.detach(), [p.grad.clone() for p in model.parameters()]))
        mix.remove()
        results.append(steps)
    for (lam, loss, grads), (lam_c, loss_c, grads_c) in zip(*results, strict=True):
        per_sample = name in ("TransMix", "TLA", "MixPro")  # (labels from each image's attention)
        assert lam.shape == ((6,) if per_sample else ())  # (else one lam: the patches kept)
        torch.testing.assert_close(lam_c, lam)
        torch.testing.assert_close(loss_c, loss)
        torch.testing.assert_close(grads_c, grads)
