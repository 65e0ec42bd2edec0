"""How a run stops when asked: SIGTERM or SIGINT (what SLURM, submitit and Ctrl-C send) only set a flag
within :func:`stop_signals`; the loop finishes its step, writes a checkpoint and raises
:class:`Interrupted`."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from pathlib import Path


class Interrupted(RuntimeError):
    """SIGTERM/SIGINT arrived: the step finished, the checkpoint was written, the run stops."""

    def __init__(self, signum: int, path: Path, epoch: int, step: int):
        self.signum, self.path, self.epoch, self.step = signum, path, epoch, step
        where = f"in epoch {epoch} after step {step}" if step else f"at the end of epoch {epoch}"
        super().__init__(
            f"stopped by {signal.Signals(signum).name} {where}; checkpoint "
            f"written to {path}; continue with trainer.resume=auto (same run directory) or "
            f"trainer.resume={path}"
        )


@contextmanager
def stop_signals():
    """Within the block, SIGTERM and SIGINT only set ``flag[0]`` (to the signal number); the loop
    stops at the next step boundary. The previous handlers come back afterwards. Outside the main
    thread (where Python cannot install handlers) nothing is installed."""
    flag = [0]
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        flag[0] = signum

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
