"""mixhook.integrations.timm.LayerMixup: timm's ``mixup_fn`` at named layers, run through timm's own
training step (``timm.task.ClassificationTask`` with its soft-target criterion), against hand-written
hooks and timm's own ``mixup_target`` on the same draws; timm's ``Mixup`` at the input on the same lam and
box; resume, ``mixup_enabled`` and what is refused."""

import copy

import pytest
import torch

from mixhook import ManifoldMixup, UnknownLayerError
from mixhook.integrations.timm import LayerMixup
from tests.helpers import Lazy

timm = Lazy("timm")  # each imported when a test first uses it, not at collection
timm_task = Lazy("timm.task")
timm_mixup = Lazy("timm.data.mixup")

ARGS = {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 0.5, "label_smoothing": 0.1, "num_classes": 5}


def tiny_resnet():
    torch.manual_seed(0)
    return timm.create_model("resnet10t", pretrained=False, num_classes=5).double().train()


def _hand_hook(last):
    """The mix ``last`` records, written by hand: the blend or the paste with the flipped batch."""

    def hook(module, args, h):
        flipped = h.flip(0)
        if "box" not in last.info:
            return float(last.lam) * h + (1 - float(last.lam)) * flipped
        y1, y2, x1, x2 = last.info["box"]
        out = h.clone()
        out[:, :, y1:y2, x1:x2] = flipped[:, :, y1:y2, x1:x2]
        return out

    return hook


