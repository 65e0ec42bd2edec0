"""What a run writes into its directory about itself, and when: Hydra's record of the config
(``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``), the line that ended a run that failed or was
stopped (in ``train.log`` as on stderr) and, in a multirun, the failed job's ``error.txt``.

Hydra writes ``.hydra/`` before the task starts, so a run refused in a directory that holds another
run (resumed with another ``model=``, or started afresh over its ``last.pt``) would rewrite that run's
recorded config with the rejected one. The app's ``config.yaml`` sets ``hydra.output_subdir: null`` and
:class:`RunRecords` writes the same three files itself: once the run is accepted (before its first step),
or when it fails in a directory of its own. A directory that already held a run (:data:`RUN_FILES`)
is left byte for byte as it was by a refused run: its line goes to stderr only.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

RUN_FILES = ("last.pt", "summary.json", "metrics.csv", ".hydra")  # what an earlier run left
SUBDIR = ".hydra"
ERROR_FILE = "error.txt"  # a multirun's failed job: the last line of its error (read by the sweep report)


def holds_a_run(out_dir: str | os.PathLike) -> bool:
    """Whether ``out_dir`` holds what an earlier run wrote (a checkpoint, metrics, a summary, a config
    record)."""
    return any(os.path.exists(os.path.join(out_dir, name)) for name in RUN_FILES)


class RunRecords:
    """The records of one run in ``out_dir``: made when the run starts (before it writes anything), with
    the config as composed (``cfg``; the app resolves a few values in place later)."""

    def __init__(self, cfg: DictConfig, out_dir: str | os.PathLike):
        self.out_dir = Path(out_dir)
        self.fresh = not holds_a_run(out_dir)  # the directory is this run's own
        self.cfg = copy.deepcopy(cfg)
        self.written = False
        self.enabled = True  # False on the ranks of a data-parallel job other than rank 0

    def accepted(self) -> None:
        """The run passed every check and starts (or resumes): record its config."""
        self._write_config()

    def failed(self, line: str, error: str | None = None) -> None:
        """The run ended with ``line`` (printed on stderr by the caller). In a directory of its own, or one
        it was accepted in: record the config (if not yet), put ``line`` into the log file and ``error``
        (a multirun job's failure, for the sweep report) into ``error.txt``. Elsewhere, nothing."""
        if not self.enabled or not (self.fresh or self.written):
            return
        self._write_config()
        _to_log_files(line)
        if error is not None:
            (self.out_dir / ERROR_FILE).write_text(f"{error}\n")

    def _write_config(self) -> None:
        """``.hydra/``'s three files, as Hydra writes them (``hydra.core.utils._save_config``), under Hydra
        and while ``hydra.output_subdir`` is null (a user who sets it gets Hydra's own record there)."""
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        if self.written or not self.enabled or not HydraConfig.initialized():
            return
        hydra_cfg = HydraConfig.instance().cfg
        if OmegaConf.select(hydra_cfg, "hydra.output_subdir") is not None:
            return
        records = {
            "config.yaml": self.cfg,
            "hydra.yaml": hydra_cfg,
            "overrides.yaml": hydra_cfg.hydra.overrides.task,
        }
        subdir = self.out_dir / SUBDIR
        subdir.mkdir(parents=True, exist_ok=True)
        for name, node in records.items():
            (subdir / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")
        self.written = True


def _to_log_files(line: str) -> None:
    """``line`` into the log files Hydra opened for the job (``train.log``), not to the console (the
    caller prints it on stderr)."""
    logger = logging.getLogger("mixhook")
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in _log_files(logger):
        handler.handle(record)


def _log_files(*loggers: logging.Logger) -> list[logging.FileHandler]:
    """The log files Hydra opened for the job: the file handlers of the root logger (and of ``loggers``)."""
    handlers = [h for lg in (logging.getLogger(), *loggers) for h in lg.handlers]
    return [h for h in handlers if isinstance(h, logging.FileHandler)]


class torch_messages_to_log:
    """While entered, what torch and Python warn about during a run (dynamo's graph breaks and
    recompilations, "No CUDA runtime is found", a library's UserWarning) goes to the log files only, not
    to the terminal; on exit the terminal gets one line with the count (when there were any) and the
    handlers are as they were. Without a log file (outside Hydra) the messages are left alone."""

    LOGGERS = ("torch", "py.warnings")

    def __init__(self, path: str | os.PathLike | None = None, say=None):
        """``path``: a log file of its own (the benchmark's), instead of the job's; ``say``: what prints the
        count (default: the app's log)."""
        self.count = 0
        self.saved: list = []
        self.path, self.say, self.own = path, say, None

    def __enter__(self):
        if self.path is not None:
            self.own = logging.FileHandler(self.path, delay=True)
            self.own.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        files = [self.own] if self.own else []
        files = files or _log_files()
        if not files:
            return self
        forward = logging.Handler(logging.WARNING)  # warnings and errors only: torch's trace is DEBUG

        def emit(record: logging.LogRecord) -> None:
            self.count += 1
            for handler in files:
                handler.handle(record)

        forward.emit = emit
        self.saved = []
        # torch's loggers that print for themselves (torch._logging gives "torch", "torch._dynamo", ...
        # their own handlers and stops them propagating)
        names = [n for n in logging.root.manager.loggerDict if n.split(".")[0] == "torch"]
        loggers = [logging.getLogger(n) for n in (*self.LOGGERS, *names)]
        for logger in dict.fromkeys(loggers):
            if logger.name in self.LOGGERS or logger.handlers:
                self.saved.append((logger, logger.handlers[:], logger.propagate))
                logger.handlers = [forward]
                logger.propagate = False
        logging.captureWarnings(True)
        return self

    def __exit__(self, *exc):
        if not self.saved:
            return False
        logging.captureWarnings(False)
        for logger, handlers, propagate in self.saved:
            logger.handlers, logger.propagate = handlers, propagate
        if self.own is not None:
            self.own.close()
        if self.count:
            where = self.path or "train.log"
            line = f"{self.count} warning(s) from torch or Python during the run went to {where} only"
            (self.say or logging.getLogger("mixhook").info)(line)
        return False
