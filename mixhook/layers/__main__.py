"""``python -m mixhook.layers model=... data=...``: the layer browser (see :mod:`mixhook.browse`)."""

import sys

from mixhook.browse import main

sys.exit(main(sys.argv[1:]))
