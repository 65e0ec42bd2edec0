"""The base of the clean+mixed methods (RegMixup, RankMixup, MixupE): the layer emits the clean batch
followed by its Manifold Mixup (:attr:`~mixhook.engine.mixer.Mixer.keeps_clean`), and the method's loss is
its own term of the clean and the mixed logits (:meth:`clean_loss`). A module of its own, not a method: the
package exports the methods (``_discover`` skips it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from ..engine.checks import check_class_labels, check_class_logits
from ..engine.contract import MixState
from .manifold import ManifoldMixup


class CleanAndMixed(ManifoldMixup):
    """A Manifold Mixup whose layer emits ``[h; lam * h + (1 - lam) * h[index]]`` and whose loss is the
    method's own term of the clean rows beside the mixed ones.

    A method states, as class attributes, what its loss needs (``class_labels``: class indices and logits
    of one row per class, refused in one line otherwise) and why its mixed targets are no training signal
    (``refused_targets``, ``None`` where they are), and writes :meth:`clean_terms`: the loss from the
    clean and mixed logits (``B`` rows each), the labels and the mix ``last``."""

    keeps_clean = True
    class_labels: ClassVar[bool] = False
    refused_targets: ClassVar[str | None] = None

    def targets_refused(self) -> str | None:
        return self.refused_targets

    def check_targets(self, target: torch.Tensor) -> None:
        if self.class_labels:
            check_class_labels(type(self).__name__, target)
        super().check_targets(target)  # (its policies')

    def clean_loss(
        self,
        criterion: Callable,
        clean: torch.Tensor,
        mixed: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
    ) -> torch.Tensor:
        if self.class_labels:
            check_class_logits(type(self).__name__, clean, target)
        return self.clean_terms(criterion, clean, mixed, target, last)

    def clean_terms(
        self,
        criterion: Callable,
        clean: torch.Tensor,
        mixed: torch.Tensor,
        target: torch.Tensor,
        last: MixState,
    ) -> torch.Tensor:
        """The method's loss of a clean+mixed forward (after the checks :meth:`clean_loss` makes)."""
        raise NotImplementedError(f"{type(self).__name__} must implement clean_terms()")
