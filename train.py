"""Train one experiment: `python train.py [key=value ...]`. See README.md for the keys."""

import hydra
from omegaconf import DictConfig

from mixhook import app


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    return app.main(cfg)


if __name__ == "__main__":
    main()
