"""The app's one way to write a file that others read: atomically (and to check that a directory can
be written before a run starts).

A checkpoint, ``summary.json``, a sweep's report: each is written to a temporary file beside its target,
flushed to disk, then renamed over it, so a reader (a resumed run, a sweep report, a person) sees the old
file or the new one, never half of one, and a failure leaves the old one in place.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path`` (``mode`` ``"w"`` or ``"wb"``); when the block ends, flush
    and fsync it and rename it to ``path``. If the block raises, the temporary file is removed and
    ``path`` is left as it was."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode, **({"newline": ""} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`atomic_write`)."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def make_writable_dir(path: str | os.PathLike) -> None:
    """Create directory ``path`` (and its parents) and write and remove a file in it; ``OSError`` if
    either cannot be done. The file is this process's own: the processes of a job started by torchrun
    check the same directory at once (with one name, one removed the file another was about to). For the
    same reason the directory can vanish between its creation and the file's (another process's check
    removes the directories it created): it is created again, a few times at most."""
    probe = os.path.join(path, f".mixhook-write-test.{os.getpid()}")
    for attempt in range(3):
        os.makedirs(path, exist_ok=True)
        try:
            with open(probe, "w") as f:
                f.write("ok")
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
    os.remove(probe)
