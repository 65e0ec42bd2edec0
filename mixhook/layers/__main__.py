"""``python -m mixhook.layers model=... data=...``: the layer browser of the experiment app
(:mod:`mixhook.app.browse`). A command-line entry point, not part of the library: nothing in the core
imports it, and without the app extra it says what to install."""

import sys

try:
    import hydra  # noqa: F401  (the app's dependencies, imported lazily inside it)
    import torchvision  # noqa: F401

    from mixhook.app.browse import main
except ImportError as err:  # the core alone: Hydra or torchvision missing
    print(
        f"error: the layer browser is part of the experiment app, which needs {err.name}: "
        "pip install 'mixhook[app]'",
        file=sys.stderr,
    )
    sys.exit(2)

sys.exit(main(sys.argv[1:]))
