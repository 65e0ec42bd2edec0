"""Padding masks downstream of a mix in models with more than one sequence (mixhook.padding): an
encoder-decoder mixed in its encoder unions the encoder's masks and the cross-attention mask the decoder
uses, never the decoder's own; mixed in its decoder, the decoder's own masks; a second tower keeps its
masks. Each against a hand-edited forward (the mix and the unions written as modules around the layers)
in float64, logits and every gradient; where the policy cannot be known, one line."""

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import ManifoldMixup
from mixhook.padding import PaddingPolicyError
from tests.helpers import exact as helpers_exact

LAM, INDEX = 0.3, torch.tensor([2, 3, 0, 1])


exact = partial(helpers_exact, rtol=1e-9, atol=1e-11)  # (this file's tolerance)


class Blend(nn.Module):
    """A hand edit: ``inner``'s output (its first element) blended with the partner's."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if hasattr(out, "last_hidden_state"):  # a HuggingFace stack's ModelOutput
            out.last_hidden_state = LAM * out.last_hidden_state + (1 - LAM) * out.last_hidden_state[INDEX]
            return out
        h = out[0] if isinstance(out, tuple) else out
        h = LAM * h + (1 - LAM) * h[INDEX]
        return (h, *out[1:]) if isinstance(out, tuple) else h


class Union(nn.Module):
    """A hand edit: ``inner`` called with the mask at ``position`` (or keyword ``name``) unioned with the
    partner's (max: 1/0 and additive masks)."""

    def __init__(self, inner, position, name="attention_mask"):
        super().__init__()
        self.inner, self.position, self.name = inner, position, name

    def forward(self, *args, **kwargs):
        args = list(args)
        if self.name in kwargs:
            kwargs[self.name] = torch.maximum(kwargs[self.name], kwargs[self.name][INDEX])
        else:
            args[self.position] = torch.maximum(args[self.position], args[self.position][INDEX])
        return self.inner(*args, **kwargs)


def seq_ce(logits, target):
    return F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100)


def check(model, reference, spec, call, hand_call, labels=None):
    """Mix ``model`` at ``spec`` on the pinned draw; compare with the hand-edited ``reference`` (logits,
    the mixed sequence loss and every gradient)."""
    mix = ManifoldMixup(spec)
    with mix.attach(model):
        mix.pin(lam=LAM, index=INDEX)
        logits = call(model)
        loss = mix.loss(seq_ce, logits, labels) if labels is not None else logits.pow(2).sum()
    expected = hand_call(reference)
    exact(logits, expected)
    if labels is not None:
        expected_loss = LAM * seq_ce(expected, labels) + (1 - LAM) * seq_ce(expected, labels[INDEX])
    else:
        expected_loss = expected.pow(2).sum()
    exact(loss, expected_loss)
    loss.backward()
    expected_loss.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            exact(p.grad, q.grad)
    return mix


g = torch.Generator().manual_seed(0)
IDS = torch.randint(1, 50, (4, 7), generator=g)
MASK = torch.ones(4, 7, dtype=torch.long)
MASK[0, 4:], MASK[1, 6:], MASK[2, 2:] = 0, 0, 0
DEC = torch.randint(1, 50, (4, 5), generator=g)
DMASK = torch.ones(4, 5, dtype=torch.long)
DMASK[0, 3:], DMASK[3, 4:] = 0, 0
LABELS = torch.randint(1, 50, (4, 5), generator=g).masked_fill(DMASK == 0, -100)
UNION = torch.maximum(MASK, MASK[INDEX])


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return T5ForConditionalGeneration(config).double().train()


def seq2seq_call(model):
    return model(
        input_ids=IDS, attention_mask=MASK, decoder_input_ids=DEC, decoder_attention_mask=DMASK
    ).logits


def mixed_in_the_encoder(encoder):
    """The hand-edited forward of an encoder-decoder mixed in its encoder: ``encoder(ref)`` (edited by the
    test) runs on each sample's own source, and the decoder attends to its output through the union of
    the partners' source masks, its own input and mask each sample's own."""

    def hand(ref):
        encoded = encoder(ref)(input_ids=IDS, attention_mask=MASK)
        return ref(
            encoder_outputs=encoded, attention_mask=UNION, decoder_input_ids=DEC, decoder_attention_mask=DMASK
        ).logits

    return hand


