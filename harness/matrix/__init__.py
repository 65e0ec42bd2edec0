"""The matrix: every mixer and policy (one representative configuration each) in every way users train,
each cell equal to a hand-written loop on the same draws (the weights after two steps, float64) or
refused in one line before its first step; never skipped silently.

- :mod:`.methods`: the methods, each with the model it is shown on (a small CNN; a ViT for the methods
  that read attention; an MLP on regression targets for C-Mixup) and what it needs (labels before the
  forward, a partner batch, class counts), and the shipped ``mixup=`` config the app trains it with.
- :mod:`.cells`: one cell run and judged: ``exact`` (the workflow's weights equal the hand loop's),
  ``refused`` (one line before the first step, with why), ``trains`` (the app: the shipped config trains
  on the default data; its loop is compared with hand loops in ``tests/e2e``), ``fails`` (anything else:
  there should be none).
- :mod:`.distributed`: the own loop under DDP and FSDP2, two processes on gloo (torchrun), every method,
  each rank's weights against one process replaying each rank's batch.
- ``tools/matrix.py``: the whole matrix (``python -m tools.matrix``), written to ``docs/matrix.md``.

The suite runs a sample (``tests/e2e/test_matrix.py``): every method once, every workflow once, each
distributed mode once.
"""
