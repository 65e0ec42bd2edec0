"""SVHN and ImageNet-format image folders: read from files the tests write (torchvision's SVHN .mat files,
small JPEG trees in ImageNet's and Tiny-ImageNet's layouts), with the standard pipelines, reproducible
augmentation, and one line for each bad layout."""

import re

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.io import savemat
from torchvision.transforms import v2

from mixhook.app.data import IMAGENET_MEAN, IMAGENET_STD, DataNotFoundError, DeviceBatches, build_data


def svhn_files(root, n_train=10, n_test=6, seed=0):
    """SVHN-format files: X (32, 32, 3, N) uint8, y (N, 1) with labels 1..10 (10: the digit 0)."""
    g = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = g.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).reshape(n, 1).astype(np.uint8)  # 1..10, then again
        savemat(root / f"{split}_32x32.mat", {"X": x, "y": y})
        arrays[split] = (x, y)
    return arrays


def test_svhn_reads_torchvisions_files_with_10_as_the_digit_0(tmp_path):
    arrays = svhn_files(tmp_path / "svhn")
    data = build_data("svhn", batch_size=4, eval_batch_size=6, root=str(tmp_path / "svhn"))
    assert (data.in_channels, data.num_classes, data.image_size) == (3, 10, 32)
    assert isinstance(data.test, DeviceBatches) and not data.test.flip and not data.train.flip
    x, y = next(iter(data.test))  # unaugmented, in order
    expected_y = torch.from_numpy(arrays["test"][1].reshape(-1).astype(np.int64)) % 10
    assert torch.equal(y, expected_y) and y.tolist() == [1, 2, 3, 4, 5, 6]
    raw = torch.from_numpy(arrays["test"][0].transpose(3, 2, 0, 1).copy()).float() / 255
    mean, std = torch.tensor([0.4377, 0.4438, 0.4728]), torch.tensor([0.1980, 0.2010, 0.1970])
    torch.testing.assert_close(x, (raw - mean.view(3, 1, 1)) / std.view(3, 1, 1))
    labels = torch.cat([b[1] for b in build_data("svhn", batch_size=10, root=str(tmp_path / "svhn")).train])
    assert sorted(labels.tolist()) == list(range(10))  # train's 10 became 0


def test_svhn_augments_by_cropping_only_never_a_mirror(tmp_path):
    svhn_files(tmp_path / "svhn", n_train=64)
    for pipeline in ("device", "workers"):
        data = build_data(
            "svhn", batch_size=64, root=str(tmp_path / "svhn"), augment=True, pipeline=pipeline, num_workers=0
        )
        if pipeline == "workers":
            steps = [type(t).__name__ for t in data.train.dataset.dataset.augment.transforms]
            assert steps == ["RandomCrop"]
        else:
            x, _ = next(iter(data.train))
            order, seeds = data.train.sampler.plan()
            images = data.train.images[order].float() / 255
            images = (images - data.train.mean) / data.train.std
            # a crop of the padded image at (top, left): the same pixels, never mirrored
            from mixhook.app.data import augmentation_draws, crop_and_flip

            top, left, _ = augmentation_draws(seeds)
            unflipped = crop_and_flip(data.train.images[order], top, left, torch.zeros(64, dtype=torch.bool))
            torch.testing.assert_close(x, (unflipped.float() / 255 - data.train.mean) / data.train.std)
            assert images.shape == x.shape


