"""Train one experiment: `python train.py [key=value ...]`. See README.md for the keys."""

import os
import sys

import hydra
from omegaconf import DictConfig

from mixhook import app


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return app.main(cfg)


if __name__ == "__main__":
    problem = app.check_command_line(
        sys.argv[1:], os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()