@pytest.mark.slow
def test_timms_training_step_mixes_at_the_layers_with_its_soft_targets_exactly():
    """Each step of timm's ClassificationTask (soft-target cross-entropy) with LayerMixup at layer1/layer2
    equals a hand-hooked twin trained on timm's own mixup_target of the same lam and pairing: the
    targets bit for bit, the loss and every gradient; mixup and CutMix, both layers, each drawn."""
    model = tiny_resnet()
    twin = copy.deepcopy(model)
    mixup_fn = LayerMixup(
        model, layer=["layer1", "layer2"], generator=torch.Generator().manual_seed(0), **ARGS
    )
    task = timm_task.ClassificationTask(model, criterion_kwargs={"soft_targets": True}, verbose=False)
    twin_task = timm_task.ClassificationTask(twin, criterion_kwargs={"soft_targets": True}, verbose=False)
    x = torch.randn(6, 3, 32, 32, dtype=torch.double)
    y = torch.tensor([0, 1, 2, 3, 4, 0])
    seen = set()
    for _ in range(10):
        model.zero_grad(), twin.zero_grad()
        input, target = mixup_fn(x, y)  # timm's train.py, train_one_epoch: the mixup_fn call and the step
        result = task(input, target)
        result["loss"].backward()
        last = mixup_fn.last
        seen.add((last.layer, "box" in last.info))
        expected = timm_mixup.mixup_target(y, 5, float(last.lam), 0.1)
        assert torch.equal(target.double(), expected.double())
        handle = twin.get_submodule(last.layer).register_forward_hook(_hand_hook(last))
        twin_result = twin_task(x, expected)
        twin_result["loss"].backward()
        handle.remove()
        torch.testing.assert_close(result["loss"], twin_result["loss"], rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert seen == {(layer, cut) for layer in ("layer1", "layer2") for cut in (False, True)}


@pytest.mark.parametrize("cutmix", [False, True])
def test_at_the_input_it_mixes_as_timms_mixup_on_the_same_lam_and_box(cutmix):
    """timm's Mixup._mix_batch on the same lam (and box): the same input the model sees, the same
    targets (timm.data.mixup.mixup_target, bit for bit)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 5))
    alphas = (
        {"mixup_alpha": 0.0, "cutmix_alpha": 1.0} if cutmix else {"mixup_alpha": 1.0, "cutmix_alpha": 0.0}
    )
    mixup_fn = LayerMixup(model, layer="input", label_smoothing=0.1, num_classes=5, **alphas)
    seen = {}
    model[0].register_forward_hook(lambda m, a, out: seen.update(x=out.clone()))
    x, y = torch.randn(4, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3])
    model.double()
    for _ in range(3):
        _, target = mixup_fn(x, y)
        model(x)
        lam = float(mixup_fn.last.lam)
        expected = x.clone()  # timm.data.mixup.Mixup._mix_batch
        if cutmix:
            yl, yh, xl, xh = mixup_fn.last.info["box"]
            expected[:, :, yl:yh, xl:xh] = expected.flip(0)[:, :, yl:yh, xl:xh]
            assert lam == 1 - (yh - yl) * (xh - xl) / 64  # timm's correct_lam
        else:
            x_flipped = expected.flip(0).mul_(1.0 - lam)
            expected.mul_(lam).add_(x_flipped)
        torch.testing.assert_close(seen["x"], expected, rtol=0, atol=1e-15)
        assert torch.equal(target, timm_mixup.mixup_target(y, 5, lam, 0.1))


def test_mixup_enabled_prob_and_a_resumed_run():
    model = tiny_resnet()
    mixup_fn = LayerMixup(model, layer="layer2", prob=0.5, generator=torch.Generator().manual_seed(1), **ARGS)
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.double), torch.tensor([0, 1, 2, 3])
    draws = []
    for _ in range(8):
        _, target = mixup_fn(x, y)
        model(x)
        last = mixup_fn.last
        draws.append(None if last is None else (last.layer, float(last.lam)))
        if last is None:  # not mixed: the smoothed labels, and the forward was not mixed
            assert torch.equal(target, timm_mixup.mixup_target(y, 5, 1.0, 0.1))
    assert None in draws and any(d is not None for d in draws)  # prob=0.5 did both
    state = mixup_fn.state_dict()
    later = []
    for _ in range(4):
        mixup_fn(x, y), model(x)
        later.append(None if mixup_fn.last is None else float(mixup_fn.last.lam))
    mixup_fn.remove()
    resumed = LayerMixup(model, layer="layer2", prob=0.5, **ARGS)
    resumed.load_state_dict(state)
    again = []
    for _ in range(4):
        resumed(x, y), model(x)
        again.append(None if resumed.last is None else float(resumed.last.lam))
    assert again == later
    resumed.mixup_enabled = False  # what train.py sets at mixup_off_epoch
    _, target = resumed(x, y)
    model(x)
    assert resumed.last is None and torch.equal(target, timm_mixup.mixup_target(y, 5, 1.0, 0.1))


@pytest.mark.slow
def test_a_wrapped_model_is_looked_through():
    model = tiny_resnet()
    mixup_fn = LayerMixup(torch.compile(model), layer="layer1", **ARGS)  # (not compiled until called)
    assert mixup_fn.model is model


def test_what_is_refused_in_one_line():
    model = tiny_resnet()
    x, y = torch.randn(4, 3, 32, 32, dtype=torch.double), torch.tensor([0, 1, 2, 3])
    mixup_fn = LayerMixup(model, layer="layer1", **ARGS)
    mixup_fn(x, y)
    with pytest.raises(RuntimeError, match="called again before a training forward used its last mix"):
        mixup_fn(x, y)
    mixup_fn(x, y), model(x)  # after the refusal it goes on
    with pytest.raises(RuntimeError, match="already has a mixing regularizer"):
        ManifoldMixup("layer2").attach(model)  # the adapter's and one by hand would both mix
    mixup_fn.remove()
    for kwargs, message in [
        ({"cutmix_minmax": (0.2, 0.8)}, "cutmix_minmax"),
        ({"mode": "elem"}, "mode='elem'"),
        ({"correct_lam": False}, "correct_lam=False"),
        ({"pairing": "odd"}, "pairing must be one of flip, random"),
        ({"mixup_alpha": 0.0, "cutmix_alpha": 0.0}, "one of mixup_alpha and cutmix_alpha"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            LayerMixup(model, layer="layer1", **{**ARGS, **kwargs})
        assert "\n" not in str(err.value)
    with pytest.raises(UnknownLayerError, match="nosuch"):
        LayerMixup(model, layer="nosuch", **ARGS)


@pytest.mark.parametrize("method", ["snapmix", "puzzlemix", "regmixup", "saliencymix"])
def test_any_method_in_timms_step_trains_as_the_hand_loop(method):
    """MixupFn in timm's training step (ClassificationTask with the label-smoothing criterion timm's
    script builds, wrapped by mixup_fn.loss): every gradient equals a hand loop's, which gives the mixer
    the labels and takes the per-sample criterion's mean under the mix, on the same draws."""
    from mixhook import PuzzleMix, RegMixup, SaliencyMix, SnapMix
    from mixhook.integrations.timm import MixupFn

    make = {
        "snapmix": lambda: SnapMix("input", features="layer4", classifier="fc"),
        "puzzlemix": lambda: PuzzleMix("layer1", grids="auto", saliency="activation"),
        "regmixup": lambda: RegMixup("layer2", alpha=1.0),
        "saliencymix": lambda: SaliencyMix("layer1", saliency="gradient"),
    }[method]
    model = tiny_resnet()
    twin = copy.deepcopy(model)
    mixer, hand = make(), make()
    hand.generator.set_state(mixer.generator.get_state())
    from timm.loss import LabelSmoothingCrossEntropy

    smoothing = LabelSmoothingCrossEntropy(smoothing=0.1)
    mixup_fn = MixupFn(model, mixer)
    task = timm_task.ClassificationTask(model, criterion=mixup_fn.loss(smoothing), verbose=False)
    x, y = torch.randn(6, 3, 32, 32, dtype=torch.double), torch.tensor([0, 1, 2, 3, 4, 0])
    per_sample = torch.nn.CrossEntropyLoss(reduction="none", label_smoothing=0.1)
    with hand.attach(twin):
        for _ in range(2):
            model.zero_grad(), twin.zero_grad()
            input, target = mixup_fn(x, y)  # timm's train_one_epoch
            assert input is x and target is y
            task(input, target)["loss"].backward()
            hand.use_targets(y)
            hand.loss(per_sample, twin(x), y).mean().backward()
            assert mixer.last is not None
            for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=name)
    model.eval()  # validation: the plain criterion, nothing mixed
    torch.testing.assert_close(mixup_fn.loss(smoothing)(model(x), y), smoothing(model(x), y))
    mixup_fn.mixup_enabled = False  # timm's mixup_off_epoch
    model.train()
    mixup_fn(x, y)
    model(x)
    assert mixer.last is None
    with pytest.raises(RuntimeError, match="called again before a training forward"):
        mixup_fn(x, y), mixup_fn(x, y)
    from mixhook import ManifoldMixup as MM
    from mixhook.policies import BalancedMixup

    with pytest.raises(ValueError, match="mixes with a second batch"):
        MixupFn(tiny_resnet(), MM("layer1").use(BalancedMixup()))


def test_the_label_smoothing_nobody_passed_is_timms_and_said_in_the_repr():
    """timm's ``Mixup`` smooths by 0.1 by default and so does LayerMixup: a user who never passed
    ``label_smoothing`` reads it in the repr, gets timm's smoothed targets, and 0.0 gives hard ones."""
    model = tiny_resnet()
    y = torch.tensor([0, 1, 2, 3])
    default = LayerMixup(model, layer="layer1", prob=0.0, num_classes=5)
    assert (
        "label_smoothing=0.1" in repr(default) and "label_smoothing=0.1" in LayerMixup.__doc__.splitlines()[0]
    )
    _, soft = default(torch.randn(4, 3, 32, 32, dtype=torch.double), y)
    assert torch.allclose(soft, timm_mixup.mixup_target(y, 5, lam=1.0, smoothing=0.1).to(soft))
    default.remove()
    hard = LayerMixup(model, layer="layer1", prob=0.0, num_classes=5, label_smoothing=0.0)
    _, soft = hard(torch.randn(4, 3, 32, 32, dtype=torch.double), y)
    assert "label_smoothing=0.0" in repr(hard) and torch.equal(soft, torch.eye(5, dtype=soft.dtype)[y])
