"""The language-model hooks, in one room: NEFTune's noise on the embeddings (:mod:`.neftune`), and the
hooks with a loss of their own (:mod:`.protocol`: ``hook.loss(model, inputs, counts=None) -> (loss,
outputs)``, one :class:`LossState` as ``.last``): NoiseFiT (:mod:`.noisefit`) and SFTMix (:mod:`.sftmix`,
its data side in :mod:`.confidence`); the token helpers they share (:mod:`.tokens`). Their Trainer mixins
are :mod:`mixhook.integrations.lm`. Torch only, as the rest of the core."""

from .neftune import NEFTune
from .noisefit import NoiseFiT
from .protocol import LossHook, LossState
from .sftmix import SFTMix

__all__ = ["LossHook", "LossState", "NEFTune", "NoiseFiT", "SFTMix"]
