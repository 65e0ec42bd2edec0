"""Language-model fine-tuning: Llama-family models (RMSNorm, rotary positions, grouped-query attention;
eager and sdpa attention), padded batches with ``-100`` labels, HuggingFace gradient checkpointing; and
packed batches, which no mixer may mix across their sequences. Real models from tiny configs, float64,
against hand-edited forwards (logits, the mixed loss and every gradient)."""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from mixhook import GradClip, GradScale, InputScale, ManifoldMixup, NEFTune, NoisyFeatureMixup
from mixhook.packing import PackedBatchError
from tests.helpers import Lazy
from tests.helpers import exact as helpers_exact

transformers = Lazy("transformers")

LAM, INDEX = 0.3, torch.tensor([2, 3, 0, 1])
VOCAB = 64
g = torch.Generator().manual_seed(0)
IDS = torch.randint(3, VOCAB, (4, 7), generator=g)
PADDED = torch.ones(4, 7, dtype=torch.long)
PADDED[0, 4:], PADDED[2, 2:] = 0, 0
LABELS = torch.randint(3, VOCAB, (4, 7), generator=g).masked_fill(PADDED == 0, -100)
UNION = torch.maximum(PADDED, PADDED[INDEX])

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8}),
}


def causal_lm(family: str, implementation: str = "sdpa"):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, attn_implementation=implementation, pad_token_id=0,
        **extra,
    )  # fmt: skip
    return getattr(transformers, model_cls)(config).double().train()


def checkpoint(model):
    """HuggingFace's activation checkpointing of every decoder layer, non-reentrant (transformers 5.24
    renamed gradient_checkpointing_enable)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def lm_loss(logits, labels):
    """The causal LM loss as the models take it: position t predicts label t + 1, -100 ignored."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


exact = partial(helpers_exact, rtol=1e-9, atol=1e-11)  # (this file's tolerance)


def layer_masks(model, mask):
    """The mask the model hands its decoder layers for a 2-D padding mask (its own construction)."""
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["attention_mask"]), with_kwargs=True
    )
    with torch.no_grad():
        model(input_ids=IDS, attention_mask=mask)
    handle.remove()
    return seen[0]


