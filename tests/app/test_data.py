"""Digits (offline, bundled) and the CIFAR loaders, on CIFAR-format files the tests write."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from mixhook.app.data import DataNotFoundError, EpochSampler, build_data
from tests.conftest import ROOT, write_cifar


def test_digits_split_is_stratified_normalized_and_fixed():
    data = build_data("digits", batch_size=32, seed=0)
    first = next(iter(data.train))[1]
    x_train = torch.cat([x for x, _ in data.train])
    y_test = torch.cat([y for _, y in data.test])
    assert (data.in_channels, data.num_classes, data.image_size) == (1, 10, 8)
    assert x_train.shape == (1437, 1, 8, 8) and y_test.shape == (360,)
    assert abs(float(x_train.mean())) < 1e-4 and abs(float(x_train.std()) - 1) < 1e-3
    assert torch.bincount(y_test).min() >= 35  # stratified: every digit is in the test set
    again = build_data("digits", batch_size=32, seed=0)
    assert torch.equal(y_test, torch.cat([y for _, y in again.test]))
    assert torch.equal(first, next(iter(again.train))[1])  # same seed, same shuffled order
    other = build_data("digits", batch_size=32, seed=1)
    assert not torch.equal(first, next(iter(other.train))[1])


def test_the_digits_split_is_pinned_by_its_digest(tmp_path):
    """summary.json and every checkpoint record this digest: a change of the bundled data, of scikit-learn's
    split or of our split code fails here instead of changing the studies' numbers silently."""
    assert build_data("digits", batch_size=32).split_hash == "91f4c162168de633"
    assert build_data("digits", batch_size=32, split_seed=1).split_hash != "91f4c162168de633"
    root = tmp_path / "cifar"
    write_cifar(root, "cifar10")
    first = build_data("cifar10", batch_size=4, root=str(root), num_workers=0).split_hash
    write_cifar(root, "cifar10", seed=1)  # other images in the same files
    assert build_data("cifar10", batch_size=4, root=str(root), num_workers=0).split_hash != first


def test_bad_data_options_are_refused():
    with pytest.raises(
        ValueError, match="data.name='emnist' is not a data set; valid: digits, cifar10, cifar100"
    ):
        build_data("emnist", batch_size=8)
    with pytest.raises(ValueError, match="trainer.batch_size must be a positive integer, got 0"):
        build_data("digits", batch_size=0)
    with pytest.raises(ValueError, match=r"data.test_size must be in \(0, 1\)"):
        build_data("digits", batch_size=8, test_size=1.5)


def test_cifar10_loader_reads_files_and_augments(cifar10_root):
    """The per-sample pipeline (pipeline=workers)."""
    root, files = cifar10_root
    workers = {"num_workers": 0, "pipeline": "workers"}
    data = build_data("cifar10", batch_size=4, seed=0, root=str(root), augment=False, **workers)
    assert (data.in_channels, data.num_classes, data.image_size) == (3, 10, 32)
    assert len(data.train.dataset) == 40 and len(data.test.dataset) == 8
    x, y = next(iter(data.test))
    images, labels = files["test_batch"]
    mean = torch.tensor((0.4914, 0.4822, 0.4465)).view(3, 1, 1)
    std = torch.tensor((0.2470, 0.2435, 0.2616)).view(3, 1, 1)
    torch.testing.assert_close(x, (torch.from_numpy(images).float() / 255 - mean) / std)
    assert y.tolist() == labels.tolist()

    augmented = build_data("cifar10", batch_size=4, seed=0, root=str(root), augment=True, **workers)
    dataset = augmented.train.dataset
    for i in range(8):
        out = dataset[(i, 100 + i)][0] * std + mean
        raw = torch.from_numpy(files["data_batch_1"][0][i]).float() / 255
        padded = torch.nn.functional.pad(raw, (4, 4, 4, 4))
        # the output is a 32x32 window of the 4-pixel zero-padded image, possibly mirrored
        windows = [padded[:, r : r + 32, c : c + 32] for r in range(9) for c in range(9)]
        assert any(
            torch.allclose(out, w, atol=1e-5) or torch.allclose(out, w.flip(-1), atol=1e-5) for w in windows
        ), i


