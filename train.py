"""Train one experiment: `python train.py [key=value ...]`. See README.md for the keys."""

import signal
import sys


def cli() -> None:
    """Check the command line, then run Hydra's main. The imports are in here too, so that Ctrl-C while
    torch and Hydra load is caught below like Ctrl-C while the run is being built."""
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
    try:
        cli()
    except KeyboardInterrupt:  # before training began (the training loop stops at a step and checkpoints)
        print("stopped by SIGINT before training began: no step was taken", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
