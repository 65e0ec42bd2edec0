"""Hydra glue: a composed config in, objects built and checked, the training loop run, accuracy out.

Everything a user can get wrong is checked in :func:`~mixhook.app.build.build` (with
:mod:`~mixhook.app.instantiate` and :mod:`~mixhook.app.preflight`) before the first training step; each
problem becomes a :class:`~mixhook.app.errors.ConfigError` whose message is one line naming the config
key, the bad value and what would be valid. :func:`main` prints that line and exits with status 2 (in a
multirun sweep the job returns NaN instead and the sweep goes on; the report's callback ends the sweep
with one line and status 1).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys

import torch
from omegaconf import DictConfig, OmegaConf

from .build import build, device_of, probe_layers
from .errors import ConfigError
from .files import make_writable_dir
from .records import RunRecords, torch_messages_to_log
from .training import checkpoint as ckpt
from .training import train
from .training.distributed import Dist
from .training.finite import NonFiniteLoss
from .training.logging import RunLogger
from .training.signals import Interrupted
from .training.state import check_resumable

log = logging.getLogger("mixhook")


def main(cfg: DictConfig, out_dir: str | None = None) -> float:
    """Build, check and run one experiment; return its final test accuracy (what Optuna maximises; minus
    the test RMSE for a regression task, so that maximising it still means better).

    Results go to ``out_dir``, by default the Hydra run's output directory. A configuration error exits
    with status 2, a non-finite loss with 3 and SIGTERM/SIGINT with 128 + the signal, each after one line
    on stderr (and in ``train.log``: :mod:`.records`). In a multirun, a job that fails so returns NaN
    after its line, and the sweep goes on; SIGTERM/SIGINT stops the sweep.
    """
    from hydra.core.hydra_config import HydraConfig

    if out_dir is None:
        out_dir = HydraConfig.get().runtime.output_dir
    records = RunRecords(cfg, out_dir)  # before anything is written: whose directory this is
    multirun = _in_multirun()
    try:
        return _main(cfg, out_dir, records)
    except (ConfigError, NonFiniteLoss, Interrupted) as err:
        if isinstance(err, Interrupted):  # status 128 + the signal, as a shell reports a kill
            line, status = str(err), 128 + err.signum
        else:
            line, status = f"error: {err}", 2 if isinstance(err, ConfigError) else 3
        records.failed(line, error=_error_line(err) if multirun else None)
        print(line, file=sys.stderr)
        if multirun:
            from .report import mark_failed

            mark_failed(HydraConfig.get().sweep.dir, HydraConfig.get().job.num, line)
        if multirun and not isinstance(err, Interrupted):
            # the job failed and the sweep goes on: its line is in error.txt for the sweep report, whose
            # callback ends the sweep with one line and a non-zero status (mixhook.app.report); Optuna
            # counts a NaN as a failed trial. (Raised, it would end the sweep in Hydra's traceback.)
            return math.nan
        if multirun:  # Ctrl-C or SIGTERM stops the sweep, not only this job: report it first
            from .report import write_report

            write_report(HydraConfig.get().sweep.dir)
        raise SystemExit(status) from None
    except Exception as err:  # a bug, not bad input: Hydra shows the traceback; the sweep report the line
        records.failed(f"error: {_error_line(err)}", error=_error_line(err) if multirun else None)
        raise


_TRAINING_BEGAN = [False]


def training_began() -> bool:
    """Whether this process has begun a run's training loop (``train.py``'s Ctrl-C handler asks: before,
    Ctrl-C ends the start-up at once)."""
    return _TRAINING_BEGAN[0]


def _error_line(err: BaseException) -> str:
    """What a sweep report says of a failed job: the error's type and its message's last line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"


def _main(cfg: DictConfig, out_dir: str, records: RunRecords) -> float:
    dist = Dist.from_env(cuda=device_of(cfg.trainer.device).type == "cuda")
    records.enabled = dist.main  # rank 0 keeps the records
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.trainer.threads or default_threads(dist))
    try:
        return _run(cfg, dist.broadcast(out_dir), dist, records)  # every rank works in rank 0's run directory
    finally:
        torch.set_num_threads(threads)
        dist.close()


