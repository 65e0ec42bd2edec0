"""Digits (offline, bundled) and the CIFAR loaders, on CIFAR-format files the tests write."""

import pytest
import torch

from mixhook.app.data import DataNotFoundError, EpochSampler, build_data
from tests.conftest import write_cifar


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


def test_bad_data_options_are_refused():
    with pytest.raises(
        ValueError, match="data.name='mnist' is not a data set; valid: digits, cifar10, cifar100"
    ):
        build_data("mnist", batch_size=8)
    with pytest.raises(ValueError, match="trainer.batch_size must be a positive integer, got 0"):
        build_data("digits", batch_size=0)
    with pytest.raises(ValueError, match=r"data.test_size must be in \(0, 1\)"):
        build_data("digits", batch_size=8, test_size=1.5)


def test_cifar10_loader_reads_files_and_augments(cifar10_root):
    root, files = cifar10_root
    data = build_data("cifar10", batch_size=4, seed=0, root=str(root), num_workers=0, augment=False)
    assert (data.in_channels, data.num_classes, data.image_size) == (3, 10, 32)
    assert len(data.train.dataset) == 40 and len(data.test.dataset) == 8
    x, y = next(iter(data.test))
    images, labels = files["test_batch"]
    mean = torch.tensor((0.4914, 0.4822, 0.4465)).view(3, 1, 1)
    std = torch.tensor((0.2470, 0.2435, 0.2616)).view(3, 1, 1)
    torch.testing.assert_close(x, (torch.from_numpy(images).float() / 255 - mean) / std)
    assert y.tolist() == labels.tolist()

    augmented = build_data("cifar10", batch_size=4, seed=0, root=str(root), num_workers=0, augment=True)
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
