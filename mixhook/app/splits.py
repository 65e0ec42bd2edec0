"""scikit-learn's bundled data sets and its train/test splits, without importing scikit-learn.

``import sklearn`` costs about a second (it loads SciPy), which every ``python train.py`` on the digits
paid before its first line, a one-line configuration error included. The digits are a CSV file that
scikit-learn ships; :func:`stratified_split` and :func:`shuffle_split` draw exactly the indices of its
``train_test_split`` (``StratifiedShuffleSplit`` with ``stratify=``, ``ShuffleSplit`` without) from the
same ``numpy.random.RandomState``, so a run's split, and the ``data_split`` digest in its summary, are what
they were (tests/app/test_data.py compares them with scikit-learn's on many sizes and seeds, and pins the
digits split's digest). Adapted from scikit-learn 1.9 (BSD-3-Clause): ``sklearn/model_selection/_split.py``
(``StratifiedShuffleSplit._iter_indices``, ``ShuffleSplit._iter_indices``, ``_validate_shuffle_split``) and
``sklearn/utils/extmath.py`` (``_approximate_mode``).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path

import numpy as np


def bundled(name: str) -> Path:
    """The path of a data file scikit-learn ships in ``sklearn/datasets/data/`` (found, not imported)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the digits and diabetes data come with scikit-learn: pip install scikit-learn"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / name


def load_csv_gz(name: str, delimiter: str | None = ",") -> np.ndarray:
    """A bundled ``*.csv.gz`` file as float64 rows, as scikit-learn's loaders read it."""
    with gzip.open(bundled(name), mode="rt", encoding="utf-8") as f:
        return np.loadtxt(f, delimiter=delimiter)


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``load_digits()``: images ``(1797, 8, 8)`` float64 in 0..16, and labels int64."""
    data = load_csv_gz("digits.csv.gz")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)


def load_diabetes() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's ``load_diabetes(return_X_y=True, scaled=False)``: features ``(442, 10)``, targets."""
    return load_csv_gz("diabetes_data_raw.csv.gz", None), load_csv_gz("diabetes_target.csv.gz", None)


def sizes(n: int, test_size: float | None = None, train_size: int | None = None) -> tuple[int, int]:
    """``(n_train, n_test)`` as scikit-learn sizes a split: a fractional ``test_size`` rounds the test set up,
    an integer ``train_size`` is taken as is, and the other set is the rest."""
    if train_size is not None:
        return int(train_size), n - int(train_size)
    n_test = math.ceil(float(test_size) * n)
    return n - n_test, n_test


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``n_draws`` each class gets: proportional, floored, the rest by the largest remainder
    (ties broken by ``rng``)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def stratified_split(y: np.ndarray, n_train: int, n_test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The train and test indices ``train_test_split(..., stratify=y, random_state=seed)`` returns."""
    classes, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    if class_counts.min() < 2 or n_train < len(classes) or n_test < len(classes):
        raise ValueError(
            f"cannot split {len(y)} samples of {len(classes)} classes (the smallest has "
            f"{class_counts.min()}) into {n_train} training and {n_test} test samples, every class in both"
        )
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train, test = [], []
    for i in range(len(classes)):
        members = class_indices[i].take(rng.permutation(class_counts[i]), mode="clip")
        train.extend(members[: n_i[i]])
        test.extend(members[n_i[i] : n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def shuffle_split(n: int, n_train: int, n_test: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The train and test indices ``train_test_split(..., random_state=seed)`` returns (no ``stratify``)."""
    permutation = np.random.RandomState(seed).permutation(n)
    return permutation[n_test : n_test + n_train], permutation[:n_test]
