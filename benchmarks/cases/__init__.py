"""One module per benchmark case; each returns the dict that run.py writes under its key."""
