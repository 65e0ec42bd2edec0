"""The commands ``pip install 'mixhook[app]'`` installs: ``mixhook-train`` (everything ``python train.py``
does, the same code: its overrides, multirun sweeps, exit codes and Ctrl-C contract) and ``mixhook-layers``
(the experiment app's layer browser, :mod:`mixhook.app.browse`).

A package of its own beside ``mixhook``, so that starting a command imports nothing heavy before its Ctrl-C
handler is in place: importing ``mixhook`` loads torch, which takes seconds, and a KeyboardInterrupt raised
inside an import can leave a half-imported module that fails later with an unrelated traceback."""

import os
import signal
import sys

STOPPED = "stopped by SIGINT before training began: no step was taken"


def on_ctrl_c(signum, frame):
    """Ctrl-C while the run starts (torch, Hydra and the data loading, the model being built) ends it at
    once in one line: a KeyboardInterrupt raised inside an import can leave a half-imported module that
    fails later with an unrelated traceback. From the first training step on, the training loop's own
    handler stops at a step boundary and checkpoints; after it, Python's usual KeyboardInterrupt."""
    began = getattr(sys.modules.get("mixhook.app.run"), "training_began", None)  # None while it imports
    if began is not None and began():
        signal.default_int_handler(signum, frame)
    print(STOPPED, file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


def cli() -> None:
    """Check the command line, then run Hydra's main."""
    import hydra
    from omegaconf import DictConfig

    from mixhook.app import CONF_DIR, CONF_MODULE
    from mixhook.app import run as app
    from mixhook.app.command_line import check_command_line
    from mixhook.app.hydra_compat import HYDRA_MAIN

    @hydra.main(config_path=f"pkg://{CONF_MODULE}", config_name="config", **HYDRA_MAIN)
    def main(cfg: DictConfig) -> float:
        return app.main(cfg)

    problem = check_command_line(sys.argv[1:], str(CONF_DIR))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()


def train() -> None:
    """``mixhook-train [key=value ...]`` (and ``python train.py``): the Ctrl-C handler first (unless the
    process was started with SIGINT ignored, in the background: left so), then :func:`cli`."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_ctrl_c)
    _import_app("mixhook-train", "hydra", "mixhook.app.run")  # (a run's own errors stay its own)
    cli()


def layers() -> None:
    """``mixhook-layers [key=value ...]``: the layer browser (:func:`mixhook.app.browse.main`) on the app's
    model and data."""
    _import_app("mixhook-layers", "hydra", "torchvision", "mixhook.app.browse")
    from mixhook.app.browse import main

    sys.exit(main(sys.argv[1:]))


_APP = ("hydra", "omegaconf", "torchvision", "sklearn", "matplotlib", "tqdm", "yaml")  # (the app extra's)


def _import_app(command: str, *modules: str) -> None:
    """Import ``modules`` (the app and its dependencies), or end ``command`` in one line naming what to
    install, exit 2, where the app extra is missing (any other import error is raised as it is)."""
    import importlib

    try:
        for module in modules:
            importlib.import_module(module)
    except ModuleNotFoundError as err:
        if not err.name or err.name.split(".")[0] not in _APP:
            raise
        print(
            f"error: {command} is part of the experiment app, which needs {err.name}: "
            "pip install 'mixhook[app]'",
            file=sys.stderr,
        )
        sys.exit(2)