def test_t5_mixed_in_its_encoder_unions_the_encoder_and_cross_attention_masks_not_the_decoders():
    """The decoder's teacher-forced input stays each sample's own (its own prefix and mask); it attends to
    the mixed encoding through the union of the partners' source masks; the loss is lam times the sequence
    loss of the sample's labels plus (1 - lam) times that of the partner's, both on these logits."""
    model = t5()
    reference = copy.deepcopy(model)
    reference.encoder.block[1] = Blend(reference.encoder.block[1])
    reference.encoder.block[2] = Union(reference.encoder.block[2], 1)

    hand = mixed_in_the_encoder(lambda ref: ref.encoder)
    check(model, reference, "encoder.block.1", seq2seq_call, hand, LABELS)


def test_t5_mixed_in_its_decoder_unions_the_decoders_own_masks_and_keeps_the_cross_mask():
    model = t5()
    reference = copy.deepcopy(model)
    reference.decoder.block[0] = Blend(reference.decoder.block[0])
    reference.decoder.block[1] = Union(reference.decoder.block[1], 1)  # its causal self-attention mask only
    check(model, reference, "decoder.block.0", seq2seq_call, seq2seq_call, LABELS)


def test_t5_mixed_at_its_input_embeddings():
    model = t5()
    embeds = model.shared(IDS).detach()

    def hand(ref):
        mixed = LAM * embeds + (1 - LAM) * embeds[INDEX]
        return ref(
            inputs_embeds=mixed, attention_mask=UNION, decoder_input_ids=DEC, decoder_attention_mask=DMASK
        ).logits

    def call(m):
        return m(
            inputs_embeds=embeds, attention_mask=MASK, decoder_input_ids=DEC, decoder_attention_mask=DMASK
        ).logits

    check(model, copy.deepcopy(model), "input[inputs_embeds]", call, hand, LABELS)


class SharedEmbedding(nn.Module):
    """An encoder-decoder whose one ``embed`` module embeds the source and the target."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 8)
        self.transformer = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)

    def forward(self, src, tgt, src_pad, tgt_pad):
        return self.transformer(
            self.embed(src), self.embed(tgt), src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
            memory_key_padding_mask=src_pad,
        )  # fmt: skip


def test_a_layer_of_both_sequences_in_no_masked_module_is_refused():
    """``embed`` runs for the source, then the target: downstream, ``transformer`` takes both sequences,
    and which one was mixed cannot be told from the model."""
    model = SharedEmbedding().train()
    args = (torch.randn(4, 7, 3), torch.randn(4, 5, 3), MASK == 0, DMASK == 0)
    with ManifoldMixup("embed").attach(model), pytest.raises(PaddingPolicyError) as err:
        model(*args)
    assert "'transformer' takes a source and a target sequence" in str(err.value) and "\n" not in str(
        err.value
    )
    with ManifoldMixup("embed", padding="keep").attach(model):
        model(*args)


class Wrapped(nn.Module):
    """A user's wrapper around the encoder-decoder of ``SharedEmbedding``."""

    def __init__(self):
        super().__init__()
        self.inner = SharedEmbedding()

    def forward(self, *args):
        return self.inner(*args)


def test_a_layer_of_both_sequences_inside_a_wrapped_encoder_decoder_is_refused():
    """``inner.embed`` lies in no mask-taking module, inside a part that takes two sequences: the part is no
    region (its source and target both lie inside it)."""
    model = Wrapped().train()
    args = (torch.randn(4, 7, 3), torch.randn(4, 5, 3), MASK == 0, DMASK == 0)
    with ManifoldMixup("inner.embed").attach(model), pytest.raises(PaddingPolicyError, match="source and a"):
        model(*args)


def bart(decoder_layers=2):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=decoder_layers, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, attn_implementation="eager",
    )  # fmt: skip
    return BartForConditionalGeneration(config).double().train()


def test_bart_mixed_in_its_encoder():
    model = bart(decoder_layers=1)
    reference = copy.deepcopy(model)
    reference.model.encoder.layers[0] = Blend(reference.model.encoder.layers[0])
    reference.model.encoder.layers[1] = Union(reference.model.encoder.layers[1], 1)

    hand = mixed_in_the_encoder(lambda ref: ref.model.encoder)
    check(model, reference, "model.encoder.layers.0", seq2seq_call, hand, LABELS)


def torch_transformer(encoder_layers, decoder_layers):
    torch.manual_seed(0)
    return nn.Transformer(
        d_model=8, nhead=2, num_encoder_layers=encoder_layers, num_decoder_layers=decoder_layers,
        dim_feedforward=16, dropout=0.0, batch_first=True,
    ).double().train()  # fmt: skip