def test_a_per_class_subset_keeps_that_many_of_each_class_and_the_normalisation_can_be_given(tmp_path):
    """data.per_class, as the Manifold Mixup authors' code keeps --labels_per_class of each class
    (supervised/load_data.py, get_sampler: shuffle, then each class's first n; every image of a class with
    fewer), drawn with data.subset_seed; data.mean/std replace the set's own normalisation (their SVHN:
    0.5 and 0.5). The subset is part of the split's digest."""
    arrays = svhn_files(tmp_path / "svhn", n_train=40)  # labels 1..10 four times each: 4 per class
    root = str(tmp_path / "svhn")
    half = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "pipeline": "workers", "num_workers": 0}
    full = build_data("svhn", batch_size=4, root=root, **half)
    subsets = [
        build_data("svhn", batch_size=4, root=root, per_class=3, subset_seed=k, **half) for k in (0, 0, 1)
    ]
    for data in subsets:
        labels = data.train.dataset.dataset.labels
        assert torch.bincount(labels, minlength=10).tolist() == [3] * 10
    kept = [s.train.dataset.dataset.images for s in subsets]
    assert torch.equal(kept[0], kept[1]) and not torch.equal(kept[0], kept[2])  # the seed draws it
    assert subsets[0].split_hash == subsets[1].split_hash != subsets[2].split_hash != full.split_hash
    images = torch.from_numpy(arrays["train"][0].transpose(3, 2, 0, 1).copy())
    assert all(any(torch.equal(k, i) for i in images) for k in kept[0])  # training images, unchanged
    every = build_data("svhn", batch_size=4, root=root, per_class=9, **half)  # more than a class has: all
    assert len(every.train.dataset.dataset.labels) == 40 and every.split_hash == full.split_hash
    x, _ = next(iter(full.test))
    test = torch.from_numpy(arrays["test"][0].transpose(3, 2, 0, 1).copy())
    torch.testing.assert_close(x, (test.float() / 255 - 0.5) / 0.5)


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"mean": [0.5, 0.5]}, "data.mean=[0.5, 0.5] and data.std=[0.198, 0.201, 0.197] must be three"),
        ({"std": [0.5, 0.0, 0.5]}, "the std's > 0"),
    ],
)
def test_a_bad_normalisation_is_one_line(tmp_path, options, line):
    svhn_files(tmp_path / "svhn")
    with pytest.raises(ValueError, match=re.escape(line)):
        build_data("svhn", batch_size=4, root=str(tmp_path / "svhn"), **options)


def test_svhn_missing_or_not_svhn_is_one_line(tmp_path):
    with pytest.raises(
        DataNotFoundError, match=r"SVHN not found: .*train_32x32.mat is missing.*data.download=true"
    ):
        build_data("svhn", batch_size=4, root=str(tmp_path / "none"))
    svhn_files(tmp_path / "svhn")
    savemat(tmp_path / "svhn" / "test_32x32.mat", {"images": np.zeros((2, 2))})
    with pytest.raises(ValueError, match=r"test_32x32.mat is not an SVHN file \(a MATLAB file with X"):
        build_data("svhn", batch_size=4, root=str(tmp_path / "svhn"))


def write_jpeg(image: torch.Tensor, path) -> None:
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(path, quality=95)


def jpeg_tree(root, classes=("cat", "dog", "owl"), per_class=4, nested=False, seed=0):
    """``root/<class>/[images/]<i>.jpg``: small JPEGs of varied sizes, each class its own tint."""
    g = torch.Generator().manual_seed(seed)
    for k, name in enumerate(classes):
        folder = root / name / ("images" if nested else "")
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = 40 + 4 * i, 48 - 2 * i
            image = torch.randint(0, 60, (3, h, w), generator=g, dtype=torch.uint8) + 60 * k
            write_jpeg(image, folder / f"{name}_{i}.jpg")


def test_an_image_folder_trains_with_the_standard_pipelines(tmp_path):
    jpeg_tree(tmp_path / "train")
    jpeg_tree(tmp_path / "val", per_class=2, seed=1)
    data = build_data(
        "imagefolder", batch_size=4, eval_batch_size=6, root=str(tmp_path), size=32, resize=36, num_workers=0
    )
    assert (data.in_channels, data.num_classes, data.image_size) == (3, 3, 32)
    x, y = next(iter(data.test))
    assert x.shape == (6, 3, 32, 32) and y.tolist() == [0, 0, 1, 1, 2, 2]  # classes sorted: cat, dog, owl
    first = v2.ToImage()(Image.open(tmp_path / "val" / "cat" / "cat_0.jpg").convert("RGB"))
    expected = v2.Compose([
        v2.Resize(36, antialias=True), v2.CenterCrop(32), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
    ])(first)  # fmt: skip
    torch.testing.assert_close(x[0], expected)
    # the training batches: RandomResizedCrop + flip, the same for a seed and epoch whatever the workers
    batches = {}
    for workers in (0, 2):
        d = build_data(
            "imagefolder", batch_size=4, root=str(tmp_path), size=32, resize=36, num_workers=workers
        )
        d.train.sampler.set_epoch(3)
        batches[workers] = [b for b in d.train]
    for (x0, y0), (x2, y2) in zip(batches[0], batches[2], strict=True):
        assert torch.equal(x0, x2) and torch.equal(y0, y2) and x0.shape[1:] == (3, 32, 32)
    assert sorted(torch.cat([b[1] for b in batches[0]]).tolist()) == [0] * 4 + [1] * 4 + [2] * 4


