"""The app's Hydra config groups, as package data (``pkg://mixhook.app.conf``): ``CONF_DIR`` is their
directory, ``CONF_MODULE`` this package's name (shipped in the package, so ``train.py``, ``mixhook-train``
and ``mixhook-layers`` work from a checkout and from an installed wheel alike)."""

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent
CONF_MODULE = __name__
