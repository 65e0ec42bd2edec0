"""Shared pieces for the app's tests: a composed config, and `train.py` run the way a user runs it."""

import csv
import json
import os
import subprocess
import sys

from hydra import compose, initialize_config_dir

from mixhook.app import CONF_DIR
from mixhook.app.hydra_compat import VERSION_BASE
from tests.conftest import ROOT


def config(*overrides):
    """The app's config composed with ``overrides``, as Hydra composes it for ``train.py``."""
    with initialize_config_dir(config_dir=str(CONF_DIR), **VERSION_BASE):
        return compose(config_name="config", overrides=list(overrides))


def not_log_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are not log lines (Hydra's and the app's start with a date): warnings,
    tracebacks, the one-line errors."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("[20")]


def run_cli(*overrides, cwd, env: dict | None = None):
    """``python train.py *overrides`` in ``cwd`` (``env``: variables set beside this process's): the
    completed process (stdout, stderr, returncode)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


def results(run_dir):
    """metrics.csv rows and summary.json without the wall-clock fields (the only ones that differ)."""
    rows = [
        {k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(run_dir / "metrics.csv"))
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("seconds")
    return rows, summary
