"""Train one experiment: `python train.py [key=value ...]`. See README.md for the keys."""

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


if __name__ == "__main__":
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # started in the background: left ignored
        signal.signal(signal.SIGINT, on_ctrl_c)
    cli()
