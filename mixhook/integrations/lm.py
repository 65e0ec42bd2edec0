"""The HuggingFace ``Trainer``'s mixins for the hooks with a loss of their own (:mod:`mixhook.lm`): their
loss as the trainer's (:class:`SFTMixLoss`, :class:`NoiseFiTLoss`), and SFTMix's data side in the Trainer
(:class:`PairedBatches`, :class:`ReferenceCheckpoints`, :func:`reference_models`). TRL's ``SFTTrainer`` is
a subclass of the Trainer: they mix into it alike. The hook itself goes in a
:class:`~mixhook.integrations.transformers.HookCallback`, which attaches it and keys its draws by the step::

    class SFTMixTrainer(SFTMixLoss, PairedBatches, SFTTrainer):
        pass

    trainer = SFTMixTrainer(model=model, args=args, train_dataset=data,
                            callbacks=[HookCallback(SFTMix("model.norm"))])
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

try:
    from transformers import TrainerCallback
except ImportError as error:  # pragma: no cover - the integrations extra installs it
    raise ImportError(
        "mixhook.integrations.lm needs transformers: pip install 'mixhook[integrations]'"
    ) from error

from ..lm import NoiseFiT, SFTMix
from ..lm.confidence import PairedSampler
from .transformers import HookCallback


class _StepMeans:
    """What the loss mixins share: a step's counts (:meth:`~mixhook.lm.protocol.LossHook.counts` of its
    micro-batches' labels, added over them and, where ``average_tokens_across_devices``, over the
    processes), handed to the hook's ``loss`` for each of the step's micro-batches in turn."""

    _step_counts = None  # (the step's counts and how many of its micro-batches are still to come)

    def _count_step(self, hook, batches: list, device) -> None:
        counts = sum(
            (hook.counts(b["labels"].to(device)) for b in batches if "labels" in b),
            torch.zeros(2, dtype=torch.long, device=device),
        )
        if self._across_devices():
            counts = self.accelerator.gather(counts).view(-1, 2).sum(0)
        self._step_counts = [counts, len(batches)]

    def _next_counts(self, model) -> torch.Tensor | None:
        """The step's counts for one of its training micro-batches (``None`` outside them)."""
        step = self._step_counts
        if model.training and torch.is_grad_enabled() and step is not None and step[1] > 0:
            step[1] -= 1
            return step[0]
        return None

    def _across_devices(self) -> bool:
        return bool(self.args.average_tokens_across_devices) and self.args.world_size > 1


