"""The app's Hydra config groups, as package data (``pkg://mixhook.app.conf``)."""
