"""Targets beyond single-label classification, through every mixer's ``loss``/``targets``: multi-hot
(BCE-with-logits), soft probabilities, regression values, and dense targets (segmentation maps) mixed
under the same lam, box or mask as the map, the mask resized to the label map."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import (
    AttentiveCutMix,
    CutMix,
    FeatureRecorder,
    FMix,
    GridMix,
    ManifoldMixup,
    OneOf,
    PatchUp,
    ResizeMix,
    SaliencyMix,
    SmoothMix,
    TokenMix,
)

K = 3  # classes


class Segmenter(nn.Module):
    """A tiny fully convolutional segmenter: 16x16 images -> an 8x8 ``body`` map -> (B, K, 16, 16)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.body = nn.Sequential(nn.AvgPool2d(2), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(8, K, 1))

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x)))))


def batch(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, K, (n, 16, 16), generator=g)
    return x, labels


def one_hot_map(labels):
    return F.one_hot(labels, K).movedim(-1, 1).to(torch.float64)


REGION = {
    "CutMix": lambda layer: CutMix(layer),
    "CutMix elem": lambda layer: CutMix(layer, mode="elem"),
    "FMix": lambda layer: FMix(layer),
    "GridMix": lambda layer: GridMix(layer, grid=4),
    "SmoothMix": lambda layer: SmoothMix(layer),
    "TokenMix": lambda layer: TokenMix(layer, grid=4),
    "SaliencyMix": lambda layer: SaliencyMix(layer),
    "SaliencyMix elem": lambda layer: SaliencyMix(layer, mode="elem"),
    "AttentiveCutMix": lambda layer: AttentiveCutMix(layer, grid=4, top_k=6),
    "PatchUp hard": lambda layer: PatchUp(layer, block_size=3, mode="hard"),
    "PatchUp soft": lambda layer: PatchUp(layer, block_size=3, mode="soft"),
}


@pytest.mark.parametrize("name", list(REGION))
def test_dense_targets_follow_every_region_mix_at_a_hidden_layer(name):
    """The 8x8 ``body`` map is mixed; the 16x16 label map gets each cell's own weight over its 2x2
    block of pixels: the weights are the mix's own (checked against the mixed map itself), and the
    targets and the loss are the per-pixel blend of the two samples' labels."""
    model = Segmenter().double().train()
    mixer = REGION[name]("body")
    before, after = FeatureRecorder("body", where="before"), FeatureRecorder("body")
    x, labels = batch()
    with mixer.attach(model), before.attach(model), after.attach(model):
        mixer.pin(index=[2, 0, 3, 1])
        logits = model(x)
    last = mixer.last
    h, mixed = before.features["body"], after.features["body"]
    index = last.index
    w = last.weights.to(torch.float64).expand(4, 8, 8)
    if name.startswith("PatchUp"):  # channel-wise blocks: the weights are the channels' mean share
        share = (mixed - h[index]) / (h - h[index])
        torch.testing.assert_close(share.mean(1), w)
    else:
        torch.testing.assert_close(mixed, w[:, None] * h + (1 - w[:, None]) * h[index])
    assert 0 < float(w.mean()) < 1
    pixels = w.repeat_interleave(2, 1).repeat_interleave(2, 2)  # each 8x8 cell covers 2x2 pixels

    soft = mixer.targets(labels, K, dtype=torch.float64)
    own, partner = one_hot_map(labels), one_hot_map(labels[index])
    torch.testing.assert_close(soft, pixels[:, None] * own + (1 - pixels[:, None]) * partner)
    torch.testing.assert_close(soft.sum(1), torch.ones(4, 16, 16, dtype=torch.float64))

    per_pixel = mixer.loss(nn.CrossEntropyLoss(reduction="none"), logits, labels)
    ce = nn.CrossEntropyLoss(reduction="none")
    expected = pixels * ce(logits, labels) + (1 - pixels) * ce(logits, labels[index])
    torch.testing.assert_close(per_pixel, expected)
    torch.testing.assert_close(per_pixel, ce(logits, soft))  # CE is linear in its target


def test_cutmix_at_the_input_pastes_the_partners_labels_with_its_pixels():
    model = Segmenter().double().train()
    mixer = CutMix("input")
    x, labels = batch()
    with mixer.attach(model):
        mixer.pin(box=(3, 11, 5, 9), index=[1, 2, 3, 0])
        logits = model(x)
    pasted = labels.clone()
    pasted[:, 3:11, 5:9] = labels[[1, 2, 3, 0]][:, 3:11, 5:9]  # the hand-edited label map
    torch.testing.assert_close(mixer.targets(labels, K, dtype=torch.float64), one_hot_map(pasted))
    loss = mixer.loss(nn.CrossEntropyLoss(reduction="none"), logits, labels).mean()
    torch.testing.assert_close(loss, F.cross_entropy(logits, pasted))
    # the same with an ignore label, which targets() cannot express but loss() honours
    labels[0, 0, 0] = 255
    pasted[0, 0, 0] = 255
    ce = nn.CrossEntropyLoss(reduction="none", ignore_index=255)
    torch.testing.assert_close(mixer.loss(ce, logits, labels), ce(logits, pasted))
    with pytest.raises(ValueError, match=r"ignore label, e.g. 255, has no probability: use loss\(\)"):
        mixer.targets(labels, K)