class NoiseFiTLoss(_StepMeans):
    """A ``Trainer``'s loss as NoiseFiT trains (:class:`~mixhook.NoiseFiT`: one
    clean and two noisy forwards in ``compute_loss``, which a callback cannot change, as the authors'
    ``NoiseFitTrainer`` does). Mix it into the trainer's class, its hook in a :class:`HookCallback` (which
    attaches it and keys its draws by ``(seed, rank, step)``)::

        class NoiseFiTTrainer(NoiseFiTLoss, Trainer):
            pass

        nf = NoiseFiT(choose_layers(model, batch))  # mixhook.lm.noisefit.choose_layers
        trainer = NoiseFiTTrainer(model=model, args=args, train_dataset=..., callbacks=[HookCallback(nf)])

    Under ``gradient_accumulation_steps``, with the authors' means (``NoiseFiT(mean="batch")``, the
    default) the loss of each micro-batch (a mean over its tokens) is divided by the step's micro-batches,
    so the gradient is their mean (the authors' subclass leaves that to the Trainer, which does not divide
    for a model that takes loss keywords when it counts the batch's items: their gradient is then
    ``gradient_accumulation_steps`` times as large). With ``NoiseFiT(mean="step")`` each micro-batch's sums
    are divided by the step's tokens (:meth:`mixhook.NoiseFiT.counts` added over its micro-batches and,
    where ``average_tokens_across_devices``, its processes, the loss then multiplied by the processes,
    which DDP's mean divides again), as the Trainer's own causal LM loss (``num_items_in_batch``).
    An evaluation forward runs the same three forwards without noise, its means the batch's. With TRL's
    ``SFTTrainer`` (a subclass of the Trainer: ``class NoiseFiTSFTTrainer(NoiseFiTLoss, SFTTrainer)``) the
    weights are the hand loop's on its collator's batches (completion-only labels, padding, accumulation);
    its own loss and token metrics are replaced. Refused in one line: no ``NoiseFiT`` in the trainer's
    ``HookCallback`` callbacks, or more than one; a setting the replaced loss would drop
    (``label_smoothing_factor``, ``compute_loss_func``, TRL's ``loss_type`` other than ``"nll"``, a router's
    auxiliary loss, ``use_liger_kernel``); tensor, context or sequence parallelism and ``DataParallel``.
    """

    @property
    def loss_is_scaled_for_ga(self) -> bool:  # (read by the Trainer after compute_loss)
        return _the_hook(self, NoiseFiT, "NoiseFiTLoss").mean == "step"

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        hook = _the_hook(self, NoiseFiT, "NoiseFiTLoss")
        self._step_counts = None
        if hook.mean == "step":
            self._count_step(hook, batches, device)
        return batches, items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _refuse_what_the_loss_drops(self, "NoiseFiTLoss")
        counts = self._next_counts(model)
        loss, outputs = _the_hook(self, NoiseFiT, "NoiseFiTLoss").loss(model, inputs, counts)
        if counts is not None and self._across_devices():
            loss = loss * self.accelerator.num_processes  # (DDP averages the processes' gradients)
        return (loss, outputs) if return_outputs else loss


def _refuse_what_the_loss_drops(trainer, where: str) -> None:
    """One line where the trainer is set to shape its loss in a way a mixin's own loss (NoiseFiT's,
    SFTMix's) would drop without a word, or to cut each batch between devices in a way it does not read."""
    args = trainer.args
    dropped = []
    if getattr(args, "label_smoothing_factor", 0.0):
        dropped.append(f"label_smoothing_factor={args.label_smoothing_factor}")
    if getattr(trainer, "compute_loss_func", None) is not None:
        dropped.append("compute_loss_func")
    if getattr(args, "loss_type", "nll") not in ("nll", "chunked_nll"):  # (TRL's SFTConfig)
        dropped.append(f"loss_type={args.loss_type!r}")
    if getattr(trainer, "aux_loss_enabled", False):
        dropped.append("the router's auxiliary loss (router_aux_loss_coef)")
    if getattr(args, "use_liger_kernel", False):
        dropped.append("use_liger_kernel")
    if dropped:
        raise ValueError(
            f"{where} replaces the trainer's loss, so {', '.join(dropped)} would be dropped; unset it, or "
            "train without the mixin"
        )
    sizes = {
        name: int(getattr(trainer, f"get_{name}_size", lambda: 1)()) for name in ("tp", "cp", "sp")
    }  # fmt: skip
    cut = {name: size for name, size in sizes.items() if size > 1}
    if cut or args.n_gpu > 1:
        why = ", ".join(f"{n}_size={v}" for n, v in cut.items()) or f"DataParallel over {args.n_gpu} GPUs"
        raise ValueError(
            f"{where}: {why} cuts each batch between devices, which its loss does not read; train with one "
            "process per device (DDP, FSDP) without tensor, context or sequence parallelism"
        )


def _the_hook(trainer, cls: type, where: str):
    """The one ``cls`` hook of the trainer's HookCallbacks (one line where there is none, or more)."""
    found = [
        hook
        for callback in trainer.callback_handler.callbacks
        if isinstance(callback, HookCallback)
        for hook in callback.hooks
        if isinstance(hook, cls)
    ]
    if len(found) != 1:
        name = cls.__name__
        raise ValueError(
            f"{where}: the trainer's HookCallbacks hold {len(found)} {name} hooks; give it one, "
            f"callbacks=[HookCallback({name}(...))]"
        )
    return found[0]