def default_threads(dist: Dist | None = None) -> int:
    """``trainer.threads=null``: ``$MIXHOOK_THREADS`` if set, else the CPU cores this process may use (its
    affinity: a SLURM or container limit), shared by the processes of a data-parallel job on this machine.
    Not what ``OMP_NUM_THREADS`` says: the joblib launcher sets it to 1 in its workers and torchrun to 1 per
    process, and CPU results depend on the thread count, so the same config gives the same numbers under
    every launcher."""
    env = os.environ.get("MIXHOOK_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"MIXHOOK_THREADS={env!r}: a number of threads >= 1, or unset")
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if dist is not None and dist.enabled else 1
    return max(cores // max(local, 1), 1)


def _run(cfg: DictConfig, out_dir: str, dist: Dist, records: RunRecords) -> float:
    if not dist.main:
        log.setLevel(logging.WARNING)  # rank 0 reports
    _check_writable(out_dir)
    run = build(cfg, dist)
    try:
        run.config = OmegaConf.to_container(cfg, resolve=True)
        state = _resume_state(cfg, out_dir, run.config)
        records.accepted()
        log.info("%s on %s, %s, hooks %s -> %s", cfg.model.get("name", cfg.model._target_.rsplit(".", 1)[-1]),
                 cfg.data.name, run.device, run.hooks or "none", out_dir)  # fmt: skip
        for key, named in run.summary["layers"].items():  # what a portable spec or pattern named here
            shown = [f"{s} -> {', '.join(names)}" for s, names in named.items() if list(names) != [s]]
            if shown:
                log.info("%s layers on this model: %s", key, "; ".join(shown))
        if cfg.probes.feature_maps and probe_layers(cfg):
            x, y = next(iter(run.data.test))
            run.feature_maps = (probe_layers(cfg), x[:4], y[:4])
        logger = None
        if dist.main:
            try:
                logger = RunLogger(
                    out_dir, cfg.trainer.logger, run.hooks, state["global_step"] if state else None
                )
            except ValueError as err:
                raise ConfigError(str(err)) from err
        try:
            _TRAINING_BEGAN[0] = True
            with torch_messages_to_log():
                summary = train(run, out_dir, resume=state, dist=dist, logger=logger)
        except ckpt.CheckpointError as err:
            raise ConfigError(f"trainer.resume: {err}") from err
        finally:
            if logger is not None:
                logger.close()
    finally:  # no hook and no data-loader worker outlives the run, whatever ended it
        for handle in run.handles:
            handle.remove()
        # (the loaders' persistent workers stop now; left in the run's reference cycle, a garbage
        # collection in a later run of the same process, a sweep's next job, stopped them, 5 s each)
        run.data = None
    run.task.log_done(summary, out_dir)
    return run.task.score(summary)  # (what a sweep maximises: the test accuracy, or minus the test RMSE)


def _check_writable(out_dir: str) -> None:
    """Fail before anything else if the run directory cannot be created or written."""
    try:
        make_writable_dir(out_dir)
    except OSError as err:
        raise ConfigError(f"the run directory {out_dir} cannot be written: {err.strerror or err}") from None


def _resume_state(cfg: DictConfig, out_dir: str, config: dict) -> dict | None:
    """The checkpoint to continue from (``trainer.resume``), checked to belong to this run's config;
    ``None`` for a fresh start. Refuses to start afresh over a run directory's existing checkpoint."""
    resume = cfg.trainer.get("resume")
    here = os.path.join(out_dir, ckpt.FILE)
    if resume is None:
        if os.path.exists(here):
            other = "hydra.sweep.dir" if _in_multirun() else "hydra.run.dir"
            raise ConfigError(
                f"the run directory {out_dir} already holds a checkpoint ({ckpt.FILE}); continue it with "
                f"trainer.resume=auto, or choose another {other}"
            )
        return None
    if not isinstance(resume, str) or not resume:
        raise ConfigError(f"trainer.resume must be null, auto or a checkpoint path, got {resume!r}")
    if resume == "auto" and not os.path.exists(here):
        log.info("trainer.resume=auto: no %s in %s yet, starting from the beginning", ckpt.FILE, out_dir)
        return None
    path = here if resume == "auto" else resume
    try:
        state = ckpt.load(path)
    except ckpt.CheckpointError as err:
        raise ConfigError(f"trainer.resume: {err}") from None
    saved_epochs = OmegaConf.select(OmegaConf.create(state.get("config") or {}), "trainer.epochs")
    as_saved = None
    if isinstance(saved_epochs, int) and saved_epochs != cfg.trainer.epochs:  # extending the run
        before = copy.deepcopy(cfg)
        before.trainer.epochs = saved_epochs
        as_saved = OmegaConf.to_container(before, resolve=True)
    try:
        check_resumable(state, config, as_saved)
    except ckpt.CheckpointError as err:
        raise ConfigError(f"trainer.resume: {path}: {err}") from None
    return state


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
