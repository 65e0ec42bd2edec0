"""AugMix: its operations against the authors' PIL operations on 8-bit images, a view as the authors' `aug`
composes it (each image's own chains), the loss against the authors' lines and timm's JsdCrossEntropy on
the same views with gradients (float64), the draws, repeats, eval forwards and the refusals."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageEnhance, ImageOps

from mixhook import AugMix, imageops
from mixhook.mixers.augmix import ALL_OPERATIONS, OPERATIONS, jensen_shannon, operate
from mixhook.policies import Remix
from tests.helpers import SmallCNN

IMAGE_SIZE = 12


# From google-research/augmix (7c84885) augmentations.py: the nine operations of `augmentations`, with
# IMAGE_SIZE this test's images' side.
def int_parameter(level, maxval):
    return int(level * maxval / 10)


def float_parameter(level, maxval):
    return float(level) * maxval / 10.0


def sample_level(n):
    return np.random.uniform(low=0.1, high=n)


def autocontrast(pil_img, _):
    return ImageOps.autocontrast(pil_img)


def equalize(pil_img, _):
    return ImageOps.equalize(pil_img)


def posterize(pil_img, level):
    level = int_parameter(sample_level(level), 4)
    return ImageOps.posterize(pil_img, 4 - level)


def rotate(pil_img, level):
    degrees = int_parameter(sample_level(level), 30)
    if np.random.uniform() > 0.5:
        degrees = -degrees
    return pil_img.rotate(degrees, resample=Image.BILINEAR)


def solarize(pil_img, level):
    level = int_parameter(sample_level(level), 256)
    return ImageOps.solarize(pil_img, 256 - level)


def shear_x(pil_img, level):
    level = float_parameter(sample_level(level), 0.3)
    if np.random.uniform() > 0.5:
        level = -level
    return pil_img.transform(
        (IMAGE_SIZE, IMAGE_SIZE), Image.AFFINE, (1, level, 0, 0, 1, 0), resample=Image.BILINEAR
    )


def shear_y(pil_img, level):
    level = float_parameter(sample_level(level), 0.3)
    if np.random.uniform() > 0.5:
        level = -level
    return pil_img.transform(
        (IMAGE_SIZE, IMAGE_SIZE), Image.AFFINE, (1, 0, 0, level, 1, 0), resample=Image.BILINEAR
    )


def translate_x(pil_img, level):
    level = int_parameter(sample_level(level), IMAGE_SIZE / 3)
    if np.random.random() > 0.5:
        level = -level
    return pil_img.transform(
        (IMAGE_SIZE, IMAGE_SIZE), Image.AFFINE, (1, 0, level, 0, 1, 0), resample=Image.BILINEAR
    )


def translate_y(pil_img, level):
    level = int_parameter(sample_level(level), IMAGE_SIZE / 3)
    if np.random.random() > 0.5:
        level = -level
    return pil_img.transform(
        (IMAGE_SIZE, IMAGE_SIZE), Image.AFFINE, (1, 0, 0, 0, 1, level), resample=Image.BILINEAR
    )


# operation that overlaps with ImageNet-C's test set
def color(pil_img, level):
    level = float_parameter(sample_level(level), 1.8) + 0.1
    return ImageEnhance.Color(pil_img).enhance(level)


# operation that overlaps with ImageNet-C's test set
def contrast(pil_img, level):
    level = float_parameter(sample_level(level), 1.8) + 0.1
    return ImageEnhance.Contrast(pil_img).enhance(level)


# operation that overlaps with ImageNet-C's test set
def brightness(pil_img, level):
    level = float_parameter(sample_level(level), 1.8) + 0.1
    return ImageEnhance.Brightness(pil_img).enhance(level)


# operation that overlaps with ImageNet-C's test set
def sharpness(pil_img, level):
    level = float_parameter(sample_level(level), 1.8) + 0.1
    return ImageEnhance.Sharpness(pil_img).enhance(level)


augmentations = [
    autocontrast,
    equalize,
    posterize,
    rotate,
    solarize,
    shear_x,
    shear_y,
    translate_x,
    translate_y,
]
augmentations_all = [*augmentations, color, contrast, brightness, sharpness]


def as_codes(images: torch.Tensor) -> np.ndarray:
    return (images * 255).round().to(torch.int64).permute(0, 2, 3, 1).numpy()


def test_the_operations_are_the_authors_in_their_order_and_give_pils_pixels():
    """Each operation at the authors' drawn level and sign: the intensity ones and the translations equal
    PIL's codes, rotation and shear within one code (PIL rounds its bilinear sums on 8 bits)."""
    assert OPERATIONS == tuple(op.__name__ for op in augmentations)
    assert ALL_OPERATIONS == tuple(op.__name__ for op in augmentations_all)
    rng = np.random.default_rng(0)
    for trial in range(40):
        arr = (rng.random((IMAGE_SIZE, IMAGE_SIZE, 3)) ** rng.uniform(0.3, 3) * rng.uniform(60, 255)).astype(
            np.uint8
        )
        image = torch.from_numpy(arr).permute(2, 0, 1)[None].double() / 255
        for k, op in enumerate(augmentations_all):
            np.random.seed(trial)
            theirs = np.asarray(op(Image.fromarray(arr), 3)).astype(np.int64)
            np.random.seed(trial)
            level = sample_level(3) if k >= 2 else 1.0
            sign = -1.0 if 3 <= k <= 8 and np.random.uniform() > 0.5 else 1.0
            mine = operate(op.__name__, image, torch.tensor([level]), torch.tensor([sign]))
            diff = np.abs(as_codes(mine)[0] - theirs)
            assert diff.max() <= (1 if op.__name__ in ("rotate", "shear_x", "shear_y") else 0), op.__name__


