"""Policies: who is paired, how much, and what the target is, for any mixer (``mixer.use(...)``).

The calibration and long-tail methods change one knob of a mix each; here each is a policy that any mixer
able to take it uses, at the input or at any layer, composable one per knob (the machinery:
:mod:`mixhook.engine.policies`):

- **partners**: :class:`PartnerBatch` (partners from a second batch fed with the first: a queue's or a
  memory bank's primitive), :class:`BalancedMixup` (Balanced-MixUp: a class-balanced partner batch, the
  partner's weight ``Beta(alpha, 1)``), :class:`SaliencyPairing` (GuidedMixup's greedy saliency pairing).
  C-Mixup's label-aware partners are :class:`~mixhook.CMixup`.
- **lam**: :class:`KernelWarping` (SK-Mixup: lam warped per pair by a kernel of the pair's distance).
- **weights**: :class:`LocalWeights` (Local Mixup: each pair's loss weighted by its distance).
- **target**: :class:`Remix` (the label goes to the minority class of an imbalanced pair).
- **loss**: :class:`DecoupledLoss` (DecoupleMix's decoupled cross-entropy), :class:`SUMix` (SUMix's
  semantic label weights and uncertainty term, with the clean batch beside the mix).

For example, Remix with SK-Mixup's warping at a hidden layer::

    mix = ManifoldMixup("layer2", alpha=1.0).use(Remix(counts), KernelWarping())
"""

from ..engine.policies import KNOBS, Policy
from ..engine.saliency import greedy_cycle
from .lam import KernelWarping, LocalWeights, symmetric_beta_cdf
from .partners import BalancedMixup, PartnerBatch, SaliencyPairing
from .sumix import SUMix
from .targets import DecoupledLoss, Remix, remix_lam

__all__ = [
    "KNOBS",
    "BalancedMixup",
    "DecoupledLoss",
    "KernelWarping",
    "LocalWeights",
    "PartnerBatch",
    "Policy",
    "Remix",
    "SUMix",
    "SaliencyPairing",
    "greedy_cycle",
    "remix_lam",
    "symmetric_beta_cdf",
]