SRC, TGT = (
    torch.randn(4, 7, 8, generator=g, dtype=torch.float64),
    torch.randn(4, 5, 8, generator=g, dtype=torch.float64),
)


def test_torch_transformer_mixed_in_its_encoder_unions_the_memory_mask_not_the_targets():
    model = torch_transformer(encoder_layers=2, decoder_layers=1)
    src, tgt, pad, tpad = SRC, TGT, MASK == 0, DMASK == 0  # (pads: True is padding)
    union = pad & pad[INDEX]

    def call(m):
        return m(src, tgt, src_key_padding_mask=pad, tgt_key_padding_mask=tpad, memory_key_padding_mask=pad)

    def hand(ref):
        h = ref.encoder.layers[0](src, src_key_padding_mask=pad)
        h = LAM * h + (1 - LAM) * h[INDEX]
        memory = ref.encoder.norm(ref.encoder.layers[1](h, src_key_padding_mask=union))
        return ref.decoder(tgt, memory, tgt_key_padding_mask=tpad, memory_key_padding_mask=union)

    check(model, copy.deepcopy(model), "encoder.layers.0", call, hand)


def test_a_second_tower_keeps_its_masks():
    """CLIP mixed in its vision encoder: the text encoder, run after it, keeps its padding mask (a union
    there would let each text attend to its partner's padding)."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=16),
        vision_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                           image_size=8, patch_size=4),
        projection_dim=8,
    )  # fmt: skip
    model = CLIPModel(config).double().train()
    pixels = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    plain = model(input_ids=IDS, attention_mask=MASK, pixel_values=pixels)
    for spec in ("vision_model.encoder.layers.0", "input[pixel_values]", "vision_model.embeddings"):
        mix = ManifoldMixup(spec)
        with mix.attach(model):
            mix.pin(lam=LAM, index=INDEX)
            out = model(input_ids=IDS, attention_mask=MASK, pixel_values=pixels)
        exact(out.text_embeds, plain.text_embeds)
        assert not torch.allclose(out.image_embeds, plain.image_embeds)


class Pooled(nn.Module):
    """Tokens mixed at ``embed``; ``pool`` takes an ``attention_mask`` over another sequence (8 positions)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.pool = _MaskedMean()

    def forward(self, x, other_mask):
        return self.pool(self.embed(x).mean(1, keepdim=True).expand(-1, 8, -1), attention_mask=other_mask)


class _MaskedMean(nn.Module):
    def forward(self, h, attention_mask):
        return (h * attention_mask[..., None]).sum(1)


def test_a_mask_of_another_length_than_the_mixed_sequence_is_refused():
    model = Pooled().train()
    with ManifoldMixup("embed").attach(model), pytest.raises(PaddingPolicyError, match="8 positions") as err:
        model(torch.randn(4, 6, 3), torch.ones(4, 8))
    assert "(B, 6, 4)" in str(err.value) and "padding='keep'" in str(err.value)


# ------------------------------------------------------- the region: the stack whose sequence was mixed


def test_bart_mixed_inside_a_decoder_layer_unions_the_later_decoder_layers_own_masks_not_the_source_masks():
    """Issue 44: a mix at ``model.decoder.layers.0.fc2`` (inside a decoder layer) used to take that one layer
    as its region: later decoder layers, outside it and cross-attending, got the source masks unioned (and
    with source and target of different lengths, were refused)."""
    model = bart()
    reference = copy.deepcopy(model)
    layer = reference.model.decoder.layers[0]
    layer.fc2 = Blend(layer.fc2)
    reference.model.decoder.layers[1] = Union(reference.model.decoder.layers[1], 1)  # its causal mask only
    check(model, reference, "model.decoder.layers.0.fc2", seq2seq_call, seq2seq_call, LABELS)


def test_bart_mixed_at_its_encoder_unions_the_cross_attention_masks_not_the_decoders_own():
    """Issue 44: at ``model.encoder`` (the whole encoder, directly under the encoder-decoder) the region was
    the encoder-decoder: the decoder's own masks were unioned and the source masks kept, the reverse."""
    model = bart(decoder_layers=1)
    reference = copy.deepcopy(model)
    reference.model.encoder = Blend(reference.model.encoder)

    hand = mixed_in_the_encoder(lambda ref: ref.model.encoder)
    check(model, reference, "model.encoder", seq2seq_call, hand, LABELS)


def test_t5_mixed_at_its_encoder_unions_the_cross_attention_masks():
    """Issue 44: T5's ``encoder`` was refused (its region was taken to be the whole model)."""
    model = t5()
    reference = copy.deepcopy(model)
    reference.encoder = Blend(reference.encoder)

    hand = mixed_in_the_encoder(lambda ref: ref.encoder)
    check(model, reference, "encoder", seq2seq_call, hand, LABELS)


