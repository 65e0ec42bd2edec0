"""Case: SFTMix (issue 85). A small Llama's training step on a paired, right-padded batch with
completion-only labels: SFTMix's (``mix.loss``: one forward, the ``B`` mixed rows after the clean ones at
the final norm, ``l_NTP + mu * l_mixup``) against a minimal hand-written SFTMix (the same mix in a plain
forward hook at the norm and the same loss, its lams drawn from ``torch.distributions.Beta``: what a
researcher writes for one model, without checks) and against plain next-token prediction; the aten ops of
each step. And the scoring of SFTMix's data side: ``mixhook.lm.confidence.response_perplexity`` over the
batch's examples against a hand-batched scoring of the same padded batch (one forward under ``no_grad``,
its cross-entropy), and against a plain training step on them."""

from __future__ import annotations

import copy
import statistics

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from benchmarks.cases.host import Census
from benchmarks.cases.language_model import VOCAB, llama, llama_name
from benchmarks.timing import ratio
from mixhook import SFTMix
from mixhook.lm.confidence import response_perplexity

IGNORE = -100


def _batch(batch: int, length: int, vocab: int, device):
    """Right-padded rows of 60 to 100% of ``length``, their first eighth a prompt (``-100``)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for i in range(batch):
        used = length - (i * 2 * length) // (5 * batch)
        mask[i, used:], ids[i, used:] = 0, 0
        labels[i, : length // 8], labels[i, used:] = IGNORE, IGNORE
    return ids.to(device), mask.to(device), labels.to(device)


def _hand(model, labels, alpha: float = 0.5, mu: float = 0.2):
    """A minimal hand-written SFTMix: a forward hook at the final norm that appends the mixed rows, and its
    loss; the same computation as mixhook's, with nothing checked."""
    n, length = labels.shape
    index = torch.arange(n, device=labels.device).roll(n // 2)
    beta = torch.distributions.Beta(torch.tensor(alpha), torch.tensor(alpha))
    drawn = {}

    def plan():
        valid = labels != IGNORE
        valid[:, 0] = False
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
        counts = valid.sum(1)
        ok = torch.arange(length, device=labels.device)[None] < torch.minimum(counts, counts[index])[:, None]
        half = beta.sample((n // 2,)).to(labels.device)
        lam = torch.cat([half, 1 - half])
        own_y = torch.full_like(labels, IGNORE).scatter(
            1, order, torch.where(ok, labels.gather(1, order), IGNORE)
        )
        other_y = torch.full_like(labels, IGNORE).scatter(
            1, order, torch.where(ok, labels[index].gather(1, order[index]), IGNORE)
        )
        drawn.update(own=(order - 1).clamp(min=0), other=(order[index] - 1).clamp(min=0), ok=ok, lam=lam,
                     own_y=own_y, other_y=other_y)  # fmt: skip

    def hook(module, args, h):
        d = h.shape[-1]
        own, lam = drawn["own"][..., None].expand(-1, -1, d), drawn["lam"].to(h.dtype)[:, None, None]
        mine = h.gather(1, own)
        theirs = h[index].gather(1, drawn["other"][..., None].expand(-1, -1, d))
        blend = (lam * mine + (1 - lam) * theirs) * drawn["ok"][..., None].to(h.dtype)
        return torch.cat([h, torch.zeros_like(h).scatter_add(1, own, blend)])

    def each(logits, y):
        flat = F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), reduction="none")
        return flat.view(n, -1)

    def loss(logits):
        clean, mixed = logits[:n], logits[n:]
        ntp = each(clean, labels).sum() / (labels[:, 1:] != IGNORE).sum()
        lam = drawn["lam"][:, None]
        mix = lam * each(mixed, drawn["own_y"]) + (1 - lam) * each(mixed, drawn["other_y"])
        return ntp + mu * mix.sum() / (drawn["own_y"][:, 1:] != IGNORE).sum().clamp(min=1)

    model.model.norm.register_forward_hook(hook)
    return plan, loss


def sftmix(device, timer, reps, inner, batch, length, hidden) -> dict:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"note": "transformers is not installed (pip install -e '.[dev]')"}
    base = llama(device, hidden, length)
    ids, mask, labels = _batch(batch, length, VOCAB, device)
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    tokens = {"input_ids": ids, "attention_mask": mask}

    def make(kind: str):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if kind == "sftmix":
            mix = SFTMix("model.norm")
            mix.attach(model)

            def loss():
                return mix.loss(model, {**inputs, "use_cache": False})[0]

        elif kind == "hand":
            plan, of = _hand(model, labels)

            def loss():
                plan()
                return of(model(**tokens, use_cache=False).logits)

        else:

            def loss():
                logits = model(**tokens, use_cache=False).logits
                return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

        def step():
            value = loss()
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()

        return step

    steps = {k: make(k) for k in ("none", "hand", "sftmix")}
    times = timer.side_by_side(steps, reps=reps, inner=inner, warmup=2)
    census = {}
    for name, step in steps.items():
        with Census() as seen:
            step()
        census[name] = sum(seen.ops.values())
    return {
        "model": llama_name(hidden),
        "batch": batch,
        "length": length,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_none": {k: ratio(times, k, "none") for k in times if k != "none"},
        "sftmix_vs_hand": ratio(times, "sftmix", "hand"),
        "aten_ops": census,
        "scoring": scoring(base, ids, mask, labels, timer, reps, inner, steps["none"]),
    }


