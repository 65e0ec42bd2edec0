"""Case 10: language-model fine-tuning. A small Llama's training step (forward, causal LM loss, backward,
SGD) on a right-padded batch: NEFTune (mixhook's, each sequence's own length and the padded one) against
HuggingFace's NEFTune hook and against none; Manifold Mixup at a decoder layer against none and against a
minimal hand-written blend hook (the same blend, its lam and permutation drawn in the hook; mixhook with
padding="keep" as the hook keeps the masks, and with its default padding="union", which also unions the
partners' padding masks at the later layers). And the host's cost of one NEFTune call: an embedding layer's
training forward on a tiny batch (launch-bound: the time is the host's) with mixhook's NEFTune against
HuggingFace's hook (the minimal hand-written NEFTune: one uniform draw, one add), the microseconds each adds
to the plain forward and the aten ops each runs."""

from __future__ import annotations

import copy
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.cases.host import Census
from benchmarks.timing import ratio
from mixhook import ManifoldMixup, NEFTune


def _causal(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


VOCAB = 2048


def llama(device, hidden: int, length: int) -> torch.nn.Module:
    """The cases' Llama (4 layers of width ``hidden``, a vocabulary of ``VOCAB``), its weights drawn after
    ``torch.manual_seed(0)``, in train mode: :func:`llama_name` names it."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(length, 64), pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(device).train()


def llama_name(hidden: int) -> str:
    return f"Llama, hidden {hidden}, 4 layers"


def language_model(device, timer, reps, inner, batch, length, hidden) -> dict:
    try:
        from transformers.integrations.neftune import neftune_post_forward_hook
    except ImportError:
        return {"note": "transformers is not installed (pip install -e '.[dev]')"}
    base = llama(device, hidden, length)
    ids = torch.randint(3, VOCAB, (batch, length), device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    for i in range(batch):  # right padding: every sequence its own length
        mask[i, length - (i * length) // (2 * batch) :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    beta = torch.distributions.Beta(torch.tensor(2.0), torch.tensor(2.0))

    def make(hook=None, mixer=None, hand=False, hf=False):
        model = copy.deepcopy(base)
        drawn = {}
        if hook is not None:
            hook.attach(model)
        if mixer is not None:
            mixer.attach(model)
        if hf:  # what the Trainer's neftune_noise_alpha does
            embed = model.get_input_embeddings()
            embed.neftune_noise_alpha = 5.0
            embed.register_forward_hook(neftune_post_forward_hook)
        if hand:  # a minimal hand-written blend at the first decoder layer

            def blend(module, args, out):
                lam = float(beta.sample())
                index = torch.randperm(batch, device=device)
                drawn.update(lam=lam, index=index)
                return lam * out + (1 - lam) * out[index]

            model.model.layers[0].register_forward_hook(blend)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            logits = model(input_ids=ids, attention_mask=mask).logits
            if mixer is not None:
                loss = mixer.loss(_causal, logits, labels)
            elif hand:
                lam, index = drawn["lam"], drawn["index"]
                loss = lam * _causal(logits, labels) + (1 - lam) * _causal(logits, labels[index])
            else:
                loss = _causal(logits, labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step

    variants = {
        "none": make(),
        "hf_neftune": make(hf=True),
        "neftune_sequence": make(hook=NEFTune("model.embed_tokens", 5.0)),
        "neftune_padded": make(hook=NEFTune("model.embed_tokens", 5.0, "padded")),
        "manifold_layer0": make(mixer=ManifoldMixup("model.layers.0", alpha=2.0, padding="keep")),
        "manifold_layer0_union": make(mixer=ManifoldMixup("model.layers.0", alpha=2.0)),
        "hand_blend_layer0": make(hand=True),
    }
    times = timer.side_by_side(variants, reps=reps, inner=inner, warmup=2)
    return {
        "model": llama_name(hidden),
        "batch": batch,
        "length": length,
        "seconds_per_step": {k: statistics.median(v) for k, v in times.items()},
        "vs_none": {k: ratio(times, k, "none") for k in times if k != "none"},
        "neftune_vs_hf": {k: ratio(times, k, "hf_neftune") for k in ("neftune_sequence", "neftune_padded")},
        "manifold_vs_hand": ratio(times, "manifold_layer0", "hand_blend_layer0"),
        "neftune_call": neftune_call(device, timer, reps, neftune_post_forward_hook),
    }


class _Embeds(nn.Module):
    """What NEFTune hooks: a model's embedding layer, called with the ids and the attention mask."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)

    def forward(self, input_ids, attention_mask=None):
        return self.embed_tokens(input_ids)


def neftune_call(device, timer, reps, hf_hook, batch=4, length=16, hidden=32, calls=200) -> dict:
    """Host microseconds one NEFTune call adds to an embedding layer's training forward, and its aten ops:
    mixhook's (each length) against HuggingFace's hook."""
    ids = torch.randint(0, 64, (batch, length), device=device)
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[0, length // 2 :] = 0
    models = {}
    for name in ("none", "hf_neftune", "neftune_sequence", "neftune_padded"):
        torch.manual_seed(0)
        model = _Embeds(64, hidden).to(device).train()
        if name == "hf_neftune":
            model.embed_tokens.neftune_noise_alpha = 5.0
            model.embed_tokens.register_forward_hook(hf_hook)
        elif name != "none":
            NEFTune("embed_tokens", 5.0, name.removeprefix("neftune_")).attach(model)
        models[name] = model

    def forward(model):
        def call():
            for _ in range(calls):
                model(input_ids=ids, attention_mask=mask)

        return call

    times = timer.side_by_side({n: forward(m) for n, m in models.items()}, reps=reps, inner=1, warmup=1)
    added = {n: [(t - b) / calls * 1e6 for t, b in zip(times[n], times["none"], strict=True)] for n in models}
    census = {}
    for name, model in models.items():
        with Census() as seen:
            model(input_ids=ids, attention_mask=mask)
        census[name] = sum(seen.ops.values())
    return {
        "batch": batch,
        "length": length,
        "hidden": hidden,
        "plain_us": 1e6 * statistics.median(times["none"]) / calls,
        "added_us": {n: statistics.median(added[n]) for n in models if n != "none"},
        "aten_ops": census,
    }