@pytest.mark.parametrize("all_ops", [False, True])
def test_a_view_is_the_authors_aug_of_each_image_with_its_own_chains(all_ops):
    """Batched by operation, a view equals `(1 - m) * x + m * sum_i w_i * chain_i(x)` with every image's
    chains applied to it alone, one operation after another."""
    mix = AugMix(width=4, depth=-1, all_ops=all_ops)
    g = torch.Generator().manual_seed(3)
    u = imageops.to_8_bits(torch.rand(10, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64, generator=g))
    drawn = mix.draws(10, g)
    assert len(set(drawn["operations"][:, 0, 0].tolist())) > 2  # (each image draws its own)
    view = mix.view(u, drawn)
    for b in range(10):
        mixture = torch.zeros_like(u[b])
        for i in range(4):
            chain = u[b : b + 1]
            for step in range(int(drawn["depth"][b, i])):
                k = int(drawn["operations"][b, i, step])
                chain = operate(ALL_OPERATIONS[k], chain, drawn["levels"][b, i, step : step + 1],
                                drawn["signs"][b, i, step : step + 1])  # fmt: skip
            mixture = mixture + drawn["weights"][b, i] * chain[0]
        expected = (1 - drawn["m"][b]) * u[b] + drawn["m"][b] * mixture
        torch.testing.assert_close(view[b], expected, rtol=0, atol=1e-12)


