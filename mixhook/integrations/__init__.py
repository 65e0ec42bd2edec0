"""Adapters for the trainers researchers already use, one module per framework.

Each module imports its framework only when it is used (``import mixhook`` needs torch alone):

- :mod:`mixhook.integrations.timm`: :class:`~mixhook.integrations.timm.LayerMixup`, a drop-in for
  timm's ``Mixup`` (``mixup_fn``) that mixes at named layers of the model.
"""
