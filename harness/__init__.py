"""What the suite and the programs that write docs (``tools/``) both run, so that neither imports the other:
the workflow matrix's reference models and cells (:mod:`harness.matrix`), the model zoo and its oracles
(:mod:`harness.zoo`), the README's run read back (:mod:`harness.readme`), the app run in-process and as a
user starts it (:mod:`harness.app_runs`), the tiny language models and TRL's trainer the language-model
checks build (:mod:`harness.language_models`), and the authors' code a method is compared with
(:mod:`harness.comixup_reference`). Not part of the package a user installs: ``tests/`` and ``tools/``
import it from the repository's root."""
