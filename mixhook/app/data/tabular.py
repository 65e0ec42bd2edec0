"""scikit-learn's bundled tabular sets, offline: the handwritten digits (8x8 grey images, the app's
default) and the diabetes data (a regression task). Each builder returns the training and test
``TensorDataset``s and what the model needs to know (:func:`~mixhook.app.data.build_data`'s info)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from .. import splits
from ..provenance import digest
from .sampling import long_tail_subset


def digits(
    name: str,
    test_size: float = 0.2,
    split_seed: int = 0,
    train_size: int | None = None,
    num_workers: int = 0,
    imbalance_ratio: float | None = None,
):
    """scikit-learn's bundled handwritten digits: 1797 8x8 grey images of 0-9, shipped with the package.

    A stratified train/test split with ``split_seed``; ``train_size`` keeps only that many training
    images (a stratified subset, for studies where regularization matters); ``imbalance_ratio`` cuts the
    training set to a long tail (:func:`long_tail_subset`, drawn with ``split_seed``; the test set stays
    balanced); pixels scaled by the training set's mean and std.
    """
    if not 0.0 < float(test_size) < 1.0:
        raise ValueError(f"data.test_size must be in (0, 1), got {test_size!r}")
    images, y = splits.load_digits()
    x = images.astype(np.float32) / 16.0
    train, test = splits.stratified_split(y, *splits.sizes(len(y), test_size=test_size), int(split_seed))
    x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
    if train_size is not None:
        _check_train_size(train_size, len(y_train))
        if train_size < len(y_train):
            keep, _ = splits.stratified_split(
                y_train, *splits.sizes(len(y_train), train_size=train_size), int(split_seed)
            )
            x_train, y_train = x_train[keep], y_train[keep]
    if imbalance_ratio is not None:
        keep = long_tail_subset(torch.from_numpy(y_train), imbalance_ratio, int(split_seed), 10).numpy()
        x_train, y_train = x_train[keep], y_train[keep]
    mean, std = x_train.mean(), x_train.std()

    def tensors(images, labels):
        images = torch.from_numpy((images - mean) / std).unsqueeze(1)
        return TensorDataset(images, torch.from_numpy(labels))

    info = {"in_channels": 1, "num_classes": 10, "image_size": 8, "train_labels": torch.from_numpy(y_train)}
    info["normalization"] = ([float(mean)], [float(std)])  # (of the [0, 1] pixels, x / 16)
    info["split_hash"] = digest(x_train, y_train, x_test, y_test)
    return tensors(x_train, y_train), tensors(x_test, y_test), info


def _check_train_size(train_size, available: int) -> None:
    """Refuse, in one line, a ``data.train_size`` that is not an integer from 10 to the ``available``
    training samples."""
    if isinstance(train_size, bool) or not isinstance(train_size, int) or not 10 <= train_size <= available:
        raise ValueError(f"data.train_size must be an integer from 10 to {available}, got {train_size!r}")


def diabetes(
    name: str,
    test_size: float = 0.2,
    split_seed: int = 0,
    train_size: int | None = None,
    num_workers: int = 0,
):
    """scikit-learn's bundled diabetes data: 442 patients, 10 baseline features, a quantitative measure
    of disease progression one year later (25 to 346) to regress.

    A random train/test split with ``split_seed``; ``train_size`` keeps that many training samples.
    Features and targets are standardised with the training set's mean and std (so a C-Mixup bandwidth
    is in standard deviations of the target); the target's std is ``target_scale``, by which the app
    reports RMSE in the target's own units.
    """
    if not 0.0 < float(test_size) < 1.0:
        raise ValueError(f"data.test_size must be in (0, 1), got {test_size!r}")
    x, y = splits.load_diabetes()
    x, y = x.astype(np.float32), y.astype(np.float32)
    train, test = splits.shuffle_split(len(y), *splits.sizes(len(y), test_size=test_size), int(split_seed))
    x_train, x_test, y_train, y_test = x[train], x[test], y[train], y[test]
    if train_size is not None:
        _check_train_size(train_size, len(y_train))
        x_train, y_train = x_train[:train_size], y_train[:train_size]
    x_mean, x_std = x_train.mean(0), x_train.std(0)
    y_mean, y_std = float(y_train.mean()), float(y_train.std())

    def tensors(features, targets):
        return TensorDataset(
            torch.from_numpy((features - x_mean) / x_std), torch.from_numpy((targets - y_mean) / y_std)
        )

    info = {"in_channels": x.shape[1], "num_classes": 1, "image_size": 0, "task": "regression"}
    info["target_scale"] = y_std
    info["split_hash"] = digest(x_train, y_train, x_test, y_test)
    return tensors(x_train, y_train), tensors(x_test, y_test), info