@pytest.mark.slow
def test_the_padded_crop_pipelines_cut_small_images_as_the_manifold_mixup_authors_do(tmp_path):
    """data.crop=padded (Tiny-ImageNet's 64x64, the Manifold Mixup authors' code): each training image is a
    64x64 window of the image zero-padded by 4 pixels, flipped or not (RandomCrop(64, padding=4) and a
    flip), never resized; each evaluation image is the image itself; both normalised with the given
    mean and std."""
    from torchvision.transforms.v2 import functional as TF

    for split in ("train", "val"):
        folder = tmp_path / split / "cls"
        folder.mkdir(parents=True)
        for i in range(3):
            image = torch.randint(0, 256, (3, 64, 64), generator=torch.Generator().manual_seed(i))
            write_jpeg(image.to(torch.uint8), folder / f"{i}.jpg")
    options = {"size": 64, "crop": "padded", "padding": 4, "mean": [0.5] * 3, "std": [0.5] * 3}
    data = build_data("imagefolder", batch_size=3, root=str(tmp_path), num_workers=0, **options)
    decoded = [
        TF.pil_to_tensor(Image.open(tmp_path / "train" / "cls" / f"{i}.jpg").convert("RGB")).float() / 255
        for i in range(3)
    ]
    seen = set()
    for epoch in range(4):
        data.train.sampler.set_epoch(epoch)
        for x, _ in data.train:
            for out in x * 0.5 + 0.5:
                matches = [
                    (i, r, c, f)
                    for i, image in enumerate(decoded)
                    for r in range(9)
                    for c in range(9)
                    for f in (0, 1)
                    if torch.allclose(out, TF.crop(TF.pad(image, [4]), r, c, 64, 64).flip(-1) if f else
                                      TF.crop(TF.pad(image, [4]), r, c, 64, 64), atol=1e-6)
                ]  # fmt: skip
                assert matches, "a training image is no padded window of its source"
                seen.add(matches[0][1:3])
    assert len(seen) > 1  # the windows move
    x, _ = next(iter(data.test))
    val = [
        TF.pil_to_tensor(Image.open(tmp_path / "val" / "cls" / f"{i}.jpg").convert("RGB")).float() / 255
        for i in range(3)
    ]
    torch.testing.assert_close(x, (torch.stack(val) - 0.5) / 0.5)


def test_tiny_imagenets_layout_reads_the_val_annotations(tmp_path):
    classes = ("n01443537", "n01629819")
    jpeg_tree(tmp_path / "train", classes=classes, nested=True)  # train/<wnid>/images/<file>
    (tmp_path / "val" / "images").mkdir(parents=True)
    lines = []
    for i, (wnid, k) in enumerate([(classes[1], 1), (classes[0], 0), (classes[1], 1)]):
        image = torch.full((3, 64, 64), 40 * k + 10, dtype=torch.uint8)
        write_jpeg(image, tmp_path / "val" / "images" / f"val_{i}.JPEG")
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t0\t63\t63")
    (tmp_path / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    data = build_data("imagefolder", batch_size=4, eval_batch_size=8, root=str(tmp_path), size=64, resize=64)
    x, y = next(iter(data.test))
    assert data.num_classes == 2 and y.tolist() == [1, 0, 1] and x.shape == (3, 3, 64, 64)
    assert len(data.train.dataset) == 8  # the nested images/ folders are read


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda r: (r / "val").mkdir(), r"data=imagefolder: .*/train is missing \(data.train='train' under"),
        (
            lambda r: (jpeg_tree(r / "train"), (r / "train" / "emu").mkdir()),
            r"the class folder .*/train/emu has no images",
        ),
        (
            lambda r: (jpeg_tree(r / "train"), (r / "train" / "cat" / "notes.txt").write_text("x")),
            r"train/cat/notes.txt is not an image \(.jpg, .jpeg",
        ),
        (
            lambda r: (jpeg_tree(r / "train"), jpeg_tree(r / "val", classes=("cat", "dog", "emu"))),
            r"hold different classes \(only in train: \['owl'\]; only in val: \['emu'\]\)",
        ),
        (
            lambda r: (
                jpeg_tree(r / "train"),
                (r / "val" / "images").mkdir(parents=True),
                (r / "val" / "val_annotations.txt").write_text("a.JPEG\tn999\t0\t0\t1\t1\n"),
            ),
            r"val_annotations.txt line 1 names class 'n999', not a training class",
        ),
    ],
    ids=["missing split", "empty class", "not an image", "other classes", "unknown annotated class"],
)
def test_a_bad_image_folder_is_one_line(tmp_path, make, message):
    make(tmp_path)
    if not (tmp_path / "val").exists():
        jpeg_tree(tmp_path / "val")
    with pytest.raises((ValueError, DataNotFoundError), match=message) as caught:
        build_data("imagefolder", batch_size=4, root=str(tmp_path), size=32, resize=32)
    assert "\n" not in str(caught.value)


