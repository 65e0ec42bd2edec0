"""What the trainer adapters share: draws keyed by the step, and the check that a mixed forward's loss
was taken under its mix.

**Draws keyed by (seed, rank, step).** A trainer checkpoints on rank 0 only (Lightning's callback
state, the HuggingFace Trainer's ``trainer_state.json``), so a generator's state, which differs per rank,
cannot be saved by a callback for every rank. The adapters therefore reseed the regularizer's
generators at the start of every training step from ``(seed, rank, step)`` (:func:`reseed`): what step
``t`` of rank ``r`` draws depends on nothing else, so a run resumed from any checkpoint (any path, any
save strategy) draws what the uninterrupted run drew, and every rank draws its own mixes. The seed is
the one number a checkpoint needs. To draw the same mixes in your own loop, call :func:`reseed` with
the same numbers before each step.

**A mixed forward must have its loss taken by the regularizer** (``loss``, ``targets`` or
``state_for``): a trainer that computes the loss itself (the model's own loss on a mixed forward, a
plain criterion in ``training_step``) would train on mixed logits against unmixed labels, silently.
:class:`StepGuard` counts the training forwards of the hooked module in a step and refuses, in one line
and before the optimizer step, a step whose mixed forward had no loss taken by mixhook, or a step in
which the hooked module never ran (the mixer was attached to a module the step does not call).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..copies import own
from ..engine.contract import MixingHook, members
from ..hooks import LayerHook
from ..policies.partners import class_balanced_weights
from ..schedule import MixSchedule

_MASK = 2**64 - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer (Steele et al. 2014): a bijection of 64-bit ints whose every output bit
    depends on every input bit (torch's CPU generator keeps only a seed's low 32 bits)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def step_seed(seed: int, rank: int, step: int, part: int = 0) -> int:
    """The seed of generator ``part`` of a regularizer on rank ``rank`` at step ``step``."""
    x = _splitmix64(seed & _MASK)
    for value in (rank, step, part):
        x = _splitmix64(x ^ (value & _MASK))
    return x


def generators(hook: MixingHook) -> list[torch.Generator]:
    """The generators ``hook`` draws from: its own and, for a :class:`~mixhook.OneOf`, its mixers'
    (recursively), each once, in a fixed order."""
    found: list[torch.Generator] = []
    for h in members(hook):
        g = getattr(h, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def reseed(hook: MixingHook, seed: int, rank: int, step: int, first_part: int = 0) -> None:
    """Reseed every generator of ``hook`` for step ``step`` of rank ``rank`` (:func:`step_seed`, the
    generators numbered from ``first_part``: hooks reseeded from one seed take parts of their own), and
    stop its default generators from reseeding themselves per rank (the rank is in the seed already)."""
    for h in members(hook):
        h.seed_per_rank = False
    for part, g in enumerate(generators(hook), start=first_part):
        g.manual_seed(step_seed(seed, rank, step, part))


def join_optimizer(hook: MixingHook, optimizer, schedulers=()) -> int | None:
    """Add the regularizer's own trainable parameters (AutoMix's Mix Block: ``hook.parameters()``) to
    ``optimizer`` as one more parameter group, with the options of its first group (learning rate,
    momentum, weight decay), unless it holds them already; each of ``schedulers`` (a torch ``LRScheduler``
    of that optimizer) schedules the group as the first one. An optimizer wrapped by accelerate or
    Lightning is reached through its ``.optimizer``. Returns the index of the group added (``None`` where
    none was: the methods without parameters, an optimizer that holds them already)."""
    params = [p for p in hook.parameters() if p.requires_grad]
    inner = unwrapped(optimizer)
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    new = [p for p in params if id(p) not in held]
    if not new:
        return None
    groups = len(inner.param_groups)
    options = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
    own = hook.parameter_options()  # (AutoMix's block_lr: the group's own learning rate)
    options.update(own)
    if "lr" in own and "initial_lr" in options:
        options["initial_lr"] = own["lr"]
    inner.add_param_group({**options, "params": new})
    for scheduler in schedulers:
        _schedule_like_the_first(getattr(scheduler, "scheduler", scheduler), inner, groups, own.get("lr"))
    return groups


def unwrapped(optimizer):
    """The torch optimizer inside one wrapped by accelerate or Lightning (through their ``.optimizer``)."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _schedule_like_the_first(scheduler, optimizer, groups: int, lr: float | None = None) -> None:
    """A scheduler of ``optimizer`` made when it had ``groups`` groups: each of its per-group lists
    (:data:`_PER_GROUP`) gets the first group's entry for the group added (its learning rates ``lr``
    where the group has its own); a scheduler of schedulers (``SequentialLR``, ``ChainedScheduler``) each
    of its own."""
    for inner in getattr(scheduler, "_schedulers", ()):
        _schedule_like_the_first(inner, optimizer, groups, lr)
    if getattr(scheduler, "optimizer", None) is not optimizer:
        return
    for name in _PER_GROUP:
        value = getattr(scheduler, name, None)
        if isinstance(value, list) and len(value) == groups and groups:
            value.append(lr if lr is not None and name in ("base_lrs", "_last_lr") else value[0])


