"""Adapters for the trainers researchers already use, one module per framework.

Each module imports its framework only when it is imported (``import mixhook`` needs torch alone;
``pip install 'mixhook[integrations]'`` installs Lightning, transformers and accelerate):

- :mod:`mixhook.integrations.timm`: :class:`~mixhook.integrations.timm.LayerMixup`, a drop-in for
  timm's ``Mixup`` (``mixup_fn``) that mixes at named layers of the model.
- :mod:`mixhook.integrations.lightning`: ``MixupCallback`` for PyTorch Lightning, and ``mixed_loss``
  for ``training_step``.
- :mod:`mixhook.integrations.transformers`: ``MixupCallback`` for the HuggingFace ``Trainer``, whose
  ``compute_loss`` is the Trainer's ``compute_loss_func``.
- :mod:`mixhook.integrations.draws`: what the trainer adapters share: draws keyed by ``(seed, rank,
  step)`` (:func:`~mixhook.integrations.draws.reseed`) and the check that a mixed forward's loss was
  taken under its mix.

Composer has no adapter: its latest release needs torch < 2.7.1 (see the README).
"""
