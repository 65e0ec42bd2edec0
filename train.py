"""Train one experiment: `python train.py [key=value ...]`, the repository's entry; installed from the
wheel, the same code is the command `mixhook-train` (mixhook_cli). See README.md for the keys."""

from mixhook_cli import STOPPED, cli, on_ctrl_c, train  # noqa: F401  (what the tests run of train.py)

if __name__ == "__main__":
    train()
