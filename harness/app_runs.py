"""Shared pieces for the app's tests: a composed config, and `train.py` run the way a user runs it: in a
process of its own (:func:`run_cli`, where the process is what is tested: exit statuses seen by a shell,
signals, launchers) or in the test's process (:func:`run_app`: everything else)."""

import contextlib
import copy
import csv
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

from hydra import compose, initialize_config_dir

from mixhook.app import CONF_DIR
from mixhook.app.hydra_compat import VERSION_BASE

ROOT = Path(__file__).resolve().parents[1]  # (the repository's root: train.py)


def config(*overrides):
    """The app's config composed with ``overrides``, as Hydra composes it for ``train.py``: a copy of the
    one this process composed for the same overrides from the same config files (a composition takes about
    0.15 s, a copy under 0.01 s; many tests compose the same experiment)."""
    key = (overrides, _config_files())
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=str(CONF_DIR), **VERSION_BASE):
            _COMPOSED[key] = compose(config_name="config", overrides=list(overrides))
    return copy.deepcopy(_COMPOSED[key])


_COMPOSED = {}


def _config_files() -> tuple:
    """What the app's config files are now (each one's path, size and modification time): a config composed
    before one of them changed is not used after."""
    paths = sorted(os.path.join(folder, name) for folder, _, names in os.walk(CONF_DIR) for name in names)
    stats = [os.stat(path) for path in paths]
    return tuple((path, stat.st_size, stat.st_mtime_ns) for path, stat in zip(paths, stats, strict=True))


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


def _train_module():
    """``train.py`` as the module ``train`` (loaded once: it is a script, not a package module; the job's
    name, and so its log file ``train.log``, is the app config's ``hydra.job.name``)."""
    module = sys.modules.get("train")
    if module is None or getattr(module, "__file__", None) != str(ROOT / "train.py"):
        spec = importlib.util.spec_from_file_location("train", ROOT / "train.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["train"] = module
    return module


@contextlib.contextmanager
def _process_state_kept():
    """Around an in-process run: what a run of ``train.py`` may change in its process (the working
    directory, the environment, ``sys.argv``, the logging configuration Hydra sets up for its job, the
    warning filters, torch's thread count, the random states the app seeds (torch's, NumPy's, Python's),
    Hydra's global state and its job config, which ``--cfg`` leaves set and from which a later ``app.main``
    of this worker would write another run's ``.hydra/`` records) is put back as it was, so that the next test
    of this worker starts as it would have."""
    import random

    import numpy as np
    import torch
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    cwd, environ, argv = os.getcwd(), dict(os.environ), list(sys.argv)
    job = HydraConfig.instance().cfg
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]  # fmt: skip
    kept = [(lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled) for lg in loggers]
    threads, rng = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        with warnings.catch_warnings():
            yield
    finally:
        before = {id(lg): handlers for lg, handlers, *_ in kept}
        for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
            for handler in getattr(lg, "handlers", []):
                if handler not in before.get(id(lg), ()):
                    handler.close()  # (the run's train.log)
        for lg, handlers, level, propagate, disabled in kept:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = job
        torch.set_num_threads(threads)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv[:] = argv


def run_app(*overrides, cwd, env: dict | None = None):
    """``python train.py *overrides`` run in this process as ``train.py`` runs it (its command-line check,
    then Hydra's main: the same composition, run or sweep directories, callbacks and exit statuses), with
    ``cwd`` as the working directory and ``env`` set beside this process's environment: a
    :class:`subprocess.CompletedProcess` of what a process would have given (``returncode``, ``stdout``,
    ``stderr``). For the tests that inspect what a run computes or writes; :func:`run_cli` where the process
    itself is the property."""
    argv, out, err, code = [str(ROOT / "train.py"), *map(str, overrides)], io.StringIO(), io.StringIO(), 0
    with _process_state_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.chdir(cwd)
        os.environ.update(env or {})
        sys.argv[:] = argv
        try:
            _train_module().cli()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            if isinstance(exit.code, str):
                print(exit.code, file=sys.stderr)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def results(run_dir):
    """metrics.csv rows and summary.json without the wall-clock fields (the only ones that differ)."""
    rows = [
        {k: v for k, v in r.items() if k != "seconds"} for r in csv.DictReader(open(run_dir / "metrics.csv"))
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.pop("seconds")
    return rows, summary
