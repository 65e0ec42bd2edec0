import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers (pyproject's addopts: one per core) share the cores: each worker's torch, and
    # the train.py processes it starts, get its share of them instead of all (oversubscribed, each
    # would run several times slower; the app reads MIXHOOK_THREADS, not OMP_NUM_THREADS, which a
    # launcher may set). Threads are recorded in summary.json, and runs compared within a
    # test are made with the same count.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = str(max(1, _cores // _workers))
    os.environ["OMP_NUM_THREADS"] = _threads
    os.environ["MIXHOOK_THREADS"] = _threads  # the app's default thread count (trainer.threads=null)
    torch.set_num_threads(int(_threads))

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items) -> None:
    """The tests whose property is a process (marked ``process``: train.py's exit codes, signals, launchers,
    torchrun, Sphinx, the built wheel) are a step of ``.ci/run`` of their own, ``python -m pytest -m
    process``: ``python -m pytest`` leaves them out, unless the mark expression names them or the command
    line names files or tests (then they run as asked)."""
    if "process" in (config.option.markexpr or "") or config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    left = [item for item in items if item.get_closest_marker("process")]
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if not item.get_closest_marker("process")]


def write_cifar(root: Path, name: str = "cifar10", per_file: int = 8, seed: int = 0) -> dict:
    """Write a tiny CIFAR data set in the real python format (pickled dicts of uint8 rows + labels).

    Returns {file name: (images uint8 (N, 3, 32, 32), labels)} for the test to compare against.
    """
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        folder, files, key, classes = (
            "cifar-10-batches-py",
            [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"],
            "labels",
            10,
        )
    else:
        folder, files, key, classes = "cifar-100-python", ["train", "test"], "fine_labels", 100
    out = {}
    (root / folder).mkdir(parents=True, exist_ok=True)
    for file in files:
        images = rng.integers(0, 256, size=(per_file, 3, 32, 32), dtype=np.uint8)
        labels = rng.integers(0, classes, size=per_file).tolist()
        entry = {"batch_label": file, "data": images.reshape(per_file, -1), key: labels, "filenames": []}
        with open(root / folder / file, "wb") as f:
            pickle.dump(entry, f)
        out[file] = (images, np.asarray(labels))
    return out


IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def write_idx(
    root: Path, n_train: int = 30, n_test: int = 10, seed: int = 0, gzipped: bool = False, labels: int = 10,
    side: int = 28, only: str | None = None,
) -> dict:  # fmt: skip
    """Write the MNIST family's four IDX files (LeCun's format: a big-endian header, then uint8 data) into
    ``root``, gzipped or not: random ``side x side`` images, labels ``0 .. labels - 1`` as evenly as the
    count allows, shuffled. ``only``: write only the files whose names start with it. Returns ``{"train":
    (images (N, side, side), labels), "test": ...}`` for the test to compare against."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, side, side), dtype=np.uint8)
        classes = rng.permutation(np.arange(n) % labels).astype(np.uint8)
        out[split] = (images, classes.astype(np.int64))
        for name, array, magic in zip(IDX_FILES[split], (images, classes), (0x0803, 0x0801), strict=True):
            if only is not None and not name.startswith(only):
                continue
            header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
            raw = header + array.tobytes()
            for stale in (root / name, root / f"{name}.gz"):
                stale.unlink(missing_ok=True)
            path = root / (f"{name}.gz" if gzipped else name)
            path.write_bytes(gzip.compress(raw) if gzipped else raw)
    return out


@pytest.fixture
def cifar10_root(tmp_path):
    root = tmp_path / "cifar"
    files = write_cifar(root, "cifar10")
    return root, files


@pytest.fixture
def fresh_dynamo():
    """torch.compile's caches emptied before and after the test (the compile tests count graphs and
    recompiles of their own models only)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
