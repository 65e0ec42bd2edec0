"""NEFTune: equal to HuggingFace's hook (and the authors' code, which it copies) on the same uniform draws
with ``length="padded"``; with ``length="sequence"`` each sequence's noise scaled by its own length, as
Algorithm 1 of the paper has it, zero on padding, the same in a packed row as in a padded batch; drawn
from its own generator, resumable, replayed under activation checkpointing; bad input in one line."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.language_models import tiny_llama
from mixhook import NEFTune
from mixhook.packing import PackedBatchError
from tests.helpers import Lazy

transformers = Lazy("transformers")

VOCAB, D = 64, 16
g = torch.Generator().manual_seed(0)
IDS = torch.randint(3, VOCAB, (4, 9), generator=g)
MASK = torch.ones(4, 9, dtype=torch.long)
MASK[0, 5:], MASK[2, 2:], MASK[3, 7:] = 0, 0, 0
LENGTHS = MASK.sum(1)  # 5, 9, 2, 7


def llama():
    return tiny_llama(vocab_size=VOCAB, hidden_size=D, max_position_embeddings=64)


def embeddings_of(model, call):
    """What the embedding layer hands the model, after every hook on it (the noise included)."""
    seen = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    try:
        call(model)
    finally:
        handle.remove()
    return seen[0]


def test_padded_length_equals_huggingfaces_hook_on_the_same_draws():
    from transformers.integrations.neftune import neftune_post_forward_hook

    hf, ours = llama(), llama()
    embed = hf.get_input_embeddings()
    embed.neftune_noise_alpha = 5.0
    embed.register_forward_hook(neftune_post_forward_hook)
    torch.manual_seed(7)  # HuggingFace draws from the global generator
    expected = hf(input_ids=IDS, attention_mask=MASK).logits
    expected_embeddings = embeddings_of(
        hf, lambda m: (torch.manual_seed(7), m(input_ids=IDS, attention_mask=MASK))
    )
    neftune = NEFTune(
        "model.embed_tokens", alpha=5.0, length="padded", generator=torch.Generator().manual_seed(7)
    )
    with neftune.attach(ours):
        got = ours(input_ids=IDS, attention_mask=MASK).logits
        neftune.generator.manual_seed(7)
        got_embeddings = embeddings_of(ours, lambda m: m(input_ids=IDS, attention_mask=MASK))
    assert torch.equal(got_embeddings, expected_embeddings)
    assert torch.equal(got, expected)
    bound = 5.0 / (9 * D) ** 0.5  # the padded length, at every position (padding included)
    torch.testing.assert_close(
        neftune.last, torch.full((4, 9), float(torch.tensor(bound, dtype=torch.float32)), dtype=torch.float64)
    )


def test_each_sequence_is_scaled_by_its_own_length_and_padding_gets_none():
    model = llama()
    clean = embeddings_of(model, lambda m: m(input_ids=IDS, attention_mask=MASK))
    neftune = NEFTune("model.embed_tokens", alpha=10.0, generator=torch.Generator().manual_seed(1))
    with neftune.attach(model):
        noised = embeddings_of(model, lambda m: m(input_ids=IDS, attention_mask=MASK))
    noise = noised - clean
    for i, n in enumerate(LENGTHS.tolist()):
        bound = 10.0 / (n * D) ** 0.5
        real = noise[i, :n]
        assert float(real.abs().max()) <= bound and float(real.abs().max()) > 0.8 * bound
        assert abs(float(real.mean())) < 0.2 * bound  # centred
        assert torch.equal(noise[i, n:], torch.zeros_like(noise[i, n:]))  # no noise on padding
        torch.testing.assert_close(neftune.last[i, :n], torch.full((n,), bound, dtype=torch.float64))
        assert not neftune.last[i, n:].any()


def test_a_sequence_gets_the_same_scale_padded_or_packed():
    """The four sequences flattened into one row (position_ids restarting, as DataCollatorWithFlattening
    makes it), or with its flash-attention keywords: each token's scale is its own sequence's, as in the
    padded batch; length='padded' refuses the packed row (its length would be the whole row)."""
    model = llama()
    sequences = [IDS[i, :n].tolist() for i, n in enumerate(LENGTHS.tolist())]
    padded = NEFTune("model.embed_tokens", alpha=5.0)
    with padded.attach(model):
        model(input_ids=IDS, attention_mask=MASK)
    expected = torch.cat([padded.last[i, :n] for i, n in enumerate(LENGTHS.tolist())])
    for flash in (False, True):
        collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)
        batch = collator([{"input_ids": s} for s in sequences], return_tensors="pt")
        keep = ("input_ids", "position_ids") if not flash else ("input_ids", "cu_seq_lens_q")
        batch = {k: v for k, v in batch.items() if k in keep}
        packed = NEFTune("model.embed_tokens", alpha=5.0)
        with packed.attach(model):
            model(**batch)
        torch.testing.assert_close(packed.last[0], expected)
        with (
            NEFTune("model.embed_tokens", length="padded").attach(model),
            pytest.raises(PackedBatchError) as err,
        ):
            model(**batch)
        assert "length='sequence'" in str(err.value) and "\n" not in str(err.value)


def test_eval_is_untouched_and_a_resumed_hook_draws_what_the_uninterrupted_one_would():
    model = llama()
    model.eval()
    plain_eval = model(input_ids=IDS, attention_mask=MASK).logits
    model.train()
    neftune = NEFTune("model.embed_tokens", generator=torch.Generator().manual_seed(3))
    with neftune.attach(model):
        first = model(input_ids=IDS, attention_mask=MASK).logits
        state = neftune.state_dict()
        second = model(input_ids=IDS, attention_mask=MASK).logits
        model.eval()
        assert torch.equal(model(input_ids=IDS, attention_mask=MASK).logits, plain_eval)
        model.train()
    assert not torch.equal(first, second)
    resumed = NEFTune("model.embed_tokens")
    resumed.load_state_dict(state)
    with resumed.attach(model):
        assert torch.equal(model(input_ids=IDS, attention_mask=MASK).logits, second)


class Checkpointed(nn.Module):
    """An embedding inside a block recomputed in the backward (non-reentrant checkpointing)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Tanh())
        self.head = nn.Linear(D, 3)

    def forward(self, input_ids, attention_mask=None, recompute=True):
        h = checkpoint(self.body, input_ids, use_reentrant=False) if recompute else self.body(input_ids)
        return self.head(h.mean(1))


