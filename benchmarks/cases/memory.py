"""Case 6: what a mixer keeps between steps, and (CUDA) the peak memory of a mixed step.

Every method of the methods case (:func:`benchmarks.cases.methods.method_variants`: each at ``layer2`` of
PreActResNet-18, the saliency and learned variants, each policy on Manifold Mixup) trains a few steps
(forward, ``loss()``, backward, SGD); then the tensors reachable from the mixer are measured
(:func:`benchmarks.kept.kept`), by what they belong to: ``.last`` and the record ``pin_last`` repeats (both of
the last forward, dropped when the next begins), the mixer's other state (fixed-size by contract), its
learned state (AutoMix's Mix Block and momentum copy) and its generator. On CUDA each method's step's peak
allocated memory is measured against no mixing, and Manifold Mixup's against the hand-edited forward's
(the paper's blend written into ``forward()``, on the same draw): the goal is at most 1.01 of it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from benchmarks import cases
from benchmarks.cases.methods import LAYER, method_variants, regression
from benchmarks.cases.training_step import hand_edited_forward
from benchmarks.kept import RECORDS, kept

STEPS = 3  # steps before measuring: the first builds what a site plans once


def memory(device, batch: int, size: int, wanted=None, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    base = cases.preact_resnet18().to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    partners = torch.randn_like(x), torch.randint(0, 10, (batch,), device=device)
    makers = method_variants()
    names = [n for n in makers if wanted is None or n in wanted]
    kept_bytes, peak = {}, {}
    cuda = device.type == "cuda"
    if cuda:
        peak["none"] = _peak(device, _stepper(copy.deepcopy(base), lambda m: F.cross_entropy(m(x), y)))
        peak["hand_layer2"] = _peak(device, _stepper(copy.deepcopy(base), lambda m: _hand_loss(m, x, y)))
    for name in names:
        model, mixer = copy.deepcopy(base), makers[name]()
        mixer.attach(model)
        opt = torch.optim.SGD([*model.parameters(), *mixer.parameters()], lr=1e-3)

        def step(model=model, mixer=mixer, opt=opt):
            mixer.use_targets(y.double() if regression(mixer) else y)
            if any(p.needs_partner_batch for p in getattr(mixer, "policies", ())):
                mixer.use_partners(*partners)
            logits = model(x)
            loss = mixer.loss(lambda o, t: F.cross_entropy(o, t, reduction="none"), logits, y).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(steps):
            step()
        found = kept(mixer, model.modules())
        records = {k: v for k, v in found.bytes.items() if k in RECORDS}
        kept_bytes[name] = {
            **records,
            "other": found.total(records=False),
            "learned": found.learned,
            "graph": len(found.graph),
        }
        if cuda:
            peak[name] = _peak(device, step)
        mixer.remove()
        del model, opt, mixer
    out = {"model": "preact_resnet18", "layer": LAYER, "batch": batch, "image_size": size, "kept": kept_bytes}
    if cuda:
        out["peak_MiB"] = peak
        out["peak_vs_none"] = {k: v / peak["none"] for k, v in peak.items() if k != "none"}
        if "ManifoldMixup" in peak:
            out["mixup_layer2_vs_hand_layer2"] = peak["ManifoldMixup"] / peak["hand_layer2"]
    else:
        out["note"] = "Peak memory: CUDA only (max_memory_allocated); the bytes kept are measured everywhere."
    return out


def _stepper(model, loss_of):
    """A training step of ``model`` (SGD, gradients set to ``None`` first, as the mixers' steps) whose loss
    is ``loss_of(model)``."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = loss_of(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _hand_loss(model, x, y) -> torch.Tensor:
    """The paper's Manifold Mixup at layer2 written into the forward (one lam, a permutation), its loss."""
    g = torch.Generator().manual_seed(0)
    lam = float(torch.distributions.Beta(2.0, 2.0).sample())
    index = torch.randperm(x.shape[0], generator=g).to(x.device)
    logits = hand_edited_forward(model, x, lam, index, "layer2")
    return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[index])


def _peak(device, step) -> float:
    """The peak allocated memory of ``step()`` (MiB), after two steps to warm the allocator up."""
    for _ in range(2):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20
