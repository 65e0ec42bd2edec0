"""The programs beside the suite, each one command (docs/development.md names them): the README's own run
(``python -m tools.readme_run``, a step of ``.ci/run``), the matrix (``python -m tools.matrix`` writes
docs/matrix.md), the model zoo (``python -m tools.zoo`` writes docs/zoo.md) and every shipped config on the
default run (``python -m tools.configs`` writes docs/configs.md). They are built of the suite's own reference
models, workflows and oracles (``harness.matrix``, ``harness.zoo``), whose samples the suite runs; ``tests/``
holds the suite."""