class SFTMixLoss(_StepMeans):
    """A mixin for the Trainer (TRL's ``SFTTrainer`` too) whose loss is SFTMix's (:class:`mixhook.SFTMix`):
    its ``compute_loss`` runs :meth:`~mixhook.SFTMix.loss`, one forward with the mixed rows after the clean
    ones, ``l_NTP + mu * l_mixup``; with :class:`PairedBatches`, its batches are SFTMix's pairs::

        class SFTMixTrainer(SFTMixLoss, PairedBatches, SFTTrainer):
            pass

        trainer = SFTMixTrainer(model=model, args=args, train_dataset=data,  # data: its sftmix_confident
                                callbacks=[HookCallback(SFTMix("model.norm"))])

    The loss's two means are the step's, as the Trainer's own causal LM loss is (``num_items_in_batch``):
    each micro-batch's sums are divided by the labelled and the mixed tokens of all the step's micro-batches
    (:meth:`mixhook.SFTMix.counts`), of every process where ``average_tokens_across_devices`` (the default;
    the loss then multiplied by the processes, which DDP's mean divides again), so that with ``mu=0`` the
    weights are those the Trainer's own loss trains; a call outside a step's micro-batches (after
    ``train()``) is the batch's own mean. An evaluation forward is the plain loss, divided by the Trainer's
    ``num_items_in_batch`` where it counts one, as its own. With TRL's ``SFTTrainer`` its own loss, and the
    token metrics it logs, are replaced. Refused in one line: a trainer whose training batches are not
    :class:`PairedBatches`' (without it, row ``k`` would be mixed with row ``k + B // 2`` of a shuffled
    batch: random pairs, not SFTMix's), before its first step; no ``SFTMix`` in the trainer's
    ``HookCallback`` callbacks, or more than one; a setting the replaced loss would drop
    (``label_smoothing_factor``, ``compute_loss_func``, TRL's ``loss_type`` other than ``"nll"``, a router's
    auxiliary loss, ``use_liger_kernel``); tensor, context or sequence parallelism and ``DataParallel``."""

    loss_is_scaled_for_ga = True  # (each micro-batch's loss divided by the step's counts)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if not isinstance(getattr(self, "_paired", None), PairedSampler):  # (before the step's first batch)
            raise ValueError(
                "SFTMixLoss: the trainer's training batches are not SFTMix's pairs (PairedBatches' "
                "confident and unconfident halves), so it would mix random pairs of each batch; put "
                "PairedBatches in the trainer's class: class T(SFTMixLoss, PairedBatches, Trainer)"
            )
        batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._count_step(_the_hook(self, SFTMix, "SFTMixLoss"), batches, device)
        return batches, items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        _refuse_what_the_loss_drops(self, "SFTMixLoss")
        inputs = {**inputs, "use_cache": False}  # (a training forward builds no key-value cache)
        counts = self._next_counts(model)  # (one of the step's micro-batches: its counts)
        if counts is None and not model.training and num_items_in_batch is not None:
            items = torch.as_tensor(num_items_in_batch).reshape(())  # (an evaluation: as the Trainer's)
            counts = torch.stack([items, torch.ones_like(items)])
        loss, outputs = _the_hook(self, SFTMix, "SFTMixLoss").loss(model, inputs, counts)
        if counts is not None and self._across_devices():
            loss = loss * self.accelerator.num_processes  # (DDP averages the processes' gradients)
        return (loss, outputs) if return_outputs else loss


REFERENCE = "reference.json"  # the list of a reference run's checkpoints, in its directory
CONFIDENT = "sftmix_confident"  # the data set's column of the split (mixhook.lm.confidence.split)