def test_dense_float_targets_and_a_uniform_blend():
    """Probabilities (B, K, H, W) under a region mix, and a dense map under Manifold Mixup (one lam per
    sample, any number of positions)."""
    model = Segmenter().double().train()
    x, labels = batch()
    probs = torch.softmax(torch.randn(4, K, 16, 16, dtype=torch.float64), 1)
    mixer = CutMix("input")
    with mixer.attach(model):
        mixer.pin(box=(0, 8, 0, 16), index=[1, 0, 3, 2])
        model(x)
    expected = probs.clone()
    expected[:, :, 0:8] = probs[[1, 0, 3, 2]][:, :, 0:8]
    torch.testing.assert_close(mixer.targets(probs, K, dtype=torch.float64), expected)

    blend = ManifoldMixup("body", mode="elem")
    with blend.attach(model):
        blend.pin(lam=[0.2, 0.4, 0.6, 0.8], index=[1, 0, 3, 2])
        logits = model(x)
    lam = torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64).view(4, 1, 1)
    ce = nn.CrossEntropyLoss(reduction="none")
    torch.testing.assert_close(
        blend.loss(ce, logits, labels),
        lam * ce(logits, labels) + (1 - lam) * ce(logits, labels[[1, 0, 3, 2]]),
    )
    soft = blend.targets(labels, K, dtype=torch.float64)
    torch.testing.assert_close(
        soft, lam[:, None] * one_hot_map(labels) + (1 - lam[:, None]) * one_hot_map(labels[[1, 0, 3, 2]])
    )
    with pytest.raises(
        ValueError, match=r"one loss per sample \(reduction='none'\), but it returned shape \(\)"
    ):
        blend.loss(nn.CrossEntropyLoss(), logits, labels)


class Classifier(nn.Module):
    def __init__(self, outputs=5):
        super().__init__()
        torch.manual_seed(1)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 16 * 16, outputs)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


MIXERS = {
    "ManifoldMixup": lambda: ManifoldMixup(["input", "conv"]),
    "CutMix": lambda: CutMix("conv"),
    "FMix": lambda: FMix("input"),
    "PatchUp": lambda: PatchUp("conv", block_size=3),
    "ResizeMix": lambda: ResizeMix("input"),
    "OneOf": lambda: OneOf([ManifoldMixup("input"), CutMix("conv")]),
}


@pytest.mark.parametrize("name", list(MIXERS))
def test_multi_hot_soft_and_regression_targets_with_every_kind_of_mixer(name):
    """(B, K) floating targets are mixed with the sample's lam, whatever the method; BCE-with-logits of
    the mixed multi-hot targets equals ``loss`` (BCE is linear in its target); regression values are
    mixed with the same lam."""
    model = Classifier().double().train()
    mixer = MIXERS[name]()
    x, _ = batch()
    g = torch.Generator().manual_seed(3)
    multi_hot = (torch.rand(4, 5, generator=g) < 0.4).to(torch.float64)
    soft = torch.softmax(torch.randn(4, 5, generator=g, dtype=torch.float64), 1)
    value, vector = torch.randn(4, generator=g, dtype=torch.float64), torch.randn(4, 2, generator=g)
    with mixer.attach(model):
        logits = model(x)
    last = mixer.last
    lam, index = last.lam.view(-1, 1), last.index
    for target in (multi_hot, soft, vector.to(torch.float64)):
        torch.testing.assert_close(
            mixer.targets(target, dtype=torch.float64), lam * target + (1 - lam) * target[index]
        )
    torch.testing.assert_close(
        mixer.targets(value, dtype=torch.float64), lam[:, 0] * value + (1 - lam[:, 0]) * value[index]
    )
    assert (
        mixer.targets(vector).dtype == torch.float32
        and mixer.targets(vector, dtype=torch.float64).dtype == torch.float64
    )
    bce = nn.BCEWithLogitsLoss()
    torch.testing.assert_close(
        mixer.loss(bce, logits, multi_hot), bce(logits, mixer.targets(multi_hot, 5, dtype=torch.float64))
    )


def test_what_dense_targets_cannot_mean_is_refused():
    model = Segmenter().double().train()
    x, labels = batch()
    resize = ResizeMix("input")  # pastes the whole partner, shrunk: its labels would need shrinking too
    with resize.attach(model):
        logits = model(x)
    with pytest.raises(ValueError, match=r"^targets\(\): ResizeMix pastes the whole partner resized"):
        resize.targets(labels, K)
    with pytest.raises(ValueError, match=r"^loss\(\): ResizeMix pastes the whole partner resized"):
        resize.loss(nn.CrossEntropyLoss(reduction="none"), logits, labels)
    cut = CutMix("input")
    with cut.attach(model):
        logits = model(x)
    with pytest.raises(
        ValueError, match=r"dense targets must be \(B, H, W\) class indices or \(B, K, H, W\)"
    ):
        cut.targets(labels.flatten(1), K)  # (B, T) token labels: a 2-D mask says nothing about them
    with pytest.raises(ValueError, match=r"one loss per position \(4, 16, 16\) \(reduction='none'\)"):
        cut.loss(nn.CrossEntropyLoss(), logits, labels)  # a mean would hide the per-pixel weights
    with pytest.raises(ValueError, match="smooth floating"):
        cut.targets(torch.rand(4, K), smoothing=0.1)


def test_per_position_losses_with_a_per_sample_lam_need_the_batch_first():
    model = nn.Sequential(nn.Linear(4, 3)).double().train()  # (T, B, D) in, (T, B, K) out
    mixer = ManifoldMixup("input", mode="elem", batch_dim=1)
    x, labels = torch.randn(5, 5, 4, dtype=torch.float64), torch.randint(0, 3, (5, 5))
    with mixer.attach(model):
        logits = model(x)
    per_position = lambda out, t: F.cross_entropy(out.movedim(-1, 1), t, reduction="none")  # noqa: E731
    with pytest.raises(
        ValueError, match=r"need the batch first, but this model's mixed tensors have it at \(1,\)"
    ):
        mixer.loss(per_position, logits, labels)  # T == B here: weighting dimension 0 would be silent