# torch's schedulers' lists with one entry per parameter group (OneCycleLR keeps its own in the groups)
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs")


def needs_partner_batch(hook: MixingHook) -> bool:
    """Whether ``hook`` (or one of a :class:`~mixhook.OneOf`'s mixers) mixes with a second batch that
    ``use_partners`` gives before each training forward (``PartnerBatch``, Balanced-MixUp)."""
    return any(p.needs_partner_batch for h in members(hook) for p in getattr(h, "policies", ()))


def _forwards(hook: MixingHook) -> list:
    """The records of recent forwards (:class:`~mixhook.engine.binding.Forwards`) of ``hook``'s mixers."""
    return [h.forwards for h in members(hook) if getattr(h, "forwards", None) is not None]


def check_arguments(mixer, module, schedule, seed) -> None:
    """The checks every trainer adapter's ``MixupCallback(mixer, module, schedule, seed=...)`` makes."""
    if not isinstance(mixer, MixingHook) or not isinstance(mixer, LayerHook):
        raise TypeError(f"MixupCallback needs a mixhook regularizer (ManifoldMixup, ...), got {mixer!r:.80}")
    if schedule is not None and (not isinstance(schedule, MixSchedule) or schedule.mixer is not mixer):
        raise ValueError("MixupCallback(schedule=...) must be a MixSchedule of the callback's mixer")
    if module is not None and (not isinstance(module, str) or not module or module == "input"):
        raise ValueError(f"MixupCallback(module=...) must be a submodule's name, got {module!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"MixupCallback(seed=...) must be an int, got {seed!r}")


def check_unattached(mixer) -> None:
    """Refuse a mixer attached by hand (or by another adapter): the adapter attaches it itself."""
    if mixer.model is not None:
        raise RuntimeError(
            f"MixupCallback: {type(mixer).__name__} is already attached to a {type(mixer.model).__name__} "
            "(by hand, or by another callback); give the callback a mixer that is not attached: it "
            "attaches it to the trainer's model itself"
        )


class StepGuard:
    """Counts the training forwards of the hooked module in a step, and checks at the step's end that
    there was one and that the regularizer's mixed forwards had their loss taken by it.

    With ``count=True`` it counts them itself (a forward pre-hook on ``module``); an adapter that has its
    own pre-hook there counts in it (``guard.forwards += 1``)."""

    def __init__(self, hook: MixingHook, module: nn.Module, where: str, fix: str, count: bool = True):
        self.hook, self.where, self.fix = hook, where, fix
        self.forwards = 0
        self._handle = module.register_forward_pre_hook(self._count) if count else None
        own(self._handle)  # a copy of the module (an EMA) drops it

    def _count(self, module: nn.Module, args) -> None:
        if module.training:
            self.forwards += 1

    def begin(self) -> None:
        self.forwards = 0
        for seen in _forwards(self.hook):
            seen.claim_all()

    def check(self) -> None:
        if self.forwards == 0:
            raise RuntimeError(
                f"{self.where}: no training forward of the module the mixer is attached to ran in this step, "
                "so nothing was mixed; attach it to the module the step calls (the adapter's module=)"
            )
        layers = [seen.unclaimed() for seen in _forwards(self.hook)]
        layer = next((name for name in layers if name is not None), None)
        if layer is not None:
            raise RuntimeError(
                f"{self.where}: a training forward was mixed at {layer!r} but its loss was not taken "
                f"under the mix (the labels would not match the mixed logits); {self.fix}"
            )

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()


# ------------------------------------------------------------------ what the data gives the policies

PARTNERS = 1 << 30  # the partner draws' part in step_seed: none shared with a mixer's generators


def dataset_labels(dataset) -> torch.Tensor | None:
    """The class index of every sample of a map-style ``dataset`` (``None`` where they are not class
    indices): its ``targets``/``labels`` (torchvision's data sets), a ``TensorDataset``'s second tensor, or
    each sample's ``[1]`` or ``["labels"]`` read once."""
    for name in ("targets", "labels"):
        found = getattr(dataset, name, None)
        if isinstance(found, torch.Tensor | list) and len(found) == len(dataset):
            labels = torch.as_tensor(found)
            return labels if not labels.dtype.is_floating_point and labels.ndim == 1 else None
    tensors = getattr(dataset, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) >= 2:
        labels = tensors[1]
    elif "labels" in (getattr(dataset, "column_names", None) or ()):  # a HuggingFace datasets.Dataset
        labels = torch.as_tensor(dataset["labels"])
    else:
        labels = []
        for i in range(len(dataset)):  # (every sample read once: a data set that states them is faster)
            sample = dataset[i]
            label = sample.get("labels") if isinstance(sample, dict) else sample[1]
            if label is None:
                return None
            labels.append(torch.as_tensor(label))
        labels = torch.stack(labels) if labels else torch.zeros(0, dtype=torch.long)
    return labels if not labels.dtype.is_floating_point and labels.ndim == 1 else None


def count_classes(hook: MixingHook, labels: torch.Tensor | None, where: str) -> None:
    """Give every Remix of ``hook`` without class counts those of the training ``labels`` (refused in one
    line where the data set's labels are no class indices)."""
    from ..policies.targets import Remix

    for policy in (p for h in members(hook) for p in getattr(h, "policies", ())):
        if isinstance(policy, Remix) and policy.counts is None:
            if labels is None:
                raise ValueError(
                    f"{where}: Remix needs the training set's class counts, and its samples' labels are no "
                    "class indices; give them: Remix(counts=[...])"
                )
            policy.count(labels, int(labels.max()) + 1 if labels.numel() else 0)


def from_training_set(hook: MixingHook, loader, seed: int, where: str) -> PartnerStream | None:
    """What ``hook``'s policies need from the training set, read from the training ``loader`` when training
    starts: Remix's class counts (where not given, :func:`count_classes`) and, for a ``PartnerBatch``
    (Balanced-MixUp), the :class:`PartnerStream` of its class-balanced partner batches, drawn from the
    loader's data set with its collator (``None`` where the mixer takes none). Refused in one line: a
    loader without a map-style data set, labels that are no class indices."""
    partners = needs_partner_batch(hook)
    if not partners and not any(p.needs_classes for h in members(hook) for p in getattr(h, "policies", ())):
        return None
    dataset = getattr(loader, "dataset", None)
    if dataset is None or not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"{where}: {type(hook).__name__} needs the training set (its class counts, or a class-balanced "
            f"partner batch per step), but the training loader is a {type(loader).__name__} without a "
            "map-style data set; train from one DataLoader over a Dataset"
        )
    labels = dataset_labels(dataset)
    count_classes(hook, labels, where)
    if not partners:
        return None
    if labels is None:
        raise ValueError(
            f"{where}: the mixer mixes with a class-balanced partner batch, and the training set's labels "
            "are no class indices"
        )
    return PartnerStream(dataset, labels, loader.collate_fn, seed)


