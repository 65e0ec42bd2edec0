"""The experiment app: Hydra configs in, a checked run out (``python train.py``, or ``mixhook-train``
installed), with its data, models,
training loop, sweep reports and layer browser. It is installed by the ``app`` extra
(``pip install 'mixhook[app]'``) and imports the library core; the core never imports it.

``CONF_DIR`` is the directory of its Hydra config groups (shipped in the package, so ``train.py`` and
``mixhook-layers`` work from a checkout and from an installed wheel alike).
"""

from .conf import CONF_DIR as CONF_DIR  # (re-exported)
from .conf import CONF_MODULE as CONF_MODULE

try:  # the models, data and loop import without Hydra (a bare GPU machine; the core alone)
    import hydra  # noqa: F401
except ImportError:
    pass
else:
    from . import schema  # Hydra must know the schemas before it composes ``conf/``

    schema.register()