def test_cifar100_uses_fine_labels(tmp_path):
    files = write_cifar(tmp_path, "cifar100", per_file=6)
    data = build_data("cifar100", batch_size=6, root=str(tmp_path), num_workers=0, augment=False)
    assert data.num_classes == 100
    assert next(iter(data.test))[1].tolist() == files["test"][1].tolist()


def test_missing_cifar_says_where_to_put_it(tmp_path):
    with pytest.raises(DataNotFoundError) as info:
        build_data("cifar10", batch_size=8, root=str(tmp_path / "nowhere"))
    message = str(info.value)
    assert (
        "CIFAR-10 not found" in message and "nowhere/cifar-10-batches-py/data_batch_1 is missing" in message
    )
    assert "cifar-10-python.tar.gz" in message and "data.download=true" in message
    assert "\n" not in message


def test_digits_train_size_keeps_a_stratified_subset():
    data = build_data("digits", batch_size=500, train_size=200)
    y = torch.cat([y for _, y in data.train])
    assert y.shape == (200,) and torch.bincount(y).min() >= 18
    assert len(data.test.dataset) == 360  # the test set is unchanged
    with pytest.raises(ValueError, match="data.train_size must be an integer from 10 to 1437, got 5"):
        build_data("digits", batch_size=8, train_size=5)


def test_epoch_order_is_a_function_of_seed_and_epoch_and_resumes_part_way():
    sampler = EpochSampler(10, seed=3)
    sampler.set_epoch(1)
    first = list(sampler)
    assert sorted(i for i, _ in first) == list(range(10)) and len({s for _, s in first}) == 10
    assert list(sampler) == first  # no stream consumed: the same epoch gives the same order again
    sampler.set_epoch(2)
    assert list(sampler) != first
    sampler.set_epoch(1, start=4)
    assert list(sampler) == first[4:] and len(sampler) == 6
    other = EpochSampler(10, seed=4)
    other.set_epoch(0)
    shifted = EpochSampler(10, seed=3)
    shifted.set_epoch(0)
    assert list(other) != list(shifted)  # (seed 4, epoch 0) is not (seed 3, epoch 1)


def test_epoch_sampler_shards_like_distributed_sampler():
    shards = []
    for rank in range(3):
        sampler = EpochSampler(10, seed=0, rank=rank, world_size=3)
        sampler.set_epoch(5)
        shards.append([i for i, _ in sampler])
    assert [len(s) for s in shards] == [4, 4, 4]  # padded to 12, as DistributedSampler pads
    assert sorted(set().union(*shards)) == list(range(10))
    with pytest.raises(ValueError, match="rank must be in"):
        EpochSampler(10, rank=2, world_size=2)


def test_a_last_batch_of_one_sample_is_left_out_a_different_one_each_epoch():
    full = EpochSampler(129, seed=0)
    short = EpochSampler(129, seed=0, batch_size=64)  # 64 + 64 + 1: BatchNorm cannot train on 1
    left_out = set()
    for epoch in range(4):
        full.set_epoch(epoch)
        short.set_epoch(epoch)
        order = list(full)
        assert list(short) == order[:128] and len(short) == 128
        left_out.add(order[128][0])
        short.set_epoch(epoch, start=64)  # a resumed epoch skips the first batch, as before
        assert list(short) == order[64:128] and len(short) == 64
    assert len(left_out) > 1
    for size, batch in ((130, 64), (128, 64), (129, 1), (1, 64)):  # nothing left out
        sampler = EpochSampler(size, batch_size=batch)
        assert len(sampler) == len(list(sampler)) == size
    shares = [EpochSampler(129, rank=r, world_size=2, batch_size=13) for r in range(2)]
    assert [len(s) for s in shares] == [65, 65]  # 65 each = 5 * 13: nothing left out
    assert [len(EpochSampler(53, rank=r, world_size=2, batch_size=13)) for r in range(2)] == [
        26,
        26,
    ]  # 27 = 2 * 13 + 1, every rank alike