def test_the_draws_follow_the_authors_distributions():
    mix = AugMix(severity=5, width=3)
    d = mix.draws(4000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(d["weights"].sum(1), torch.ones(4000, dtype=torch.float64))
    assert set(d["depth"].unique().tolist()) == {1, 2, 3} and set(d["operations"].unique().tolist()) == set(
        range(9)
    )
    assert 0.1 <= float(d["levels"].min()) and float(d["levels"].max()) < 5
    assert 0 < float(d["m"].min()) and float(d["m"].max()) < 1 and abs(float(d["m"].mean()) - 0.5) < 0.02
    assert abs(float((d["signs"] < 0).double().mean()) - 0.5) < 0.02
    assert set(AugMix(depth=2).draws(50, torch.Generator())["depth"].unique().tolist()) == {2}
    wider = AugMix(all_ops=True).draws(4000, torch.Generator().manual_seed(1))["operations"]
    assert set(wider.unique().tolist()) == set(range(13))


def authors_loss(logits_all, targets, n):
    # From google-research/augmix (a43b785) cifar.py's train(): the JSD branch.
    logits_clean, logits_aug1, logits_aug2 = torch.split(logits_all, n)
    loss = F.cross_entropy(logits_clean, targets)
    p_clean, p_aug1, p_aug2 = (
        F.softmax(logits_clean, dim=1),
        F.softmax(logits_aug1, dim=1),
        F.softmax(logits_aug2, dim=1),
    )
    p_mixture = torch.clamp((p_clean + p_aug1 + p_aug2) / 3.0, 1e-7, 1).log()
    loss += 12 * (F.kl_div(p_mixture, p_clean, reduction="batchmean") +
                  F.kl_div(p_mixture, p_aug1, reduction="batchmean") +
                  F.kl_div(p_mixture, p_aug2, reduction="batchmean")) / 3.0  # fmt: skip
    return loss


def test_the_loss_is_the_authors_and_timms_on_the_same_views_with_gradients():
    timm_loss = pytest.importorskip("timm.loss")
    torch.manual_seed(0)
    model = SmallCNN().double().train()
    by_hand = copy.deepcopy(model)
    x = torch.rand(6, 3, 8, 8, dtype=torch.float64)
    views = torch.randn(2, 6, 3, 8, 8, dtype=torch.float64)  # (any views: the authors' pipeline's, say)
    y = torch.randint(0, 5, (6,))
    mix = AugMix(generator=torch.Generator().manual_seed(1))
    with mix.attach(model):
        mix.pin(views=views)
        logits = model(x)
        loss = mix.loss(F.cross_entropy, logits, y)
        per_sample = mix.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y)
    images_all = torch.cat([x, views[0], views[1]])
    expected = by_hand(images_all)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    theirs = authors_loss(expected, y, 6)
    torch.testing.assert_close(loss, theirs, rtol=1e-14, atol=0)
    torch.testing.assert_close(per_sample.mean(), theirs, rtol=1e-14, atol=0)
    torch.testing.assert_close(loss, timm_loss.JsdCrossEntropy(smoothing=0)(expected, y), rtol=1e-14, atol=0)
    loss.backward(), theirs.backward()
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)


def test_the_views_are_made_in_pixel_space_and_normalised_back():
    """With mean/std: the views are the view of ``x * std + mean``, normalised again; the clean rows are
    the input itself; an eval forward is not tripled; a repeat (pin_last) makes the same views."""
    model = SmallCNN().double().train()
    seen = {}
    model.conv1.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    m, s = (torch.tensor(v, dtype=torch.float64).view(1, 3, 1, 1) for v in (mean, std))
    u = imageops.to_8_bits(torch.rand(4, 3, 8, 8, dtype=torch.float64))
    x = (u - m) / s
    mix = AugMix(mean=mean, std=std, generator=torch.Generator().manual_seed(5))
    with mix.attach(model):
        model(x)
        rows = seen["x"]
        drawn = mix.last.info["draws"]
        mix.pin_last()
        model(x)
        assert torch.equal(seen["x"], rows)  # (the same draws again)
        model.eval()
        assert model(x).shape[0] == 4
    assert rows.shape[0] == 12 and torch.equal(rows[:4], x)
    for k, d in enumerate(drawn):
        torch.testing.assert_close(
            rows[4 * (k + 1) : 4 * (k + 2)], (mix.view(u, d) - m) / s, rtol=0, atol=1e-12
        )
    assert not torch.allclose(rows[4:8], x) and not torch.allclose(rows[4:8], rows[8:])