def test_an_undecodable_image_is_named(tmp_path):
    jpeg_tree(tmp_path / "train")
    jpeg_tree(tmp_path / "val")
    (tmp_path / "val" / "cat" / "cat_0.jpg").write_bytes(b"not a jpeg")
    data = build_data("imagefolder", batch_size=4, root=str(tmp_path), size=32, resize=32, num_workers=0)
    with pytest.raises(ValueError, match=r"val/cat/cat_0.jpg cannot be decoded as an image"):
        next(iter(data.test))


# clovaai/CutMix-PyTorch (2d8eb68) utils.py:39-123, the lines this test needs (fb.resnet.torch's color
# augmentation, which the authors' ImageNet pipeline applies after ToTensor; old torch's add_(scalar, tensor)
# written as add_(tensor, alpha=scalar))
class _AuthorsLighting:
    def __init__(self, alphastd, eigval, eigvec):
        self.alphastd = alphastd
        self.eigval = torch.Tensor(eigval)
        self.eigvec = torch.Tensor(eigvec)

    def __call__(self, img):
        if self.alphastd == 0:
            return img
        alpha = img.new().resize_(3).normal_(0, self.alphastd)
        rgb = (
            self.eigvec.type_as(img).clone()
            .mul(alpha.view(1, 3).expand(3, 3))
            .mul(self.eigval.view(1, 3).expand(3, 3))
            .sum(1).squeeze()
        )  # fmt: skip
        return img.add(rgb.view(3, 1, 1).expand_as(img))


def _authors_grayscale(img):
    gs = img.clone()
    gs[0].mul_(0.299).add_(gs[1], alpha=0.587).add_(gs[2], alpha=0.114)
    gs[1].copy_(gs[0])
    gs[2].copy_(gs[0])
    return gs


def _authors_jitter(img, rng, var=0.4):
    """utils.ColorJitter(0.4, 0.4, 0.4) with Python's ``random`` as ``rng``: the transforms shuffled, then
    each ``img.lerp(target, uniform(-var, var))``; returns the image and the order and alphas drawn."""
    names = ["brightness", "contrast", "saturation"]
    rng.shuffle(names)
    alphas = []
    for name in names:
        if name == "brightness":
            target = img.new().resize_as_(img).zero_()
        elif name == "contrast":
            target = _authors_grayscale(img)
            target.fill_(target.mean())
        else:
            target = _authors_grayscale(img)
        alpha = rng.uniform(-var, var)
        alphas.append(alpha)
        img = img.lerp(target, alpha)
    return img, names, alphas


def test_the_color_augmentation_equals_cutmix_authors_code_on_the_same_draws():
    import random

    from mixhook.app.data import IMAGENET_EIGVAL, IMAGENET_EIGVEC, ResNetColor, jitter, pca_lighting

    image = torch.rand(3, 12, 10, generator=torch.Generator().manual_seed(0))
    for seed in range(5):
        theirs, order, alphas = _authors_jitter(image.clone(), random.Random(seed))
        torch.testing.assert_close(jitter(image, order, alphas), theirs, rtol=0, atol=1e-6)
        torch.manual_seed(seed)
        lit = _AuthorsLighting(0.1, IMAGENET_EIGVAL, IMAGENET_EIGVEC)(image)
        torch.manual_seed(seed)
        alpha = torch.empty(3).normal_(0, 0.1)
        torch.testing.assert_close(pca_lighting(image, alpha), lit, rtol=0, atol=1e-6)
    # the transform: reproducible from torch's generator, and a change to the image
    torch.manual_seed(3)
    a = ResNetColor(0.4, 0.1)(image)
    torch.manual_seed(3)
    assert torch.equal(ResNetColor(0.4, 0.1)(image), a) and not torch.allclose(a, image)