def test_t5_mixed_inside_a_decoder_block_keeps_the_cross_attention_mask_of_the_same_block():
    """Issue 44: after a mix at ``decoder.block.0.layer.0`` (the self-attention sub-layer), the block's
    ``T5LayerCrossAttention`` takes the source mask under the name ``attention_mask``: it used to be unioned
    as if it were the decoder's own (and refused for its length)."""
    model = t5()
    reference = copy.deepcopy(model)
    block = reference.decoder.block[0]
    block.layer[0] = Blend(block.layer[0])
    reference.decoder.block[1] = Union(reference.decoder.block[1], 1)  # its causal self-attention mask only
    check(model, reference, "decoder.block.0.layer.0[0]", seq2seq_call, seq2seq_call, LABELS)


def test_t5_mixed_inside_an_encoder_block_unions_the_later_blocks_masks():
    model = t5()
    reference = copy.deepcopy(model)
    block = reference.encoder.block[0]
    block.layer[1] = Blend(block.layer[1])  # the feed-forward sub-layer of block 0
    reference.encoder.block[1] = Union(reference.encoder.block[1], 1)
    reference.encoder.block[2] = Union(reference.encoder.block[2], 1)

    hand = mixed_in_the_encoder(lambda ref: ref.encoder)
    check(model, reference, "encoder.block.0.layer.1", seq2seq_call, hand, LABELS)


def bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, attn_implementation="eager",
    )  # fmt: skip
    return BertForSequenceClassification(config).double().train()


@pytest.mark.parametrize("spec", ["bert.encoder.layer.0.output.LayerNorm", "bert.encoder.layer.0.output"])
def test_bert_mixed_inside_a_layer_unions_every_later_layers_masks(spec):
    """Issue 44: a mix inside ``bert.encoder.layer.0`` (its output LayerNorm returns the layer's very tensor)
    took that layer as its region, so layers 1 and 2 kept each sample's own mask."""
    model = bert()
    reference = copy.deepcopy(model)
    parent, _, child = spec.rpartition(".")
    owner = reference.get_submodule(parent)
    setattr(owner, child, Blend(getattr(owner, child)))
    for k in (1, 2):
        reference.bert.encoder.layer[k] = Union(reference.bert.encoder.layer[k], 1)

    def call(m):
        return m(input_ids=IDS, attention_mask=MASK).logits

    check(model, reference, spec, call, call)
    same = ManifoldMixup("bert.encoder.layer.0")  # the same tensor mixed at the layer: the same result
    with same.attach(model):
        same.pin(lam=LAM, index=INDEX)
        at_layer = call(model)
    exact(at_layer, call(reference))


def test_torch_transformer_mixed_at_a_decoder_self_attention_keeps_the_memory_mask_of_its_cross_attention():
    """A mix at ``decoder.layers.0.self_attn``: the same layer's ``multihead_attn`` is called with the memory
    as its key; its ``key_padding_mask`` is the source's and stays each sample's own, while later decoder
    layers get the union of the target masks."""
    model = torch_transformer(encoder_layers=1, decoder_layers=2)
    src, tgt, pad, tpad = SRC, TGT, MASK == 0, DMASK == 0  # (pads: True is padding)

    def call(m):
        return m(src, tgt, src_key_padding_mask=pad, tgt_key_padding_mask=tpad, memory_key_padding_mask=pad)

    reference = copy.deepcopy(model)
    first, second = reference.decoder.layers[0], reference.decoder.layers[1]
    first.self_attn = BlendAttention(first.self_attn)

    def hand(ref):
        memory = ref.encoder(src, src_key_padding_mask=pad)
        h = ref.decoder.layers[0](tgt, memory, tgt_key_padding_mask=tpad, memory_key_padding_mask=pad)
        h = second(h, memory, tgt_key_padding_mask=tpad & tpad[INDEX], memory_key_padding_mask=pad)
        return ref.decoder.norm(h)

    check(model, reference, "decoder.layers.0.self_attn", call, hand)


class BlendAttention(nn.Module):
    """A hand edit of an ``nn.MultiheadAttention`` (keeping its attributes, which its layer reads): its
    output blended with the partner's."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.batch_first = inner.batch_first

    def forward(self, *args, **kwargs):
        out, weights = self.inner(*args, **kwargs)
        return LAM * out + (1 - LAM) * out[INDEX], weights
