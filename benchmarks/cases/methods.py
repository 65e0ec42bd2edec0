"""Case 7: every mixing method's training step (forward + backward + SGD) of PreActResNet-18 at a hidden
layer, against no mixing and against Manifold Mixup at the same layer; the saliency methods with each
source (activation: read from the same forward; gradient: one more forward and a backward). The methods
that keep the clean batch beside its mix (RegMixup, RankMixup, MixupE) run the layers after the mixed one
on twice the batch; C-Mixup pairs by the class numbers taken as regression labels. Each policy
(mixhook.policies) on Manifold Mixup at the same layer (``ManifoldMixup+Remix``, ...): a partner batch
runs the layers before the mix on twice the batch; a gradient saliency pairing adds a forward and a
backward."""

from __future__ import annotations

import copy
import inspect
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import cases
from benchmarks.timing import ratio
from mixhook import (
    AdAutoMix,
    AttentiveCutMix,
    AugMix,
    AutoMix,
    CoMixup,
    ManifoldMixup,
    PuzzleMix,
    SaliencyMix,
    SAMix,
    SnapMix,
)
from mixhook.mixers import METHODS
from mixhook.policies import (
    BalancedMixup,
    DecoupledLoss,
    KernelWarping,
    LocalWeights,
    Remix,
    SaliencyPairing,
)

LAYER = "layer2"  # 16x16 maps at 32x32 images: room for every method's defaults (PatchUp's 7x7 blocks)


def needs_more_than_a_layer(cls) -> bool:
    """A method with a required argument beside the layer (TransMix's attention layer: a ViT's; SnapMix's
    classifier, measured with the CNN's own): not measured on a CNN at its defaults."""
    params = list(inspect.signature(cls).parameters.values())[1:]
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)


def regression(mixer) -> bool:
    """Whether ``mixer``'s method pairs by regression labels (its card's family, C-Mixup's): the benchmarks'
    class numbers serve as such."""
    return type(mixer).card.family == "regression"


def method_variants() -> dict:
    """name -> a mixer at LAYER: every discovered method at its defaults, and the saliency variants."""
    by_hand = {"AugMix": lambda: AugMix("input", mean=[0.5], std=[0.05])}  # (the input only; N(0, 1) pixels)
    makers = {
        name: (lambda cls=cls: cls(LAYER))
        for name, cls in sorted(METHODS.items())
        if cls.card.family != "composition" and name not in by_hand and not needs_more_than_a_layer(cls)
    }
    makers.update(by_hand)
    makers["SaliencyMix_gradient"] = lambda: SaliencyMix(LAYER, saliency="gradient")
    makers["SaliencyMix_layer1_activation"] = lambda: SaliencyMix(LAYER, saliency_layer="layer1")
    makers["AttentiveCutMix_gradient"] = lambda: AttentiveCutMix(LAYER, saliency="gradient")
    makers["PuzzleMix_input"] = lambda: PuzzleMix("input")  # the paper's place (the authors: 1.47x a step)
    makers["CoMixup_input"] = lambda: CoMixup("input")  # the paper's place
    makers["SnapMix"] = lambda: SnapMix(LAYER, features="layer4", classifier="linear")  # the CNN's own
    makers["AutoMix_input"] = lambda: AutoMix("input")  # OpenMixup's place (features: layer3)
    makers["SAMix_input"] = lambda: SAMix("input")
    makers["AdAutoMix_input"] = lambda: AdAutoMix("input")
    policies = {
        "Remix": lambda: Remix([500, 300, 200, 120, 70, 40, 25, 15, 9, 5]),
        "KernelWarping": KernelWarping,
        "LocalWeights": lambda: LocalWeights(sigma=0.01),
        "DecoupledLoss": DecoupledLoss,
        "BalancedMixup": BalancedMixup,
        "SaliencyPairing_gradient": SaliencyPairing,
        "SaliencyPairing_activation": lambda: SaliencyPairing("activation"),
    }
    for name, policy in policies.items():
        makers[f"ManifoldMixup+{name}"] = lambda policy=policy: ManifoldMixup(LAYER).use(policy())
    return makers


def training_steps(base: nn.Module, makers: dict, x: torch.Tensor, y: torch.Tensor, before=None) -> dict:
    """name -> one training step (forward, the mixer's ``loss`` of the per-sample cross-entropy, backward,
    SGD) of a copy of ``base`` with ``makers[name]()`` attached (``None``: no mixer), its own parameters
    (AutoMix's Mix Block, SMMix's token head) in the optimizer; ``before(mixer)`` runs before each
    forward."""

    def per_sample_ce(logits, target):
        return F.cross_entropy(logits, target, reduction="none")

    steps = {}
    for name, make in makers.items():
        model = copy.deepcopy(base)
        mixer = make() if make is not None else None
        if mixer is not None:
            mixer.attach(model)
        own = list(mixer.parameters()) if mixer is not None else []
        opt = torch.optim.SGD([*model.parameters(), *own], lr=1e-3, momentum=0.9)

        def step(model=model, opt=opt, mixer=mixer):
            if mixer is not None and before is not None:
                before(mixer)
            logits = model(x)
            loss = (mixer.loss(per_sample_ce, logits, y) if mixer else per_sample_ce(logits, y)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        steps[name] = step
    return steps


def methods(device, timer, reps, inner, batch, size, wanted=None) -> dict:
    torch.manual_seed(0)
    base = cases.preact_resnet18().to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    partners = torch.randn_like(x), torch.randint(0, 10, (batch,), device=device)  # (a partner batch)
    makers = method_variants()
    names = ["none", *(n for n in makers if wanted is None or n in wanted)]

    def before(mixer):  # C-Mixup pairs by regression labels: the class numbers serve as such
        mixer.use_targets(y.double() if regression(mixer) else y)
        if any(p.needs_partner_batch for p in getattr(mixer, "policies", ())):
            mixer.use_partners(*partners)

    chosen = {name: None if name == "none" else makers[name] for name in names}
    steps = training_steps(base, chosen, x, y, before)
    times = timer.side_by_side(steps, reps=reps, inner=inner, warmup=2)
    return {
        "model": "preact_resnet18",
        "layer": LAYER,
        "batch": batch,
        "image_size": size,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_none": {k: ratio(times, k, "none") for k in times if k != "none"},
        "vs_manifold": {
            k: ratio(times, k, "ManifoldMixup") for k in times if k not in ("none", "ManifoldMixup")
        }
        if "ManifoldMixup" in times
        else {},
        "not_measured": sorted(
            n
            for n, cls in METHODS.items()
            if n not in makers and cls.card.family != "composition" and needs_more_than_a_layer(cls)
        ),
    }
