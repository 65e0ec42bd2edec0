"""The app's one error for a bad config: a one-line message naming the key, the bad value and what would
be valid (:func:`mixhook.app.run.main` prints it and exits 2)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, said in one line."""
