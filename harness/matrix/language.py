"""The matrix's rows of the hooks with a loss of their own (``hook.loss(model, inputs)``: NoiseFiT, SFTMix):
each made from its card's ``example`` (:class:`mixhook.engine.card.HookCard`) on a tiny Llama, trained two
steps of eight padded prompt-and-response rows (``-100`` on the prompts and the padding) in the workflows
that train a language model with such a loss: the hand loop, the HuggingFace Trainer and TRL's
``SFTTrainer`` (the trainer's class made of the Trainer mixins its card names, the hook in a
``HookCallback``), and the hand loop under DDP and FSDP2 (:mod:`.distributed`).

The hand loop (:func:`own_loop`) is what the Trainer promises: two micro-batches of four rows a step
(gradient accumulation), in the order its loader gives them (SFTMix's from
:class:`~mixhook.lm.confidence.PairedSampler`, seeded as ``PairedBatches`` seeds it, half confident and half
unconfident rows; the others in order), per step the hook's draws reseeded from ``(seed, rank, step)`` as
``HookCallback`` reseeds them, the loss ``hook.loss`` returns (SFTMix's sums over the step's tokens on
every process, :func:`step_counts`, as its mixin and the Trainer's own loss; NoiseFiT's each micro-batch's
mean over the micro-batches, as its authors'), SGD. The other workflows (Lightning, timm, the app) are not
for them: ``n/a`` with why.
"""

from __future__ import annotations

import tempfile

import torch

import mixhook.lm.noisefit  # noqa: F401  (its card in HOOKS)
import mixhook.lm.sftmix  # noqa: F401
from harness.language_models import tiny_llama
from mixhook.engine.card import HOOKS, build
from mixhook.integrations.draws import reseed

from .cells import BATCH, LR, SEED, STEPS
from .methods import Method

VOCAB, LENGTH = 64, 10
MICRO, ACCUMULATE = BATCH // 2, 2  # a step: two micro-batches of 4 rows (SFTMix's: 2 confident, 2 not)
CONFIDENT = "sftmix_confident"
NOT_HERE = (
    "a hook with a loss of its own, for language models: hook.loss in a loop, or its Trainer mixin (HF, TRL)"
)


def _hook(cls: type):
    return lambda prefix: build(cls, prefix, generator=torch.Generator().manual_seed(5))


HOOK_ROWS: list[Method] = [
    Method(name, _hook(cls), kind="lm") for name, cls in HOOKS.items() if cls.card.example is not None
]
"""The hooks with a loss of their own, in the order they are defined (their cards' ``example``)."""
BY_NAME = {m.name: m for m in HOOK_ROWS}


def model() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, max_position_embeddings=32)


def data(n: int, seed: int = 1) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """``n`` rows of ``LENGTH`` tokens: a prompt of 2 to 4 tokens and a response (the labels), then right
    padding to a length of 7 to 10 (pad id 0, masked, ``-100``); and each row's confident flag (half of
    them, at random)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, LENGTH), generator=g)
    mask, labels = torch.ones_like(ids), ids.clone()
    for i in range(n):
        prompt, length = 2 + i % 3, LENGTH - int(torch.randint(0, 4, (), generator=g))
        ids[i, length:], mask[i, length:] = 0, 0
        labels[i, :prompt], labels[i, length:] = -100, -100
    flags = torch.zeros(n, dtype=torch.bool)
    flags[torch.randperm(n, generator=g)[: n // 2]] = True
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}, flags.tolist()


def paired(method: Method) -> bool:
    return "PairedBatches" in HOOKS[method.name].card.trainer


def batches(method: Method, n: int) -> list[dict[str, torch.Tensor]]:
    """The ``n`` rows' micro-batches of ``MICRO``, in the order the Trainer's loader gives them (epoch 0)."""
    from mixhook.lm.confidence import PairedSampler

    rows, flags = data(n)
    if paired(method):
        order = torch.tensor(list(PairedSampler(flags, MICRO, seed=SEED)))
    else:
        order = torch.arange(n)
    return [{k: v[order[b : b + MICRO]] for k, v in rows.items()} for b in range(0, len(order), MICRO)]


def reseeded(hook, rank: int, step: int) -> None:
    """The hook's draws for ``(rank, step)``, as ``HookCallback`` reseeds its first hook."""
    from mixhook.integrations.transformers import HookCallback

    reseed(hook, SEED, rank, step, HookCallback._FIRST_PART)


def step_counts(hook, micro: list[dict]) -> torch.Tensor | None:
    """What divides the loss's sums over a step (its micro-batches on every process): the counts of a hook
    whose means are the step's (``hook.counts``: SFTMix's, NoiseFiT's with ``mean="step"``, as their
    Trainer mixins and the Trainer's own loss); ``None`` for one whose loss is each micro-batch's mean
    (NoiseFiT's by default, the authors', divided by the micro-batches)."""
    if getattr(hook, "mean", "step") != "step":
        return None
    return sum(hook.counts(b["labels"]) for b in micro)


def hand_step(hook, net, micro: list[dict], rank: int, step: int, counts=None, world: int = 1) -> None:
    """One step's forwards and backwards on this process's micro-batches: each loss over the step's
    ``counts`` times the processes (whose gradients DDP averages), or each micro-batch's mean over their
    number."""
    reseeded(hook, rank, step)
    for batch in micro:
        if counts is not None:
            loss = hook.loss(net, batch, counts)[0] * world
        else:
            loss = hook.loss(net, batch)[0] / len(micro)
        loss.backward()


