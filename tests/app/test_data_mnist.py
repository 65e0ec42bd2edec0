"""The MNIST family (MNIST, Fashion-MNIST, KMNIST): the IDX reader on files the tests write (gzipped or
not, flat or in torchvision's layout), every bad file refused in one line, the device pipeline, subsets and
the long tail; and the real Fashion-MNIST files where Debian's package is installed."""

import gzip
import os

import numpy as np
import pytest
import torch

from mixhook.app.data import DataNotFoundError, augmentation_draws, build_data, crop_and_flip, read_idx
from mixhook.app.data.mnist import IMAGES, LABELS, find
from tests.conftest import write_idx

DEBIAN = "/usr/share/datasets/fashion-mnist"


def _images(root, n_train=30, n_test=10, **kwargs):
    return write_idx(root, n_train=n_train, n_test=n_test, **kwargs)


@pytest.mark.parametrize("gzipped", [False, True])
def test_read_idx_reads_what_was_written(tmp_path, gzipped):
    files = _images(tmp_path, gzipped=gzipped)
    suffix = ".gz" if gzipped else ""
    images = read_idx(str(tmp_path / f"train-images-idx3-ubyte{suffix}"), IMAGES)
    labels = read_idx(str(tmp_path / f"train-labels-idx1-ubyte{suffix}"), LABELS)
    assert images.dtype == torch.uint8 and images.shape == (30, 28, 28)
    assert torch.equal(images, torch.from_numpy(files["train"][0])) and torch.equal(
        labels, torch.from_numpy(files["train"][1])
    )


def test_the_family_is_read_from_root_or_torchvisions_layout(tmp_path):
    files = _images(tmp_path / "flat")
    data = build_data("fashion_mnist", batch_size=8, root=str(tmp_path / "flat"), augment=False)
    assert (data.in_channels, data.num_classes, data.image_size) == (1, 10, 28)
    x, y = next(iter(data.test))
    pixels = torch.from_numpy(files["train"][0]).double() / 255
    mean, std = float(pixels.mean()), float(pixels.std())  # the training set's own, by default
    expected = (torch.from_numpy(files["test"][0]).float()[:, None] / 255 - mean) / std
    assert torch.allclose(x, expected, atol=1e-6) and torch.equal(y, torch.from_numpy(files["test"][1]))
    assert data.normalization == ([pytest.approx(mean)], [pytest.approx(std)])
    # torchvision's layout (<root>/<Name>/raw/, where data.download=true puts the files), gzipped
    _images(tmp_path / "tv" / "KMNIST" / "raw", gzipped=True)
    assert find("kmnist", str(tmp_path / "tv")) == str(tmp_path / "tv" / "KMNIST" / "raw")
    assert find("mnist", str(tmp_path / "tv")) is None  # (another set's folder)
    kmnist = build_data("kmnist", batch_size=8, root=str(tmp_path / "tv"), mean=[0.5], std=[0.25])
    assert kmnist.normalization == ([0.5], [0.25])