def test_a_recomputed_embedding_gets_the_same_noise_again():
    torch.manual_seed(0)
    model = Checkpointed().double().train()
    twin = copy.deepcopy(model)
    grads = []
    for m, recompute in ((model, True), (twin, False)):
        neftune = NEFTune("body.0", generator=torch.Generator().manual_seed(5))
        with neftune.attach(m):
            m(IDS, MASK, recompute=recompute).pow(2).sum().backward()
        grads.append([p.grad for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_bad_input_is_refused_in_one_line():
    for alpha in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ValueError, match="alpha must be a finite number > 0"):
            NEFTune(alpha=alpha)
    with pytest.raises(ValueError, match="length must be one of sequence, padded, got 'row'"):
        NEFTune(length="row")
    model = llama()
    with (
        NEFTune("model.rotary_emb").attach(model),
        pytest.raises(TypeError, match="one \\(B, L, d\\) tensor"),
    ):
        model(input_ids=IDS, attention_mask=MASK)
    with (
        NEFTune("model.embed_tokens").attach(model),
        pytest.raises(ValueError, match="does not describe them"),
    ):
        model(input_ids=IDS, attention_mask=MASK[:, :5])
    embed = model.get_input_embeddings()
    embed.neftune_noise_alpha = 5.0  # what the Trainer's neftune_noise_alpha sets with its own hook
    with NEFTune("model.embed_tokens").attach(model), pytest.raises(ValueError, match="added twice") as err:
        model(input_ids=IDS, attention_mask=MASK)
    assert "\n" not in str(err.value)


def test_a_training_forward_without_gradients_gets_no_noise_and_draws_nothing():
    """A trainer's metrics pass (TRL's SFTTrainer runs one after each loss) cannot train: untouched."""
    model = llama()
    with torch.no_grad():
        plain = model(input_ids=IDS, attention_mask=MASK).logits
    neftune = NEFTune("model.embed_tokens", generator=torch.Generator().manual_seed(2))
    before = neftune.generator.get_state()
    with neftune.attach(model), torch.no_grad():
        assert torch.equal(model(input_ids=IDS, attention_mask=MASK).logits, plain)
    assert torch.equal(neftune.generator.get_state(), before) and neftune.last is None