def mine(drawn: list[dict], step: int, rank: int, world: int) -> list[dict]:
    """Rank ``rank``'s micro-batches of step ``step`` (accelerate hands the processes whole batches in
    turn)."""
    return [drawn[(step * ACCUMULATE + m) * world + rank] for m in range(ACCUMULATE)]


def own_loop(method: Method, drawn: list[dict] | None = None) -> list[torch.Tensor]:
    """The hand loop on ``drawn`` (the micro-batches in order; default: its own)."""
    net, hook = model(), method.make("")
    drawn = drawn or batches(method, STEPS * BATCH)
    with hook.attach(net):
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step in range(STEPS):
            micro = mine(drawn, step, 0, 1)
            hand_step(hook, net, micro, 0, step, step_counts(hook, micro))
            opt.step()
            opt.zero_grad()
    return list(net.parameters())


def _trainer_class(method: Method, base: type) -> type:
    from mixhook.integrations import lm as adapter

    mixins = tuple(getattr(adapter, name) for name in HOOKS[method.name].card.trainer)
    return type(f"{method.name}Trainer", (*mixins, base), {})


def _settings(out: str, method: Method) -> dict:
    return dict(
        output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS, optim="sgd", learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=0, weight_decay=0.0, report_to=[], save_strategy="no",
        use_cpu=True, seed=SEED, logging_strategy="no", disable_tqdm=True,
        train_sampling_strategy="random" if paired(method) else "sequential",
    )  # fmt: skip


def hf(method: Method) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The HuggingFace Trainer (its class of the card's mixins, the hook in a ``HookCallback``) on the
    rows, and the hand loop."""
    import datasets
    import transformers

    from mixhook.integrations.transformers import HookCallback

    rows, flags = data(STEPS * BATCH)
    table = datasets.Dataset.from_dict({**{k: v.tolist() for k, v in rows.items()}, CONFIDENT: flags})
    net = model()
    with tempfile.TemporaryDirectory() as out:
        _trainer_class(method, transformers.Trainer)(
            model=net, args=transformers.TrainingArguments(**_settings(out, method)), train_dataset=table,
            callbacks=[HookCallback(method.make(""))],
        ).train()  # fmt: skip
    return list(net.parameters()), own_loop(method)


def trl(method: Method) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """TRL's ``SFTTrainer`` (its class of the card's mixins) on the rows as prompt and completion tokens
    (its collator pads them and writes the labels), and the hand loop on the batches its loader gave."""
    import datasets
    import trl as trl_

    from harness.language_models import tokenizer
    from mixhook.integrations.transformers import HookCallback

    rows, flags = data(STEPS * BATCH)
    listed = []
    for i, flag in enumerate(flags):
        length = int(rows["attention_mask"][i].sum())
        prompt = int((rows["labels"][i, :length] == -100).sum())
        completion = [0] * prompt + [1] * (length - prompt)
        listed.append({"input_ids": rows["input_ids"][i, :length].tolist(), "completion_mask": completion,
                       CONFIDENT: flag})  # fmt: skip
    net = model()
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer_class(method, trl_.SFTTrainer)(
            model=net, args=trl_.SFTConfig(**_settings(out, method), completion_only_loss=True),
            train_dataset=datasets.Dataset.from_list(listed), processing_class=tokenizer(),
            callbacks=[HookCallback(method.make(""))],
        )  # fmt: skip
        drawn = list(trainer.get_train_dataloader())[: STEPS * ACCUMULATE]
        trainer.train()
    keys = ("input_ids", "attention_mask", "labels")
    return list(net.parameters()), own_loop(method, [{k: b[k] for k in keys} for b in drawn])


# ------------------------------------------------------------------------------------ DDP and FSDP2


def distributed(method: Method, mode: str, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's hand loop under ``mode`` (``"ddp"``, or ``"fsdp"``: each decoder layer sharded, then the
    model) on its micro-batches of each step (:func:`mine`), SFTMix's sums over the step's counts on every
    process (as its Trainer mixin gathers them): the full weights."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if mode not in ("ddp", "fsdp"):
        raise ValueError(f"the language-model rows run under ddp and fsdp, not {mode!r}")
    net, hook = model(), method.make("")
    drawn = batches(method, STEPS * BATCH * world)
    if mode == "ddp":
        wrapped = DistributedDataParallel(net)
    else:  # (as users shard a decoder: each layer, then the root)
        for layer in net.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(net)
    with hook.attach(net):
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step in range(STEPS):
            every = [b for r in range(world) for b in mine(drawn, step, r, world)]
            counts = step_counts(hook, every)  # (every process's: as SFTMixLoss gathers them)
            hand_step(hook, wrapped, mine(drawn, step, rank, world), rank, step, counts, world)
            opt.step()
            opt.zero_grad()
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in net.parameters()]


def replayed(method: Method, world: int) -> list[torch.Tensor]:
    """Every rank's batches in one process, each with its rank's draws, the gradients averaged."""
    net, hook = model(), method.make("")
    drawn = batches(method, STEPS * BATCH * world)
    with hook.attach(net):
        opt = torch.optim.SGD(net.parameters(), lr=LR)
        for step in range(STEPS):
            grads = []
            counts = step_counts(hook, [b for r in range(world) for b in mine(drawn, step, r, world)])
            for rank in range(world):
                hand_step(hook, net, mine(drawn, step, rank, world), rank, step, counts, world)
                grads.append([p.grad.clone() for p in net.parameters()])
                opt.zero_grad()
            for p, *gs in zip(net.parameters(), *grads, strict=True):
                p.grad = sum(gs) / world
            opt.step()
            opt.zero_grad()
    return [p.detach() for p in net.parameters()]