def test_weigh_gives_every_row_its_own_label_and_targets_are_refused():
    model = SmallCNN().train()
    x, y = torch.rand(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    mix = AugMix()
    with mix.attach(model):
        logits = model(x)
        hits = mix.weigh(lambda o, t: (o.argmax(1) == t).double(), logits, y)
        assert torch.equal(hits, (logits.argmax(1) == y.repeat(3)).double())
        with pytest.raises(ValueError, match="AugMix trains on the clean rows' criterion"):
            mix.targets(y, num_classes=5)


def test_bad_settings_and_inputs_are_refused_in_one_line():
    with pytest.raises(ValueError, match="layer must be 'input', got 'conv1'"):
        AugMix("conv1")
    with pytest.raises(ValueError, match="severity must be an int from 1 to 10, got 0"):
        AugMix(severity=0)
    with pytest.raises(
        ValueError, match=r"depth must be 1, 2 or 3 operations per chain, or -1 \(1 to 3 at random\), got 4"
    ):
        AugMix(depth=4)
    with pytest.raises(ValueError, match="all_ops must be True or False, got 'yes'"):
        AugMix(all_ops="yes")
    with pytest.raises(ValueError, match="mean and std are given together"):
        AugMix(mean=[0.5])
    with pytest.raises(TypeError, match=r"AugMix.use\(Remix\): AugMix mixes no pairs"):
        AugMix().use(Remix(counts=[1, 2]))
    model = SmallCNN().train()
    with pytest.raises(
        ValueError, match=r"read pixels in \[0, 1\], but the input \(no mean/std given\) spans"
    ):
        with AugMix().attach(model):
            model(torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="mean/std have 2 values for an input of 3 channels"):
        with AugMix(mean=[0.5, 0.5], std=[1, 1]).attach(model):
            model(torch.rand(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"pin\(views=...\): needs two views of the batch"):
        mix = AugMix()
        with mix.attach(model):
            mix.pin(views=torch.rand(2, 3, 3, 8, 8))
            model(torch.rand(2, 3, 8, 8))


def test_the_app_gives_it_the_datas_normalisation_and_its_views_are_of_the_digits_pixels():
    """``mixup=augmix`` on digits: the mixer reads the data's own mean and std (the app's images are
    normalised), so the pixels its first batch is checked on are the digits' ``x / 16`` in [0, 1]."""
    from harness.app_runs import config
    from mixhook.app.build import build

    run = build(config("mixup=augmix", "+model.width=0.25"))
    try:
        mixer = run.mixup
        assert mixer.mean == run.data.normalization[0] and mixer.std == run.data.normalization[1]
        x, _ = next(iter(run.data.test))
        pixels = mixer._pixels(x)
        assert float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
        torch.testing.assert_close(pixels * 16, (pixels * 16).round(), rtol=0, atol=1e-4)  # (sixteenths)
    finally:
        for handle in run.handles:
            handle.remove()


def test_a_confident_prediction_keeps_the_gradient_finite():
    """A probability that underflows to 0 (a logit gap past float32's range): the authors' ``F.kl_div(...,
    p_clean)`` differentiates ``log p`` there and gives NaN gradients; the term here stays finite, and its
    value is theirs."""
    logits = torch.tensor([[0.0, 120.0, -5.0], [1.0, 2.0, 3.0]] * 3, requires_grad=True)
    y = torch.tensor([1, 2])
    n = 2
    theirs = authors_loss(logits, y, n)
    (grad_theirs,) = torch.autograd.grad(theirs, [logits])
    assert torch.isnan(grad_theirs).any()
    clean, aug1, aug2 = logits[:n], logits[n : 2 * n], logits[2 * n :]
    mine = F.cross_entropy(clean, y) + 12 * jensen_shannon(clean, aug1, aug2).mean()
    (grad,) = torch.autograd.grad(mine, [logits])
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(mine, theirs)