@pytest.mark.parametrize("workers", [0, 2])
def test_augmented_batches_depend_on_seed_and_epoch_only(cifar10_root, workers):
    root, _ = cifar10_root
    reference = build_data("cifar10", batch_size=8, seed=1, root=str(root), num_workers=0)
    data = build_data("cifar10", batch_size=8, seed=1, root=str(root), num_workers=workers)
    for loader in (reference.train, data.train):
        loader.sampler.set_epoch(2)
    expected = [x for x, _ in reference.train]
    torch.manual_seed(123)  # the global stream neither changes the batches nor is consumed by them
    before = torch.get_rng_state()
    got = [x for x, _ in data.train]
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    data.train.sampler.set_epoch(2, start=16)  # a resumed epoch: batches 3, 4, 5
    assert all(torch.equal(a, b) for a, (b, _) in zip(expected[2:], data.train, strict=True))


# ------------------------------------------------------------------ CIFAR batches made on the device


def cifar(images, augment=True, padding=4):
    from mixhook.app.data import _CIFAR, SmallImages

    spec = _CIFAR["cifar10"]
    labels = torch.arange(len(images)) % 10
    return SmallImages(images, labels, spec["mean"], spec["std"], augment=augment, padding=padding)


def test_a_batch_is_cropped_and_flipped_as_torchvision_crops_and_flips_each_image():
    from torchvision.transforms.v2 import functional as TF

    from mixhook.app.data import crop_and_flip

    images = torch.randint(
        0, 256, (162, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    top, left, flip = (
        t.flatten() for t in torch.meshgrid(torch.arange(9), torch.arange(9), torch.arange(2), indexing="ij")
    )
    out = crop_and_flip(images, top, left, flip == 1)
    for i in range(162):  # every one of the 9 x 9 x 2 outcomes
        expected = TF.crop(TF.pad(images[i], [4]), int(top[i]), int(left[i]), 32, 32)
        expected = TF.horizontal_flip(expected) if flip[i] else expected
        assert torch.equal(out[i], expected), (int(top[i]), int(left[i]), int(flip[i]))


def test_the_crop_and_flip_draws_are_uniform_and_independent():
    from scipy.stats import chisquare

    from mixhook.app.data import augmentation_draws

    sampler = EpochSampler(162 * 200, seed=0)
    sampler.set_epoch(1)
    top, left, flip = augmentation_draws(sampler.plan()[1])
    cells = torch.bincount(top * 18 + left * 2 + flip.long(), minlength=162)
    assert int(cells.min()) > 0 and chisquare(cells.numpy()).pvalue > 1e-3


def outcome_counts(outputs: torch.Tensor, image: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """How often each of the ``(2 * padding + 1)**2 * 2`` crops and flips of ``image`` (162 for 4 pixels)
    is among ``outputs`` (unnormalised), each output matched exactly to one of them (compared on every
    4th pixel, where they already all differ)."""
    padded = torch.nn.functional.pad(image, (padding,) * 4)
    n = 2 * padding + 1
    windows = [padded[:, r : r + 32, c : c + 32] for r in range(n) for c in range(n)]
    candidates = torch.stack([w.flip(-1) if f else w for w in windows for f in (0, 1)])[:, :, ::4, ::4]
    outputs = outputs[:, :, ::4, ::4]
    distance = torch.cdist(outputs.flatten(1), candidates.flatten(1), p=float("inf"))
    closest = distance.topk(2, largest=False)
    assert bool((closest.values[:, 0] < 1e-5).all() and (closest.values[:, 1] > 1e-3).all())
    return torch.bincount(closest.indices[:, 0], minlength=2 * n * n)


@pytest.mark.slow
def test_device_batches_have_the_per_sample_pipelines_distribution():
    """One image (its content random, so that its 162 crops and flips differ), 3,240 times: the
    per-sample pipeline (torchvision's RandomCrop and RandomHorizontalFlip under each sample's seed) and
    the batched one give outcome counts that a chi-square test of homogeneity cannot tell apart, and
    each is uniform."""
    from scipy.stats import chi2_contingency, chisquare

    from mixhook.app.data import DeviceBatches, SeededSamples

    image = torch.randint(
        0, 256, (1, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    data = cifar(image.expand(3240, -1, -1, -1).clone())
    mean, std = data.mean, data.std
    sampler = EpochSampler(3240, seed=0)
    sampler.set_epoch(0)
    per_sample = torch.stack([SeededSamples(data)[key][0] for key in sampler])
    sampler.set_epoch(1)  # another epoch's seeds: independent draws
    batched = torch.cat([x for x, _ in DeviceBatches(data, 500, sampler=sampler)])
    plain = image[0].float() / 255
    counts = [outcome_counts(out * std + mean, plain) for out in (per_sample, batched)]
    assert all(chisquare(c.numpy()).pvalue > 1e-3 for c in counts)
    assert chi2_contingency(torch.stack(counts).numpy()).pvalue > 1e-3


@pytest.mark.parametrize("padding", [0, 2])
def test_another_padding_crops_within_it_in_both_pipelines(padding):
    """data.padding (the Manifold Mixup authors' code pads CIFAR and SVHN by 2 pixels): every output of
    both pipelines is one of the image's (2 * padding + 1)**2 crops of its padded copy, flipped or not,
    and each of them comes out (0: the image itself or its mirror)."""
    from scipy.stats import chisquare

    from mixhook.app.data import DeviceBatches, SeededSamples

    image = torch.randint(
        0, 256, (1, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    data = cifar(image.expand(1000, -1, -1, -1).clone(), padding=padding)
    sampler = EpochSampler(1000, seed=0)
    sampler.set_epoch(0)
    per_sample = torch.stack([SeededSamples(data)[key][0] for key in sampler])
    batched = torch.cat([x for x, _ in DeviceBatches(data, 250, sampler=sampler)])
    for out in (per_sample, batched):
        counts = outcome_counts(out * data.std + data.mean, image[0].float() / 255, padding)
        assert int(counts.min()) > 0 and chisquare(counts.numpy()).pvalue > 1e-3


def test_device_batches_follow_the_epoch_order_resume_exactly_and_shard_the_test_set(tmp_path):
    write_cifar(tmp_path, per_file=13)
    options = {"root": str(tmp_path), "num_workers": 0, "seed": 3}
    device = build_data("cifar10", batch_size=8, pipeline="device", **options)
    workers = build_data("cifar10", batch_size=8, pipeline="workers", **options)
    assert build_data("cifar10", batch_size=8, **options).train.__class__ is device.train.__class__  # auto
    for data in (device, workers):
        data.train.sampler.set_epoch(2)
    full = list(device.train)
    assert len(device.train) == len(workers.train) == len(full) == 8  # 65 samples: 8 x 8, 1 left out
    # the same order as the per-sample pipeline: the same labels, batch by batch
    assert [y.tolist() for _, y in full] == [y.tolist() for _, y in workers.train]
    assert not torch.equal(full[0][0], next(iter(workers.train))[0])  # the crops: another draw
    device.train.sampler.set_epoch(2, start=3 * 8)  # resumed after 3 steps: exactly the rest
    rest = list(device.train)
    assert len(device.train) == len(rest) == 5
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(rest, full[3:], strict=True)
    )
    device.train.sampler.set_epoch(3)
    assert not torch.equal(next(iter(device.train))[0], full[0][0])
    # unaugmented test batches equal the per-sample pipeline's, bit for bit; ranks shard them
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(device.test, workers.test, strict=True)
    )
    shards = [build_data("cifar10", batch_size=8, rank=r, world_size=2, **options).test for r in range(2)]
    labels = [torch.cat([y for _, y in shard]) for shard in shards]
    whole = torch.cat([y for _, y in device.test])
    assert torch.equal(labels[0], whole[0::2]) and torch.equal(labels[1], whole[1::2])


def test_a_bad_pipeline_is_refused(tmp_path):
    write_cifar(tmp_path, per_file=2)
    with pytest.raises(
        ValueError, match="data.pipeline='gpu' is not a pipeline; valid: auto, device, workers"
    ):
        build_data("cifar10", batch_size=8, root=str(tmp_path), pipeline="gpu")


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_the_splits_are_scikit_learns_without_importing_it(seed):
    """mixhook.app.splits draws the indices of scikit-learn's train_test_split (stratified or not) from the
    same RandomState, and reads the same bundled files, so runs keep their splits; the app no longer
    imports scikit-learn (a second of every run's start-up)."""
    from sklearn.datasets import load_diabetes, load_digits
    from sklearn.model_selection import train_test_split

    from mixhook.app import splits

    digits = load_digits()
    images, labels = splits.load_digits()
    assert np.array_equal(images, digits.images) and np.array_equal(labels, digits.target)
    x, y = load_diabetes(return_X_y=True, scaled=False)
    ours = splits.load_diabetes()
    assert np.array_equal(ours[0], x) and np.array_equal(ours[1], y)

    n = len(labels)
    for test_size in (0.2, 0.5, 0.33):
        theirs = train_test_split(np.arange(n), test_size=test_size, stratify=labels, random_state=seed)
        mine = splits.stratified_split(labels, *splits.sizes(n, test_size=test_size), seed)
        assert all(np.array_equal(a, b) for a, b in zip(theirs, mine, strict=True)), test_size
        theirs = train_test_split(np.arange(len(y)), test_size=test_size, random_state=seed)
        mine = splits.shuffle_split(len(y), *splits.sizes(len(y), test_size=test_size), seed)
        assert all(np.array_equal(a, b) for a, b in zip(theirs, mine, strict=True)), test_size
    subset = labels[:1437]
    for train_size in (10, 37, 300, 1427):
        theirs = train_test_split(np.arange(1437), train_size=train_size, stratify=subset, random_state=seed)
        mine = splits.stratified_split(subset, *splits.sizes(1437, train_size=train_size), seed)
        assert all(np.array_equal(a, b) for a, b in zip(theirs, mine, strict=True)), train_size
    with pytest.raises(ValueError, match="should be greater or equal to the number of classes"):
        train_test_split(np.arange(1437), train_size=1436, stratify=subset, random_state=seed)
    with pytest.raises(ValueError, match=r"^cannot split 1437 samples of 10 classes .* into 1436 training "):
        splits.stratified_split(subset, *splits.sizes(1437, train_size=1436), seed)


@pytest.mark.process
@pytest.mark.slow
def test_building_the_digits_imports_no_scikit_learn():
    code = (
        "import sys; from mixhook.app.data import build_data; build_data('digits', batch_size=8); "
        "build_data('diabetes', batch_size=8); "
        "print(sorted(m for m in sys.modules if m.startswith('sklearn')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


# From kaidic/LDAM-DRW imbalance_cifar.py (2536330), IMBALANCECIFAR10: the exponential profile and the
# images kept, on labels given here (their dataset's self.targets), returning the kept indices.
def ldam_imbalanced_indices(targets, imb_factor, rand_number, cls_num):
    np.random.seed(rand_number)
    img_max = len(targets) / cls_num
    img_num_per_cls = []
    for cls_idx in range(cls_num):
        num = img_max * (imb_factor ** (cls_idx / (cls_num - 1.0)))
        img_num_per_cls.append(int(num))
    targets_np = np.array(targets, dtype=np.int64)
    classes = np.unique(targets_np)
    kept = []
    for the_class, the_img_num in zip(classes, img_num_per_cls, strict=False):
        idx = np.where(targets_np == the_class)[0]
        np.random.shuffle(idx)
        kept.append(idx[:the_img_num])
    return np.concatenate(kept), img_num_per_cls


@pytest.mark.parametrize("ratio", [1.0, 10.0, 100.0])
def test_the_long_tail_keeps_the_images_ldam_drws_code_keeps(tmp_path, ratio):
    written = write_cifar(tmp_path, "cifar10", per_file=300, seed=3)
    labels = np.concatenate([written[f"data_batch_{i}"][1] for i in range(1, 6)])
    images = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])
    kept, profile = ldam_imbalanced_indices(labels.tolist(), 1 / ratio, 7, 10)
    data = build_data("cifar10", batch_size=16, root=str(tmp_path), num_workers=0, pipeline="workers",
                      augment=False, imbalance_ratio=ratio, subset_seed=7)  # fmt: skip
    ours = data.train.dataset.dataset
    assert np.array_equal(ours.images.numpy(), images[kept]) and np.array_equal(
        ours.labels.numpy(), labels[kept]
    )
    assert data.class_counts == np.bincount(labels[kept], minlength=10).tolist()
    assert data.class_counts[0] == profile[0] == 150 and data.class_counts[9] == min(
        profile[9], (labels == 9).sum()
    )
    test = torch.cat([y for _, y in data.test])
    assert len(test) == 300  # the test set is left as it is
    with pytest.raises(ValueError, match="data.imbalance_ratio must be a number >= 1"):
        build_data("cifar10", batch_size=16, root=str(tmp_path), num_workers=0, imbalance_ratio=0.5)
    write_cifar(tmp_path, "cifar100", per_file=40)  # 40 images over 100 classes: none is kept
    with pytest.raises(
        ValueError, match="data.imbalance_ratio=100 leaves no training image: 40 images over 100"
    ):
        build_data("cifar100", batch_size=16, root=str(tmp_path), num_workers=0, imbalance_ratio=100)


def test_digits_long_tail_and_the_class_balanced_sampler():
    data = build_data("digits", batch_size=64, imbalance_ratio=10.0)
    assert data.class_counts == [
        142,
        111,
        86,
        66,
        51,
        39,
        30,
        23,
        18,
        14,
    ]  # int(143.7 * 10^(-c/9)), class 0 has 142
    assert sum(len(y) for _, y in data.test) == 360
    balanced = build_data("digits", batch_size=64, imbalance_ratio=10.0, sampler="balanced")
    seen = torch.zeros(10)
    for epoch in range(1, 21):
        balanced.train.sampler.set_epoch(epoch)
        seen += torch.bincount(torch.cat([y for _, y in balanced.train]), minlength=10)
    share = seen / seen.sum()  # each class drawn about equally often (580 draws an epoch, 20 epochs)
    assert (share - 0.1).abs().max() < 0.02, share
    balanced.train.sampler.set_epoch(3)
    first = [y.tolist() for _, y in balanced.train]
    balanced.train.sampler.set_epoch(3, start=128)
    assert [y.tolist() for _, y in balanced.train] == first[2:]  # a resumed epoch: the same draws
    with pytest.raises(ValueError, match="data.sampler='weighted' is not a sampler; valid: random, balanced"):
        build_data("digits", batch_size=64, sampler="weighted")
    with pytest.raises(
        ValueError, match="data.sampler=balanced draws classes equally often, but data=diabetes"
    ):
        build_data("diabetes", batch_size=64, sampler="balanced")


@pytest.mark.parametrize("pipeline", ["device", "workers"])
def test_partner_batches_are_class_balanced_in_step_with_the_training_batches(tmp_path, pipeline):
    write_cifar(tmp_path, "cifar10", per_file=40, seed=1)
    data = build_data("cifar10", batch_size=16, root=str(tmp_path), num_workers=0, pipeline=pipeline,
                      imbalance_ratio=10.0)  # fmt: skip
    assert data.partners is None
    data.partner_batches()
    assert len(data.partners) == len(data.train) and data.partners.batch_size == 16
    counts = torch.zeros(10)
    for epoch in range(1, 31):
        data.partners.sampler.set_epoch(epoch)
        data.train.sampler.set_epoch(epoch)
        for (x, y), (xp, yp) in zip(data.train, data.partners, strict=True):
            assert x.shape == xp.shape and y.shape == yp.shape
            counts += torch.bincount(yp, minlength=10)
    share = counts / counts.sum()
    assert (share - 0.1).abs().max() < 0.03, share  # the training batches' own are long-tailed
    data.train.sampler.set_epoch(1)
    data.partners.sampler.set_epoch(1)
    assert not torch.equal(next(iter(data.train))[1], next(iter(data.partners))[1])  # their own stream