def by_hand(model, spec):
    """The hand-edited forward: the first call of ``spec`` blended with its partner's, and every decoder
    layer after it given the mask the model builds for the union of the partners' padding."""
    union = layer_masks(model, UNION)
    start = int(spec.split(".")[2]) + 1  # "model.layers.K[...]"
    hooks = [
        model.get_submodule(spec).register_forward_hook(lambda m, a, out: LAM * out + (1 - LAM) * out[INDEX])
    ]
    for layer in model.model.layers[start:]:
        hooks.append(
            layer.register_forward_pre_hook(
                lambda m, a, kw: (a, {**kw, "attention_mask": union}), with_kwargs=True
            )
        )
    try:
        logits = model(input_ids=IDS, attention_mask=PADDED).logits
        loss = LAM * lm_loss(logits, LABELS) + (1 - LAM) * lm_loss(logits, LABELS[INDEX])
        loss.backward()
        return logits, loss
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_decoder_layer_of_a_llama_family_model_mixes_as_a_hand_edited_forward(family, implementation):
    """ManifoldMixup at ``model.layers.0`` of a padded batch: later layers attend to the union of the
    partners' padding, the loss is lam and 1 - lam of the causal LM loss of both label rows (-100
    ignored); logits, loss and every gradient as the hand-edited forward."""
    model = causal_lm(family, implementation)
    hand = copy.deepcopy(model)
    mix = ManifoldMixup("model.layers.0")
    with mix.attach(model):
        mix.pin(lam=LAM, index=INDEX)
        logits = model(input_ids=IDS, attention_mask=PADDED).logits
        loss = mix.loss(lm_loss, logits, LABELS)
        loss.backward()
    expected, expected_loss = by_hand(hand, "model.layers.0")
    exact(logits, expected)
    exact(loss, expected_loss)
    for (name, p), q in zip(model.named_parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_gradient_checkpointing_replays_a_mix_inside_a_decoder_layer_and_nfm_noise(family):
    """HuggingFace's activation checkpointing (use_reentrant=False) recomputes each decoder layer's
    forward in the backward (its forward, not its __call__: a hook on the layer itself runs once, outside
    the checkpoint). A mix inside the layer, at ``model.layers.1.mlp``, runs again in the recomputation
    and is replayed exactly (NFM's noise too): logits and gradients as without checkpointing."""
    model = causal_lm(family)
    hand = copy.deepcopy(model)
    checkpointed = copy.deepcopy(model)
    spec = "model.layers.1.mlp"
    mix = ManifoldMixup(spec)
    checkpoint(checkpointed)
    calls = []
    checkpointed.get_submodule(spec).register_forward_pre_hook(lambda m, a: calls.append(1))
    with mix.attach(checkpointed):
        mix.pin(lam=LAM, index=INDEX)
        logits = checkpointed(input_ids=IDS, attention_mask=PADDED).logits
        mix.loss(lm_loss, logits, LABELS).backward()
    assert len(calls) == 2  # its forward, and its recomputation in the backward
    expected, _ = by_hand(hand, spec)
    exact(logits, expected)
    for p, q in zip(checkpointed.parameters(), hand.parameters(), strict=True):
        exact(p.grad, q.grad)
    results = []
    for checkpointing in (False, True):
        twin = copy.deepcopy(model)
        if checkpointing:
            checkpoint(twin)
        nfm = NoisyFeatureMixup(spec, generator=torch.Generator().manual_seed(3))
        with nfm.attach(twin):
            out = twin(input_ids=IDS, attention_mask=PADDED).logits
            nfm.loss(lm_loss, out, LABELS).backward()
        results.append((out, [p.grad for p in twin.parameters()]))
    exact(results[1][0], results[0][0])
    for a, b in zip(results[1][1], results[0][1], strict=True):
        exact(a, b)


# ------------------------------------------------------------------------------------ packed batches


def flattened(return_flash_attn_kwargs=False):
    """Two sequences per row, as HuggingFace's DataCollatorWithFlattening packs them (position_ids that
    restart, and with ``return_flash_attn_kwargs`` the varlen keywords)."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=return_flash_attn_kwargs)
    features = [{"input_ids": IDS[i, : 3 + i].tolist()} for i in range(4)]
    return collator(features, return_tensors="pt")


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_a_packed_batch_is_refused_not_mixed_across_its_sequences(flash_kwargs):
    """A batch flattened into one row (four sequences): it was a batch of one, nothing mixed and nothing
    said; with several packed rows, each row's partner was other sequences at other positions."""
    model = causal_lm("llama")
    batch = flattened(flash_kwargs)
    assert batch["input_ids"].shape[0] == 1
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids", "cu_seq_lens_q")}
    for mixer in (ManifoldMixup("model.layers.0"), NoisyFeatureMixup("model.layers.1")):
        with mixer.attach(model), pytest.raises(PackedBatchError) as err:
            model(**batch)
        message = str(err.value)
        assert "\n" not in message and "several sequences share a row" in message
        assert ("cu_seq_lens_q is given" if flash_kwargs else "position_ids restart inside a row") in message
        assert "DataCollatorWithPadding" in message
    rows = torch.tensor(
        [[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]]
    )
    with ManifoldMixup("model.layers.0").attach(model), pytest.raises(PackedBatchError):
        model(input_ids=IDS, position_ids=rows)


def test_per_sample_hooks_refuse_a_packed_batch_and_elementwise_ones_act_on_it():
    """GradClip's per-sample norm and InputScale's per-sample factors would cover a whole packed row (the
    whole batch, flattened): refused in one line; a number factor, GradScale and NEFTune (each packed
    sequence's own length) act on it, and an eval forward of a per-sample hook is not checked."""
    model = causal_lm("llama")
    batch = {k: v for k, v in flattened().items() if k in ("input_ids", "position_ids")}
    for hook, why in (
        (GradClip("model.layers.0", 1.0), "a sample's norm would be a whole row's"),
        (InputScale("model.layers.1", (0.5, 1.5)), "each factor would be shared by a row's sequences"),
    ):
        with hook.attach(model):
            with pytest.raises(PackedBatchError) as err:
                model(**batch)
            assert why in str(err.value) and "\n" not in str(err.value)
            model.eval()
            model(**batch)
            model.train()
            with torch.no_grad():  # InputScale draws its factors here too; GradClip has nothing to clip
                if isinstance(hook, InputScale):
                    with pytest.raises(PackedBatchError):
                        model(**batch)
                else:
                    model(**batch)
    for hook in (InputScale("model.layers.1", 0.5), GradScale("model.layers.0", 0.5), NEFTune()):
        with hook.attach(model):
            model(**batch).logits.sum().backward()


def test_position_ids_of_padded_batches_are_not_packing():
    """Right padding (HuggingFace fills padded positions with 1) and left padding repeat positions over
    padded tokens without starting a sequence: mixed, not refused; eval forwards are never checked."""
    model = causal_lm("llama")
    right = (PADDED.cumsum(1) - 1).masked_fill(PADDED == 0, 1)
    left_mask = PADDED.flip(1)
    left = (left_mask.cumsum(1) - 1).masked_fill(left_mask == 0, 1)
    mix = ManifoldMixup("model.layers.0")
    with mix.attach(model):
        model(input_ids=IDS, attention_mask=PADDED, position_ids=right)
        model(input_ids=IDS, attention_mask=left_mask, position_ids=left)
        model(input_ids=IDS, position_ids=torch.arange(7).expand(4, 7))
        model.eval()
        model(**flattened())
    assert mix.last is not None
