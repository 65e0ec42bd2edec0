import pickle
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.fixture
def cifar10_root(tmp_path):
    root = tmp_path / "cifar"
    files = write_cifar(root, "cifar10")
    return root, files
