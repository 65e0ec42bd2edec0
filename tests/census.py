"""A census of the suite's time: which tests start a process, which compile, and what the rest takes.

``python -m pytest -p tests.census`` (any other options too) prints, after the run, each kind's tests and
summed time: a test *starts a process* when it runs ``subprocess`` or starts a ``multiprocessing``
process (torchrun, a launcher, ``train.py``, Sphinx), *compiles* when it calls ``torch.compile``, and is
*in-process* otherwise. The summed time of the first two kinds, over the workers, is the suite's floor
for as long as they stay in it: what it says about issue 69's goal is in docs/development.md.

Each xdist worker writes its rows to ``.census/`` (under the rootdir; removed at the start of a run) and
the controller adds them up."""

from __future__ import annotations

import json
import multiprocessing.process
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

_seen = {"process": False, "compile": False}
_rows: list = []


def _flagging(original, kind: str):
    def call(*args, **kwargs):
        _seen[kind] = True
        return original(*args, **kwargs)

    return call


def pytest_configure(config) -> None:
    subprocess.Popen._execute_child = _flagging(subprocess.Popen._execute_child, "process")
    multiprocessing.process.BaseProcess.start = _flagging(
        multiprocessing.process.BaseProcess.start, "process"
    )
    import torch

    torch.compile = _flagging(torch.compile, "compile")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_folder(config), ignore_errors=True)


def _folder(config) -> Path:
    return Path(config.rootpath) / ".census"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _seen.update(process=False, compile=False)
    start = time.perf_counter()
    yield
    kind = "starts a process" if _seen["process"] else "compiles" if _seen["compile"] else "in-process"
    _rows.append((item.nodeid, time.perf_counter() - start, kind))


def pytest_sessionfinish(session) -> None:
    folder = _folder(session.config)
    folder.mkdir(exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (folder / f"{worker}.json").write_text(json.dumps(_rows))


def pytest_terminal_summary(terminalreporter, config) -> None:
    rows = [row for path in sorted(_folder(config).glob("*.json")) for row in json.loads(path.read_text())]
    workers = max(int(getattr(config.option, "numprocesses", 0) or 0), 1)
    kinds: dict[str, list[float]] = {}
    for _, seconds, kind in rows:
        kinds.setdefault(kind, []).append(seconds)
    terminalreporter.section("census")
    for kind in ("starts a process", "compiles", "in-process"):
        times = kinds.get(kind, [])
        terminalreporter.write_line(
            f"{kind:>16}: {len(times):5d} tests, {sum(times):7.1f} s summed, {sum(times) / workers:6.1f} s "
            f"over {workers} worker(s)"
        )
