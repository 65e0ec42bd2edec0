"""The model zoo: mixhook checked on real timm, torchvision and HuggingFace models, built small from their
configs, at sampled layers, by oracles that need no hand-written reference per model.

- :mod:`.catalogue`: the models (family, builder, inputs, loss).
- :mod:`.oracles`: one case (a model, a layer, a method) run and judged: ``exact``, ``refused`` (one line),
  ``wrong`` (a silent wrong result: the worst outcome) or ``error`` (an exception that is not one line).
- ``tools/zoo.py``: the whole zoo run and summarised (``python -m tools.zoo``, see its ``--help``); the
  committed report is ``docs/zoo.md``.

The suite runs a sample (``tests/e2e/test_zoo.py``): a handful of cases in the quick tier, a broad sample
in the full suite.
"""