def test_the_color_augmentation_joins_the_training_pipeline_only(tmp_path):
    jpeg_tree(tmp_path / "train")
    jpeg_tree(tmp_path / "val", per_class=2)
    data = build_data(
        "imagefolder", batch_size=4, root=str(tmp_path), size=32, resize=32, color_jitter=0.4, lighting=0.1
    )
    names = [type(t).__name__ for t in data.train.dataset.dataset.transform.transforms]
    assert names == ["RandomResizedCrop", "RandomHorizontalFlip", "ToDtype", "ResNetColor", "Normalize"]
    assert "ResNetColor" not in [type(t).__name__ for t in data.test.dataset.transform.transforms]
    with pytest.raises(ValueError, match=r"data.color_jitter and data.lighting must be >= 0, got -0.1, 0.0"):
        build_data("imagefolder", batch_size=4, root=str(tmp_path), size=32, resize=32, color_jitter=-0.1)


def test_a_resumed_epoch_of_an_image_folder_sees_the_batches_it_would_have_seen(tmp_path):
    """A run resumed after 2 of an epoch's batches (the sampler told to skip their samples) gets the rest
    of that epoch's batches, crops and flips included, as the uninterrupted run got them."""
    jpeg_tree(tmp_path / "train", per_class=4)
    jpeg_tree(tmp_path / "val", per_class=2)

    def batches(start: int) -> list:
        data = build_data("imagefolder", batch_size=3, root=str(tmp_path), size=32, resize=32, seed=5)
        data.train.sampler.set_epoch(4, start=start)
        return list(data.train)

    whole, resumed = batches(0), batches(2 * 3)
    assert len(whole) == 4 and len(resumed) == 2
    for (x0, y0), (x1, y1) in zip(whole[2:], resumed, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


@pytest.mark.parametrize("given", [{}, {"crop": "padded", "mean": [0.5] * 3, "std": [0.5] * 3}])
def test_normalizing_on_the_device_gives_the_workers_values_from_a_quarter_of_the_bytes(tmp_path, given):
    """data.normalize=device: the workers deliver uint8 crops and each batch is converted and normalised
    where it trains; its batches, training (crops and flips from the same seeds) and evaluation, equal the
    workers' own to the bit, with ImageNet's normalisation or a given one. The color augmentation, which
    works on each image's floats, is refused with it."""
    jpeg_tree(tmp_path / "train", per_class=4)
    jpeg_tree(tmp_path / "val", per_class=2)
    made = {}
    for where in ("workers", "device"):
        data = build_data(
            "imagefolder", batch_size=5, eval_batch_size=4, root=str(tmp_path), size=32, resize=36, seed=3,
            num_workers=0, normalize=where, **given,
        )  # fmt: skip
        data.train.sampler.set_epoch(2)
        made[where] = (list(data.train), list(data.test), data)
    uint8, _ = next(iter(made["device"][2].train.loader))
    assert uint8.dtype == torch.uint8 and uint8.shape == (5, 3, 32, 32)
    for split in (0, 1):
        pairs = list(zip(made["workers"][split], made["device"][split], strict=True))
        assert len(pairs) == (3 if split == 0 else 2)
        for (x0, y0), (x1, y1) in pairs:
            assert x1.dtype == torch.float32 and torch.equal(x0, x1) and torch.equal(y0, y1)
    assert len(made["device"][2].train) == 3 and made["device"][2].train.batch_size == 5
    with pytest.raises(ValueError, match="data.normalize=device converts whole uint8 batches on the device"):
        build_data("imagefolder", batch_size=4, root=str(tmp_path), size=32, resize=32, lighting=0.1,
                   normalize="device")  # fmt: skip
    with pytest.raises(ValueError, match="data.normalize='gpu' is not a choice; valid: workers, device"):
        build_data("imagefolder", batch_size=4, root=str(tmp_path), size=32, resize=32, normalize="gpu")
