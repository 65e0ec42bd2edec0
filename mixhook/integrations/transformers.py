"""The HuggingFace ``Trainer``: a ``TrainerCallback`` and its ``compute_loss_func`` that mix at named layers
of any ``transformers`` model.

::

    from transformers import Trainer, TrainingArguments
    from mixhook import ManifoldMixup
    from mixhook.integrations.transformers import MixupCallback

    mixup = MixupCallback(ManifoldMixup("bert.encoder.layer.1", alpha=0.4))
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=..., eval_dataset=...,
                      callbacks=[mixup], compute_loss_func=mixup.compute_loss)
    trainer.train()

The Trainer's callbacks cannot change the forward or the loss, so the loss is ``compute_loss_func``:
:meth:`MixupCallback.compute_loss` takes the loss under the mix of the forward that produced the
outputs (``lam * loss(y) + (1 - lam) * loss(y[index])``), summed over the labelled items and divided by
the Trainer's ``num_items_in_batch`` (the labelled items of the whole accumulated batch, over every
process), so it is exact under ``gradient_accumulation_steps`` and across processes. An evaluation
forward (``evaluate()``, ``predict()``) is unmixed and its loss the plain one. The loss follows the
model's task: cross-entropy for class labels (token labels ``-100`` ignored, causal language models'
labels shifted as the model's own loss shifts them, ``label_smoothing_factor`` applied), mean squared
error for regression, binary cross-entropy for multi-label (``config.problem_type`` as the model reads
it); ``criterion=`` takes your own, summed over items.

TRL's ``SFTTrainer`` (a subclass of the Trainer) takes the same two arguments; it runs the model a
second time after each loss, without gradients, for its metrics: the callback leaves every training
forward without gradients unmixed (and draws nothing for it). Hooks that are not mixers (NEFTune,
InputScale, GradScale) go in a :class:`HookCallback`, which keys their draws by the step in the same way.

The callback attaches the regularizer to the model when the Trainer is made (``model_init``: when
training begins), draws each optimizer step's mixes from ``(seed, rank, step)`` (every process its own;
a resumed run the same as the uninterrupted one, from any checkpoint: :mod:`mixhook.integrations.draws`;
the seed is ``TrainingArguments.seed`` unless given, and is saved in ``trainer_state.json``), sets a
:class:`~mixhook.MixSchedule` from the epoch, and refuses in one line, before the optimizer step, a step
whose mixed forward's loss was not taken by it (``compute_loss_func`` not passed).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

try:
    from transformers import TrainerCallback
    from transformers.trainer import OPTIMIZER_NAME
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as error:  # pragma: no cover - the integrations extra installs it
    raise ImportError(
        "mixhook.integrations.transformers needs transformers: pip install 'mixhook[integrations]'"
    ) from error

from ..copies import own
from ..engine.contract import MixingHook, members
from ..layers import resolve_layer
from ..policies.partners import input_key
from ..schedule import MixSchedule
from .draws import (
    PartnerStream,
    StepGuard,
    check_arguments,
    check_unattached,
    from_training_set,
    join_optimizer,
    reseed,
    unwrapped,
)

_WHERE = "MixupCallback"
_FIX = "pass Trainer(..., compute_loss_func=callback.compute_loss) so the loss is taken under the mix"
IGNORE = -100  # the label the Trainer and the models ignore
LABELS = "mixhook_labels"  # the batch's labels under the key the Trainer leaves in (see _KeepLabels)


class _KeepLabels:
    """The training loader's collator, wrapped: each batch (a mapping with ``labels``) also holds its labels
    under :data:`LABELS`, which the Trainer leaves in the inputs when it takes ``labels`` out for
    ``compute_loss_func``; the callback's model pre-hook takes them out and gives them to the mixer. It
    runs wherever the collator runs (the loader's workers too) and travels with the loader (a resumed
    epoch's ``skip_first_batches`` copy)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, features):
        batch = self.collate(features)
        if isinstance(batch, Mapping) and isinstance(batch.get("labels"), torch.Tensor):
            batch[LABELS] = batch["labels"]
        return batch


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32, as the models' own losses take them; others as they are."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _causal(model) -> bool:
    """Whether ``model``'s own loss shifts the labels (predictions at ``i`` target label ``i + 1``): a
    decoder-only language model, by its loss type (``*ForCausalLM``) or, where that is unset
    (``GPT2LMHeadModel``), by transformers' list of causal language models."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - older transformers
        return False
    if LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss:
        return True
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


class _StepSeeded(TrainerCallback, ExportableState):
    """What both callbacks do around their hooks: refuse the Trainer's restoring of callback states, take
    the seed from the arguments, attach to the model (again under ``model_init``), and take back the seed
    a resumed run was trained with (``_resumed`` checks the rest of the saved state)."""

    seed: int | None
    _model = None
    _HOLDS = "its hooks"  # what a new callback made by the Trainer would be without

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if getattr(args, "restore_callback_states_from_checkpoint", False):
            raise ValueError(
                "restore_callback_states_from_checkpoint=True: the Trainer would replace mixhook's "
                f"{type(self).__name__} on resume by a new one without {self._HOLDS}; leave it False (the "
                "callback restores its own state from trainer_state.json)"
            )
        self._check_arguments(args)
        if self.seed is None:
            self.seed = int(args.seed)
        if model is not None:
            self._attach(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and model is not self._model:  # model_init: a new model per train()
            self._attach(model)
        saved = (state.stateful_callbacks or {}).get(type(self).__name__)
        if state.global_step > 0 and isinstance(saved, Mapping):  # resumed: the checkpoint's seed
            attributes = saved.get("attributes", {})
            self._resumed(attributes)
            if attributes.get("seed") is not None:
                self.seed = int(attributes["seed"])

    def _check_arguments(self, args) -> None:
        """Refuse ``TrainingArguments`` this callback cannot train with."""

    def _resumed(self, attributes: Mapping) -> None:
        """Refuse a checkpoint's saved state this callback cannot resume."""

    def _attach(self, model) -> None:
        raise NotImplementedError


class MixupCallback(_StepSeeded):
    """Mix at named layers of the Trainer's model; pass :meth:`compute_loss` as its ``compute_loss_func``.

    Args:
        mixer: the regularizer (:class:`~mixhook.ManifoldMixup`, a :class:`~mixhook.OneOf`, ...), not
            attached; its layers are named from the model (``"bert.encoder.layer.1"``,
            ``"model.layers.0"``; ``"inputs_embeds"`` selectors as in the core), or from ``module``.
        module: a submodule to attach to instead of the model (its layers then named from it).
        schedule: a :class:`~mixhook.MixSchedule` of ``mixer``, set before every optimizer step from the
            Trainer's fractional epoch.
        criterion: ``criterion(logits, labels)``: each sample's loss summed over its labelled items (one
            per sample; a 0-d sum over the batch serves the methods with one lam per batch), divided by
            ``num_items_in_batch``; ``None``: the model's task (see the module).
        seed: the draws' seed; ``None``: ``TrainingArguments.seed``.

    Every method trains here: the ones that need the labels before the forward (gradient saliency,
    SnapMix, C-Mixup) get the batch's ``labels`` (the Trainer takes them out of the batch before the
    forward; the callback's collator wrapper keeps them for it), Remix the training set's class counts, a
    ``PartnerBatch`` (Balanced-MixUp) a class-balanced partner batch per micro-batch from the training set
    (:class:`~mixhook.integrations.draws.PartnerStream`, appended to the model's keyword input), and the
    ones that keep the clean batch beside the mix (RegMixup, RankMixup, MixupE, ``clean=True``) have their
    loss taken over both halves (not under TRL's SFTTrainer, whose token metrics read ``B`` rows of logits:
    refused in one line).
    """

    def __init__(
        self,
        mixer: MixingHook,
        module: str | None = None,
        schedule: MixSchedule | None = None,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        seed: int | None = None,
    ):
        check_arguments(mixer, module, schedule, seed)
        if criterion is not None and not callable(criterion):
            raise TypeError(f"MixupCallback(criterion=...) must be callable, got {criterion!r:.80}")
        self.mixer, self.module, self.schedule, self.criterion = mixer, module, schedule, criterion
        self.seed = seed
        self.args = None  # the Trainer's TrainingArguments, from on_init_end
        self._model = None  # the model the mixer is attached to (or whose submodule)
        self._handle = None
        self._handle_no_grad = None
        self._handle_labels = None
        self._guard: StepGuard | None = None
        self._stream: PartnerStream | None = None  # a PartnerBatch mixer's class-balanced batches
        self._at = (0, 0, 0)  # (rank, optimizer step, micro-batch) of the next training forward
        self._group: int | None = None  # the optimizer group of the mixer's own parameters (AutoMix's)
        self._owns = False  # whether the mixer has parameters of its own (AutoMix's Mix Block)

    def __repr__(self) -> str:
        return f"MixupCallback({self.mixer!r}, module={self.module!r}, seed={self.seed})"

    # ------------------------------------------------------------------ attach, draws, the check

    _HOLDS = "its mixer"

    def _check_arguments(self, args) -> None:
        self.args = args
        clean = next((m for m in members(self.mixer) if getattr(m, "clean", False)), None)
        if clean is not None and type(args).__name__ == "SFTConfig":
            raise ValueError(
                f"MixupCallback: {type(clean).__name__} keeps the clean batch beside its mix (the logits "
                "have twice the batch's rows), which TRL's SFTTrainer's token metrics cannot read; train it "
                "with the Trainer, or a mixer with clean=False"
            )

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, **kwargs)
        optimizer, scheduler = kwargs.get("optimizer"), kwargs.get("lr_scheduler")
        self._owns = any(True for _ in self.mixer.parameters())
        if optimizer is not None and self._owns:  # the mixer's own parameters join the Trainer's optimizer
            if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
                raise ValueError(
                    f"MixupCallback: {type(self.mixer).__name__}'s own parameters are trained and saved "
                    "beside the Trainer's plain optimizer, not under its DeepSpeed or FSDP plugins; train it "
                    "with DDP or in one process (or under FSDP2 in your own loop)"
                )
            # (None: the optimizer given to the Trainer held them already)
            self._group = join_optimizer(self.mixer, optimizer, [scheduler] if scheduler is not None else [])
            if state.global_step > 0:  # resumed: the Mix Block, its copy (and its group's state)
                self._load_own(args, state, unwrapped(optimizer))
        self._stream = from_training_set(self.mixer, train_dataloader, self.seed, _WHERE)
        loader = train_dataloader
        while loader is not None:  # accelerate's DataLoaderShard iterates the loader it wraps
            collate = getattr(loader, "collate_fn", None)
            if callable(collate) and not isinstance(collate, _KeepLabels):
                loader.collate_fn = _KeepLabels(collate)
            loader = loader.__dict__.get("base_dataloader")

    # A mixer with parameters of its own (AutoMix's Mix Block and momentum copy) is not in the Trainer's
    # checkpoint, and the optimizer's saved group for it would not load into the Trainer's new optimizer
    # (loaded before any callback can add the group): each checkpoint's optimizer.pt is saved without that
    # group, which goes to mixhook.pt beside it with the mixer's state, and comes back at on_train_begin.
    _OWN = "mixhook.pt"

    def on_save(self, args, state, control, **kwargs):
        if not self._owns or not args.should_save:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        own = {"mixer": self.mixer.state_dict()}
        if self._group is not None:  # (the group this callback added: out of optimizer.pt, into mixhook.pt)
            path = os.path.join(folder, OPTIMIZER_NAME)
            saved = torch.load(path, weights_only=False)
            own["group"] = group = saved["param_groups"][self._group]
            own["state"] = {i: saved["state"].pop(i) for i in group["params"] if i in saved["state"]}
            del saved["param_groups"][self._group :]
            torch.save(saved, path)
        torch.save(own, os.path.join(folder, self._OWN))

    def _load_own(self, args, state, optimizer) -> None:
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}", self._OWN)
        if not os.path.exists(path):
            raise ValueError(
                f"MixupCallback: resuming {type(self.mixer).__name__} needs its own parameters' state, "
                f"saved beside each checkpoint as {self._OWN}; there is none at {path} (resume from a "
                "checkpoint of this output_dir that this callback saved)"
            )
        own = torch.load(path, weights_only=False)
        self.mixer.load_state_dict(own["mixer"])
        if self._group is None or "group" not in own:
            return  # (the optimizer given to the Trainer holds the Mix Block: its checkpoint has its state)
        group = optimizer.param_groups[self._group]
        group.update({k: v for k, v in own["group"].items() if k != "params"})
        for p, i in zip(group["params"], own["group"]["params"], strict=True):
            if i in own["state"]:
                optimizer.state[p] = {
                    k: v.to(p.device) if isinstance(v, torch.Tensor) and v.ndim else v
                    for k, v in own["state"][i].items()
                }

    def _resumed(self, attributes: Mapping) -> None:
        layers = attributes.get("layers")
        if layers is not None and list(layers) != list(self.mixer.specs):
            raise ValueError(
                f"MixupCallback: the checkpoint was trained mixing at {layers}, this mixer mixes at "
                f"{list(self.mixer.specs)}; resume with the same layers"
            )

    def on_step_begin(self, args, state, control, **kwargs):
        if self.schedule is not None:
            epoch = float(state.epoch or 0.0)
            self.schedule.set(int(epoch) + 1, epoch - int(epoch))
        reseed(self.mixer, self.seed, args.process_index, state.global_step)
        self._at = (args.process_index, state.global_step, 0)
        if self._guard is not None:
            self._guard.begin()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._guard is not None:
            self._guard.check()

    def on_optimizer_step(self, args, state, control, **kwargs):
        # the Trainer zeroes the model's gradients after each step (model.zero_grad()), not the optimizer's:
        # the mixer's own parameters' (AutoMix's Mix Block) would add up over the steps
        if self._owns:
            for p in self.mixer.parameters():
                p.grad = None

    def _attach(self, model) -> None:
        target = model if self.module is None else resolve_layer(model, self.module, "module")[1]
        if self._handle is not None:  # (model_init: off the previous trial's model)
            self._handle.remove()
            self._guard.remove()
            self._handle_no_grad.remove()
            self._handle_labels.remove()
        else:
            check_unattached(self.mixer)
        self._handle = self.mixer.attach(target)
        self._guard = StepGuard(self.mixer, target, _WHERE, _FIX)
        self._handle_no_grad = target.register_forward_pre_hook(self._without_gradients, prepend=True)
        self._handle_labels = model.register_forward_pre_hook(self._labels, prepend=True, with_kwargs=True)
        own(self._handle_no_grad)  # a copy of the model (an EMA) drops them
        own(self._handle_labels)
        self._model = model

    def _labels(self, module, args, kwargs):
        """The batch's labels, given to the mixer before the forward (the methods that need them then:
        gradient saliency, SnapMix's activation maps, C-Mixup's partners): the Trainer takes ``labels`` out
        of the batch before the forward, so the training loader's collator (:class:`_KeepLabels`) keeps a
        second reference under another key, taken out here before the model sees it."""
        labels = kwargs.pop(LABELS, None)
        if labels is None:
            return None
        if module.training and torch.is_grad_enabled():
            self.mixer.use_targets(labels)
            if self._stream is not None:
                self._use_partners(args, kwargs)
        return args, kwargs

    def _use_partners(self, args: tuple, kwargs: dict) -> None:
        """This micro-batch's class-balanced partner batch, as many as the batch, where its input is."""
        key = input_key(args, kwargs)
        x = args[0] if key is None else kwargs[key]
        rank, step, micro = self._at
        self._at = (rank, step, micro + 1)
        self.mixer.use_partners(*self._stream.like(x, rank, step, micro, key))

    def _without_gradients(self, module, args) -> None:
        """A training forward without gradients cannot train (TRL's SFTTrainer runs one after each loss,
        for its metrics): not mixed, and nothing drawn for it."""
        if module.training and not torch.is_grad_enabled():
            self.mixer.skip_next()

    def state(self) -> dict:
        """What ``trainer_state.json`` keeps (the Trainer saves it with each checkpoint): the draws' seed
        and the layers, read back when training resumes."""
        return {"args": {}, "attributes": {"seed": self.seed, "layers": list(self.mixer.specs)}}

    # ------------------------------------------------------------------------------ the loss

    def compute_loss(self, outputs, labels, num_items_in_batch=None) -> torch.Tensor:
        """The Trainer's ``compute_loss_func``: the loss under the mix of the forward that produced
        ``outputs`` (plain for an unmixed forward: evaluation), summed over the labelled items and
        divided by ``num_items_in_batch`` (without it, by this batch's labelled items)."""
        if labels is None:
            raise ValueError(
                "MixupCallback.compute_loss: the batch has no 'labels' (the Trainer passes batch['labels']); "
                "name the targets 'labels' in the dataset or collator"
            )
        if self._model is None:
            raise RuntimeError(
                "MixupCallback.compute_loss: the callback is not set up; pass it to the same Trainer "
                "(Trainer(..., callbacks=[callback], compute_loss_func=callback.compute_loss))"
            )
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        criterion = self.criterion or self._criterion
        total = self.mixer.loss(criterion, logits, labels)
        if total.ndim:  # one loss per row: the B samples', or a clean batch's 2B rows, whose mean is taken
            total = total.sum() / (total.shape[0] // labels.shape[0])
        if num_items_in_batch is None:
            if self._model.training and self.args is not None and self.args.gradient_accumulation_steps > 1:
                raise ValueError(
                    "MixupCallback.compute_loss: no num_items_in_batch under gradient_accumulation_steps "
                    "> 1, so the accumulated loss cannot be normalized exactly; give the batches tensor "
                    "'labels'"
                )
            num_items_in_batch = self._items(labels)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch

    def _items(self, labels: torch.Tensor) -> torch.Tensor | int:
        if labels.is_floating_point():
            return (
                labels.numel() if self._problem(labels) == "multi_label_classification" else labels.shape[0]
            )
        if _causal(self._model):
            labels = labels[..., 1:]
        return labels.ne(IGNORE).sum()

    def _problem(self, labels: torch.Tensor) -> str:
        """The task's loss, as a ``*ForSequenceClassification`` model of transformers picks it."""
        config = getattr(self._model, "config", None)
        problem = getattr(config, "problem_type", None)
        if problem:
            return problem
        if getattr(config, "num_labels", 2) == 1:
            return "regression"
        if labels.dtype in (torch.long, torch.int):
            return "single_label_classification"
        return "multi_label_classification"

    def _criterion(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's task's loss of each sample, summed over its labelled items (one per sample, so that
        a method weighing each sample's labels by a lam of its own can: PuzzleMix, SnapMix, TransMix)."""
        problem = self._problem(labels)
        dtype = _upcast(logits).dtype
        if problem == "regression":
            if getattr(getattr(self._model, "config", None), "num_labels", 1) == 1:
                return F.mse_loss(_upcast(logits.squeeze(-1)), labels.squeeze(-1).to(dtype), reduction="none")
            losses = F.mse_loss(_upcast(logits), labels.to(dtype), reduction="none")
        elif problem == "multi_label_classification":
            losses = F.binary_cross_entropy_with_logits(_upcast(logits), labels.to(dtype), reduction="none")
        else:
            if _causal(self._model):
                logits, labels = logits[..., :-1, :], labels[..., 1:]
            smoothing = float(getattr(self.args, "label_smoothing_factor", 0.0) or 0.0)
            losses = F.cross_entropy(
                _upcast(logits.reshape(-1, logits.shape[-1])),
                labels.reshape(-1),
                ignore_index=IGNORE,
                reduction="none",
                label_smoothing=smoothing,
            ).view(labels.shape)
        return losses.flatten(1).sum(1) if losses.ndim > 1 else losses


class HookCallback(_StepSeeded):
    """Attach mixhook's hooks that are not mixers (:class:`~mixhook.NEFTune`, :class:`~mixhook.InputScale`,
    :class:`~mixhook.GradScale`, :class:`~mixhook.GradClip`) to the Trainer's model, their draws keyed by
    ``(seed, rank, step)`` as :class:`MixupCallback`'s (a resumed run draws what the uninterrupted one
    drew); the loss needs nothing of them. Beside a ``MixupCallback`` or alone::

        neftune = HookCallback(NEFTune("model.embed_tokens", alpha=5.0))
        trainer = Trainer(model=model, args=args, train_dataset=..., callbacks=[neftune])

    A training forward without gradients (TRL's metrics pass) gets no noise (:class:`~mixhook.NEFTune`
    adds noise to the forwards that train). Refused in one line: a ``NEFTune`` beside the Trainer's own
    ``neftune_noise_alpha`` (the noise would be added twice), ``restore_callback_states_from_checkpoint``
    (the Trainer would replace this callback without its hooks).

    Args:
        hooks: the hooks, not attached; their layers named from the model.
        seed: the draws' seed; ``None``: ``TrainingArguments.seed``.
    """

    _FIRST_PART = 1 << 20  # the generators' parts in step_seed: none shared with a MixupCallback's

    def __init__(self, *hooks, seed: int | None = None):
        from ..hooks import LayerHook

        if not hooks or not all(isinstance(h, LayerHook) and not isinstance(h, MixingHook) for h in hooks):
            raise TypeError(
                "HookCallback needs mixhook hooks that are not mixers (NEFTune, InputScale, GradScale, ...), "
                f"got {hooks!r:.120}; a mixer goes in a MixupCallback"
            )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"HookCallback(seed=...) must be an int, got {seed!r}")
        for h in hooks:
            check_unattached(h)
        self.hooks, self.seed = hooks, seed
        self._model = None
        self._handles: list = []

    def __repr__(self) -> str:
        return f"HookCallback({', '.join(map(repr, self.hooks))}, seed={self.seed})"

    def _check_arguments(self, args) -> None:
        from ..lm.neftune import NEFTune

        alpha = getattr(args, "neftune_noise_alpha", None)
        if alpha is not None and any(isinstance(h, NEFTune) for h in self.hooks):
            raise ValueError(
                f"HookCallback: the Trainer's neftune_noise_alpha={alpha} adds HuggingFace's NEFTune noise "
                "beside mixhook's NEFTune, so the noise would be added twice; leave neftune_noise_alpha "
                "unset (None)"
            )

    def on_step_begin(self, args, state, control, **kwargs):
        for i, hook in enumerate(self.hooks):
            reseed(hook, self.seed, args.process_index, state.global_step, self._FIRST_PART + i)

    def _attach(self, model) -> None:
        for handle in self._handles:  # (model_init: off the previous trial's model)
            handle.remove()
        self._handles = [h.attach(model) for h in self.hooks]
        self._model = model

    def state(self) -> dict:
        """What ``trainer_state.json`` keeps: the draws' seed."""
        return {"args": {}, "attributes": {"seed": self.seed}}