class PartnerStream:
    """Class-balanced partner batches for a mixer with a ``PartnerBatch`` (Balanced-MixUp's second loader):
    the batch of step ``step`` of rank ``rank`` holds ``n`` samples drawn with replacement, each class
    equally likely, from a generator seeded by ``(seed, rank, step)`` (:func:`step_seed`), so a resumed run
    draws what the uninterrupted one drew, every rank its own. ``collate`` makes the batch from the samples
    (the training loader's ``collate_fn``)."""

    def __init__(self, dataset, labels: torch.Tensor, collate, seed: int):
        self.weights = class_balanced_weights(labels)
        self.dataset, self.collate, self.seed = dataset, collate, seed

    def batch(self, rank: int, step: int, n: int, micro: int = 0):
        """The partner batch of ``n`` samples of step ``step`` of rank ``rank`` (``micro``: its micro-batch,
        under gradient accumulation where the step counts optimizer steps)."""
        g = torch.Generator().manual_seed(step_seed(self.seed, rank, step, PARTNERS + micro))
        index = torch.multinomial(self.weights, n, replacement=True, generator=g)
        return self.collate([self.dataset[int(i)] for i in index])

    def like(self, x: torch.Tensor, rank: int, step: int, micro: int = 0, key: str | None = None) -> tuple:
        """The partner inputs and labels ``(xp, yp)`` for a batch whose input is ``x`` (as many samples, on
        its device, in its dtype), for ``use_partners``: from a collated ``(x, y)`` pair or, by ``key``
        (the model's keyword input), from a mapping with ``labels``."""
        partner = self.batch(rank, step, x.shape[0], micro)
        if isinstance(partner, Mapping):
            xp, yp = partner[key], partner["labels"]
        else:
            xp, yp = partner[0], partner[1]
        return xp.to(x.device, x.dtype), yp.to(x.device)