class ReferenceCheckpoints(TrainerCallback):
    """SFTMix's reference run: the model's weights saved ``count`` times, evenly over the run (after steps
    ``round(k * max_steps / count)``, ``k = 1..count``), each with ``save_pretrained`` into
    ``directory/step-<step>`` (an adapter's alone for a PEFT model), listed in ``directory/reference.json``
    with the run's ``max_steps`` and ``count``, by the main process only (a model whole on each process:
    FSDP's shards and DeepSpeed ZeRO-3's partitions are refused in one line). A fresh run starts a new
    list; a resumed one keeps the checkpoints saved before its step and saves the rest (a list of another
    run's settings is refused). :func:`reference_models` loads them for
    :func:`mixhook.lm.confidence.confidence`.

    Args:
        directory: where the checkpoints go (default: ``<output_dir>/reference``).
        count: how many (the paper does not say; 3 by default).
    """

    def __init__(self, directory: str | os.PathLike | None = None, count: int = 3):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"ReferenceCheckpoints: count must be an int >= 1, got {count!r}")
        self.directory, self.count, self._steps = directory, count, frozenset()

    def on_train_begin(self, args, state, control, **kwargs):
        _refuse_sharded(args)
        if state.max_steps < self.count:
            raise ValueError(
                f"ReferenceCheckpoints: {self.count} checkpoints over a run of {state.max_steps} steps; "
                "give count <= the run's steps"
            )
        self._steps = frozenset(round(k * state.max_steps / self.count) for k in range(1, self.count + 1))
        if self.directory is None:
            self.directory = os.path.join(args.output_dir, "reference")
        if not state.is_world_process_zero:
            return
        listed = _listing(self.directory)
        if listed is not None and state.global_step == 0:  # (a fresh run: a new list)
            os.remove(os.path.join(self.directory, REFERENCE))
        elif listed is not None and (listed["max_steps"], listed["count"]) != (state.max_steps, self.count):
            raise ValueError(
                f"ReferenceCheckpoints: {self.directory} lists the checkpoints of a run of "
                f"{listed['max_steps']} steps and count {listed['count']}; this one resumes with "
                f"{state.max_steps} and {self.count}"
            )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step not in self._steps or not state.is_world_process_zero:
            return
        import json

        name = f"step-{state.global_step}"
        model.save_pretrained(os.path.join(self.directory, name))  # (callbacks get the model, not DDP's)
        listed = _listing(self.directory) or {}
        saved = [n for n in listed.get("checkpoints", []) if _step_of(n) < state.global_step]
        listing = os.path.join(self.directory, REFERENCE)
        with open(listing + ".tmp", "w") as f:
            json.dump({"checkpoints": [*saved, name], "max_steps": state.max_steps, "count": self.count}, f)
        os.replace(listing + ".tmp", listing)  # (never a half-written list)


def _refuse_sharded(args) -> None:
    """One line where the main process would hold a part of the model: FSDP, DeepSpeed ZeRO-3."""
    sharded = bool(getattr(args, "fsdp", None))
    try:
        from accelerate.state import AcceleratorState, DistributedType

        sharded |= AcceleratorState._shared_state.get("distributed_type") == DistributedType.FSDP
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        sharded |= bool(is_deepspeed_zero3_enabled())
    except ImportError:  # pragma: no cover - accelerate comes with the Trainer
        pass
    if sharded:
        raise ValueError(
            "ReferenceCheckpoints saves the model of the main process, which under FSDP or DeepSpeed ZeRO-3 "
            "holds a part of it; run the reference fine-tuning with DDP or on one device"
        )