def test_a_missing_file_names_the_three_ways_to_get_it(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        build_data("fashion_mnist", batch_size=8, root=str(tmp_path))
    line = str(info.value)
    assert "\n" not in line and line.startswith("Fashion-MNIST not found (looked in ")
    for way in ("apt-get install dataset-fashion-mnist", "put its four IDX files", "data.download=true"):
        assert way in line
    _images(tmp_path)
    os.remove(tmp_path / "t10k-labels-idx1-ubyte")  # three of four: still not found
    with pytest.raises(DataNotFoundError, match="Fashion-MNIST not found"):
        build_data("fashion_mnist", batch_size=8, root=str(tmp_path))
    with pytest.raises(DataNotFoundError) as info:  # no Debian package for MNIST: two ways
        build_data("mnist", batch_size=8, root=str(tmp_path))
    assert "apt-get" not in str(info.value) and "data.download=true" in str(info.value)


def _corrupt(path, how):
    raw = bytearray(gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes())
    if how == "magic":
        raw[3] = 0x01  # an images file that says it is labels
    elif how == "truncated":
        raw = raw[:-5]
    elif how == "longer":
        raw += b"\x00\x00"
    path.write_bytes(gzip.compress(bytes(raw)) if path.suffix == ".gz" else bytes(raw))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("magic", r"is not an IDX file of images \(its magic number is 0x00000801, not 0x00000803"),
        (
            "truncated",
            r"is truncated: its header gives 30 x 28 x 28 = 23,520 bytes of images, and it holds 23,515",
        ),
        ("longer", r"is longer than its header says: its header gives 30 x 28 x 28 = 23,520 bytes"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_it(tmp_path, how, message):
    _images(tmp_path, gzipped=True)
    _corrupt(tmp_path / "train-images-idx3-ubyte.gz", how)
    with pytest.raises(ValueError, match=message) as info:
        build_data("fashion_mnist", batch_size=8, root=str(tmp_path))
    assert str(info.value).startswith(str(tmp_path / "train-images-idx3-ubyte.gz")) and "\n" not in str(
        info.value
    )


def test_files_that_do_not_belong_together_are_refused(tmp_path):
    _images(tmp_path)
    write_idx(tmp_path, n_train=29, n_test=10, only="train-labels")  # one label short
    with pytest.raises(ValueError, match=r"holds 30 images and .* 29 labels: the train split's files do not"):
        build_data("mnist", batch_size=8, root=str(tmp_path))
    _images(tmp_path, labels=12)
    with pytest.raises(ValueError, match=r"holds label 11, outside the data set's classes 0-9"):
        build_data("mnist", batch_size=8, root=str(tmp_path))
    (tmp_path / "train-images-idx3-ubyte").write_bytes(b"\x1f\x8b not gzip")  # a raw name wins over .gz
    with pytest.raises(ValueError, match="is not an IDX file of images"):
        build_data("mnist", batch_size=8, root=str(tmp_path))
    os.remove(tmp_path / "train-images-idx3-ubyte")
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz cannot be read as a gzip file"):
        build_data("mnist", batch_size=8, root=str(tmp_path))


def test_device_batches_crop_and_flip_as_drawn_and_subset_per_class(tmp_path):
    files = _images(tmp_path, n_train=60, labels=10)
    data = build_data(
        "fashion_mnist", batch_size=16, seed=3, root=str(tmp_path), flip=True, padding=4, per_class=3,
        subset_seed=1,
    )  # fmt: skip
    assert len(data.train.images) == 30 and torch.equal(
        torch.bincount(data.train.labels), torch.full((10,), 3)
    )
    sampler = data.train.sampler
    sampler.set_epoch(1)
    order, seeds = sampler.plan()
    top, left, flip = augmentation_draws(seeds, 4)
    x, y = next(iter(data.train))
    kept = data.train.images[order[:16]]
    mean, std = data.normalization
    expected = (crop_and_flip(kept, top[:16], left[:16], flip[:16], padding=4).float() / 255 - mean[0]) / std[
        0
    ]
    assert torch.allclose(x, expected, atol=1e-6) and torch.equal(y, data.train.labels[order[:16]])
    assert flip[:16].any() and not flip[:16].all()  # (a flip is drawn: fashion_mnist flips)
    digits = build_data("mnist", batch_size=16, seed=3, root=str(tmp_path))  # never flipped by default
    assert not digits.train.flip and files["train"][0].shape == (60, 28, 28)


def test_the_long_tail_and_the_balanced_sampler_as_cifar_has_them(tmp_path):
    _images(tmp_path, n_train=200, labels=10)
    data = build_data("kmnist", batch_size=8, root=str(tmp_path), imbalance_ratio=10, sampler="balanced")
    assert data.class_counts == [int(20 * 10 ** (-c / 9)) for c in range(10)]  # as LDAM-DRW cuts (20 each)
    assert data.class_counts[0] == 20 and data.class_counts[-1] == 2
    assert data.train.sampler.weights is not None


@pytest.mark.skipif(not os.path.isdir(DEBIAN), reason="Debian's dataset-fashion-mnist is not installed")
def test_the_real_fashion_mnist_from_debians_package():
    """Found without a setting (data.root=null, no data/ here), 60,000 + 10,000 images, 6,000 and 1,000 of
    each class, the training set's own mean and std; the files' digest pinned (the 2020 release)."""
    assert find("fashion_mnist", None) == DEBIAN  # (no data/FashionMNIST/raw/ or data/fashion_mnist/ here)
    data = build_data("fashion_mnist", batch_size=512, root=DEBIAN, augment=False)
    assert len(data.train.images) == 60_000 and len(data.test.images) == 10_000
    assert data.class_counts == [6000] * 10
    assert torch.equal(torch.bincount(data.test.labels), torch.full((10,), 1000))
    assert data.normalization == ([pytest.approx(0.286040, abs=1e-6)], [pytest.approx(0.353024, abs=1e-6)])
    assert data.split_hash == "b42e0f3189f494f7"  # (the study's figures are this split's)


def test_labels_and_images_of_another_size_are_refused(tmp_path):
    write_idx(tmp_path, n_train=4, n_test=4, side=20, only="t10k-images")
    write_idx(tmp_path, n_train=4, n_test=4, only="t10k-labels")
    write_idx(tmp_path, n_train=4, n_test=4, only="train")
    with pytest.raises(
        ValueError, match=r"the training images are \(28, 28\) and the test images \(20, 20\)"
    ):
        build_data("mnist", batch_size=2, root=str(tmp_path))
    assert np.array_equal(read_idx(str(tmp_path / "t10k-labels-idx1-ubyte"), LABELS).shape, (4,))


def test_without_a_root_each_set_has_folders_of_its_own_and_another_sets_files_are_refused(
    tmp_path, monkeypatch
):
    """The three sets' files have the same names: with data.root null each set is looked for in folders of
    its own (data/<torchvision's name>/raw/, data/<name>/), never a shared data/; and a whole training set
    whose mean pixel is another set's is refused as that set's files."""
    from mixhook.app.data import mnist

    monkeypatch.chdir(tmp_path)
    write_idx(tmp_path / "data")  # (a shared folder: read by none of them)
    assert find("mnist", None) is None and find("kmnist", None) is None
    write_idx(tmp_path / "data" / "kmnist")
    write_idx(tmp_path / "data" / "MNIST" / "raw", gzipped=True)
    assert find("kmnist", None) == "data/kmnist" and find("mnist", None) == "data/MNIST/raw"
    # random pixels average about 0.5, nearest Fashion-MNIST's 0.2860: a "whole" set of them (here 30
    # images) given as KMNIST is refused as Fashion-MNIST's
    monkeypatch.setattr(mnist, "WHOLE", 30)
    with pytest.raises(ValueError) as info:
        build_data("kmnist", batch_size=8)
    assert str(info.value).startswith(
        "data/kmnist holds Fashion-MNIST's training images, not Kuzushiji-MNIST's"
    )
    assert build_data("fashion_mnist", batch_size=8, root="data/kmnist").num_classes == 10  # (the nearest)


def test_images_that_are_not_square_are_refused(tmp_path):
    images = tmp_path / "train-images-idx3-ubyte"
    write_idx(tmp_path, n_train=4, n_test=4)
    raw = bytearray(images.read_bytes())
    raw[8:16] = (14).to_bytes(4, "big") + (56).to_bytes(4, "big")  # (4, 14, 56): the same bytes, not square
    images.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"its images are \(14, 56\), not square"):
        build_data("mnist", batch_size=2, root=str(tmp_path))
