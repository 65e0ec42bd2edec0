"""The app's errors a user can cause: a bad config, in a one-line message naming the key, the bad value and
what would be valid (:func:`mixhook.app.run.main` prints it and exits 2), and a data set's files missing
(:class:`DataNotFoundError`, which the builder turns into a :class:`ConfigError`)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, said in one line."""


class DataNotFoundError(FileNotFoundError):
    """A data set's files are not where the config says, and could not be downloaded."""

    def __str__(self) -> str:
        return str(self.args[0])
