"""matplotlib for the app's pictures (the reliability diagram, feature maps, the sweep report)."""

from __future__ import annotations

import logging


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (pictures are written to files), imported when the first
    picture is drawn. matplotlib's own INFO lines stay out of the run's log: on a fresh machine its first
    import builds the font cache and says "generated new fontManager" among the epoch lines."""
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