def scoring(model, ids, mask, labels, timer, reps, inner, train_step) -> dict:
    """``response_perplexity`` of the batch's examples (as unpadded rows, one batch of them) against a
    hand-batched scoring of the padded batch and against a plain training step on it."""
    n = ids.shape[0]
    rows = []
    for i in range(n):
        used = int(mask[i].sum())
        rows.append({"input_ids": ids[i, :used].tolist(), "labels": labels[i, :used].tolist()})
    scored = labels.clone()
    scored[:, 0] = IGNORE

    @torch.no_grad()
    def hand():
        model.eval()
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        flat = F.cross_entropy(logits[:, :-1].flatten(0, 1), scored[:, 1:].flatten(), reduction="none")
        nll = flat.view(n, -1).sum(1) / (scored[:, 1:] != IGNORE).sum(1)
        out = nll.double().exp().cpu()
        model.train()
        return out

    def mixhook_scoring():
        return response_perplexity(model, rows, batch_size=n)

    torch.testing.assert_close(mixhook_scoring(), hand(), rtol=1e-4, atol=0)  # (the same perplexities)
    times = timer.side_by_side(
        {"response_perplexity": mixhook_scoring, "hand": hand, "train_step": train_step},
        reps=reps, inner=inner, warmup=1,
    )  # fmt: skip
    return {
        "examples": n,
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "vs_hand": ratio(times, "response_perplexity", "hand"),
        "vs_train_step": ratio(times, "response_perplexity", "train_step"),
    }


# ------------------------------------------------------------------------------- peak memory at 8B's shapes

LLAMA3_VOCAB = 128_256  # Llama-3.1-8B's vocabulary (its config's vocab_size)


class LiveTensors(TorchDispatchMode):
    """The bytes of the tensor storages that ops made and that are still alive, and their peak: on a CPU,
    where the allocator keeps no statistics, a step's peak memory above what was there before it (each
    op's outputs counted once per storage, a storage let go when nothing holds it; read after each op)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live or self.live[key][0].expired():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _peak_bytes(step, device) -> int:
    """One call of ``step`` (a training step's forward and backward): its peak memory above what was
    allocated before it, in bytes (CUDA: the allocator's peak; a CPU: :class:`LiveTensors`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with LiveTensors() as seen:
        step()
    return seen.peak


def sftmix_memory(device, batch: int, length: int, hidden: int = 64, vocab: int = LLAMA3_VOCAB) -> dict:
    """The peak memory of one training step (forward and backward, gradients set to None before it) of a
    Llama narrow in its body and of Llama-3.1-8B's vocabulary (the LM head's logits dominate: ``batch *
    length * vocab`` floats a copy), on a right-padded batch with completion-only labels: plain fine-tuning
    (the model's own loss, the Trainer's), SFTMix's (``mix.loss``) and the minimal hand-written SFTMix of
    :func:`_hand` (``B`` mixed rows, two cross-entropies); float32 weights, and bf16 weights on CUDA."""
    try:
        import transformers
    except ImportError:
        return {"note": "transformers is not installed (pip install -e '.[dev]')"}
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    ids, mask, labels = _batch(batch, length, vocab, device)
    out = {"model": f"Llama, hidden {hidden}, 1 layer, vocabulary {vocab}", "batch": batch, "length": length,
           "logits_MiB": batch * length * vocab * 4 / 2**20, "peak_MiB": {}, "sftmix_vs_none": {},
           "sftmix_vs_hand": {}, "how": "CUDA: the allocator's peak" if device.type == "cuda" else
           "a CPU: the peak of the live bytes of the storages the step's ops made (LiveTensors)"}  # fmt: skip
    for dtype in dtypes:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length, pad_token_id=0,
        )  # fmt: skip
        base = transformers.LlamaForCausalLM(config).to(device, dtype).train()
        peaks = {}
        for kind in ("none", "hand", "sftmix"):
            model = copy.deepcopy(base)
            if kind == "sftmix":
                mix = SFTMix("model.norm", generator=torch.Generator().manual_seed(0))
                mix.attach(model)

                def loss(model=model, mix=mix):
                    return mix.loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels,
                                            "use_cache": False})[0]  # fmt: skip

            elif kind == "hand":
                plan, of = _hand(model, labels)

                def loss(model=model, plan=plan, of=of):
                    plan()
                    return of(model(input_ids=ids, attention_mask=mask, use_cache=False).logits)

            else:

                def loss(model=model):
                    return model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss

            def step(model=model, loss=loss):
                model.zero_grad(set_to_none=True)
                loss().backward()

            step()  # (a first step: what it allocates once, the gradients' buffers, is not the step's peak)
            peaks[kind] = _peak_bytes(step, device) / 2**20
            del model, step, loss
        name = str(dtype).removeprefix("torch.")
        out["peak_MiB"][name] = peaks
        out["sftmix_vs_none"][name] = peaks["sftmix"] / peaks["none"]
        out["sftmix_vs_hand"][name] = peaks["sftmix"] / peaks["hand"]
    return out