def _listing(directory) -> dict | None:
    import json

    path = os.path.join(directory, REFERENCE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _step_of(name: str) -> int:
    return int(name.rsplit("step-", 1)[1])


def reference_models(
    directory: str | os.PathLike, loader: Callable | None = None, **kwargs
) -> list[Callable]:
    """The reference run's checkpoints (``directory``, :class:`ReferenceCheckpoints`'), as functions that
    each load one when called (:func:`mixhook.lm.confidence.confidence` loads them one at a time): with
    ``loader`` (``loader(path)``), else ``AutoModelForCausalLM.from_pretrained(path, **kwargs)``, or PEFT's
    ``AutoPeftModelForCausalLM`` for an adapter's (each by its absolute path: a local directory, never a
    Hub name). One line where the directory lists none."""
    listed = _listing(directory)
    if listed is None:
        raise FileNotFoundError(
            f"reference_models: no {REFERENCE} in {directory} (ReferenceCheckpoints writes it)"
        )
    paths = [os.path.abspath(os.path.join(directory, name)) for name in listed["checkpoints"]]

    def load(path):
        if loader is not None:
            return loader(path)
        if os.path.exists(os.path.join(path, "adapter_config.json")):
            from peft import AutoPeftModelForCausalLM

            return AutoPeftModelForCausalLM.from_pretrained(path, **kwargs)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, **kwargs)

    return [lambda path=path: load(path) for path in paths]


class PairedBatches:
    """A mixin for the Trainer (TRL's ``SFTTrainer`` too) whose training batches are SFTMix's: each half
    confident, half unconfident examples, paired row ``k`` with row ``k + B // 2``
    (:class:`mixhook.lm.confidence.PairedSampler`, seeded by ``TrainingArguments.data_seed``, else ``seed``),
    from the training set's ``sftmix_confident`` column (:func:`mixhook.lm.confidence.split`'s flags)::

        class SFTMixTrainer(PairedBatches, SFTTrainer):
            pass

    Each micro-batch of a gradient accumulation and each process's batch under DDP holds its own pairs (a
    process is handed whole batches); each epoch is shuffled anew, and a resumed epoch, on any number of
    processes, draws the uninterrupted one's batches. Refused in one line: no such column, an odd
    ``per_device_train_batch_size``, a data set without a length (a stream, which no sampler orders), a
    ``train_sampling_strategy`` other than ``"random"`` (the pairing replaces it), and a batch that is cut
    between processes or devices (``accelerator_config.split_batches``, ``DataParallel`` over several
    GPUs: each part would hold one half)."""

    _paired = None  # (the sampler of the training loader, whose epoch _run_epoch sets)

    def get_train_dataloader(self):
        from collections.abc import Sized

        if not isinstance(self.train_dataset, Sized):
            raise ValueError(
                "PairedBatches: the training set has no length (a stream); SFTMix's paired batches need a "
                "data set (datasets.Dataset, or one with __len__)"
            )
        return super().get_train_dataloader()

    def _get_train_sampler(self, train_dataset=None):
        args = self.args
        if args.train_sampling_strategy != "random":
            raise ValueError(
                f"PairedBatches: train_sampling_strategy={args.train_sampling_strategy!r} would be replaced "
                "by SFTMix's pairing; leave it 'random'"
            )
        split = getattr(getattr(args, "accelerator_config", None), "split_batches", False)
        if split or args.n_gpu > 1:
            why = "accelerator_config.split_batches" if split else f"DataParallel over {args.n_gpu} GPUs"
            raise ValueError(
                f"PairedBatches: {why} cuts each batch between devices, and each part would hold one half of "
                "its pairs; run one process per device (torchrun, accelerate launch) without split_batches"
            )
        data = self.train_dataset
        columns = getattr(data, "column_names", None) or []
        if CONFIDENT not in columns:
            raise ValueError(
                f"PairedBatches: the training set has no {CONFIDENT!r} column (columns: {columns}); add "
                "mixhook.lm.confidence.split's flags with dataset.add_column"
            )
        seed = args.data_seed if args.data_seed is not None else args.seed
        self._paired = PairedSampler(list(data[CONFIDENT]), self._train_batch_size, seed=seed)
        return self._paired

    def _run_epoch(self, *args, **kwargs):
        # (the Trainer sets the epoch through the loader, which a resumed epoch's skip_first_batches wraps
        # beyond its reach on several processes: set it on the sampler itself)
        epoch = kwargs["epoch"] if "epoch" in kwargs else args[1]
        if self._paired is not None:
            self._paired.set_epoch(epoch)
        return super()._run_epoch(*args, **kwargs)
