"""Structured outputs, selectors, batch dimensions and inputs by name, against hand-mixed forwards in
float64 (logits and every parameter gradient), and the refusals with their messages."""

import collections
import copy
import dataclasses
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import (
    ActivationStats,
    CutMix,
    GradClip,
    GradScale,
    InputScale,
    ManifoldMixup,
    NoisyFeatureMixup,
    OneOf,
)
from mixhook.sites import parse_site
from tests.helpers import exact as helpers_exact
from tests.helpers import grads

LAM = 0.3


exact = partial(helpers_exact, rtol=1e-10, atol=1e-12)  # (this file's tolerance)


def same_grads(model_a, model_b):
    ga, gb = grads(model_a), grads(model_b)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        exact(ga[name], gb[name])


def mixed(h, index, dim=0, lam=LAM):
    return lam * h + (1 - lam) * h.index_select(dim, index)


Pair = collections.namedtuple("Pair", "features aux")


@dataclasses.dataclass
class Out:
    features: torch.Tensor
    count: int


class Nested(nn.Module):
    """Returns {"a": (B, 4), "b": Pair((B, 2, 2), None), "c": 0-d, "d": Out((B, 3), 7)}."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 4)

    def forward(self, x):
        h = self.lin(x)
        return {"a": h.tanh(), "b": Pair(h.view(-1, 2, 2), None), "c": h.sum(), "d": Out(h[:, :3] * 2, 7)}


class NestedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Nested()
        self.head = nn.Linear(4 + 4 + 3, 3)

    def forward(self, x):
        out = self.block(x)
        return self.head(torch.cat([out["a"], out["b"].features.flatten(1), out["d"].features], 1)) + out["c"]


def test_a_nested_output_is_mixed_as_a_whole_and_keeps_its_types():
    torch.manual_seed(0)
    model = NestedNet().double().train()
    x = torch.randn(5, 5, dtype=torch.double)
    index = torch.tensor([3, 4, 0, 1, 2])
    seen = {}
    model.block.register_forward_hook(lambda m, a, out: seen.update(out=out))  # registered first: unmixed
    mix = ManifoldMixup("block")
    with mix.attach(model):
        model.block.register_forward_hook(lambda m, a, out: seen.update(mixed=out))
        mix.pin(lam=LAM, index=index)
        y = model(x)
    out, got = seen["out"], seen["mixed"]
    assert type(got) is dict and type(got["b"]) is Pair and type(got["d"]) is Out and got["d"].count == 7
    assert got["b"].aux is None and got["c"] is out["c"]  # no batch dimension: passed through
    assert mix.last.elements == ("[a]", "[b.features]", "[d.features]")
    exact(got["a"], mixed(out["a"], index))
    exact(got["b"].features, mixed(out["b"].features, index))
    hand = copy.deepcopy(model)
    h = hand.block.lin(x)
    a, b, d = mixed(h.tanh(), index), mixed(h.view(-1, 2, 2), index), mixed(h[:, :3] * 2, index)
    expected = hand.head(torch.cat([a, b.flatten(1), d], 1)) + h.sum()
    exact(y, expected)
    y.sum().backward()
    expected.sum().backward()
    same_grads(model, hand)


def test_a_selector_mixes_one_element_and_a_missing_one_lists_what_there_is():
    torch.manual_seed(0)
    model = NestedNet().double().train()
    x = torch.randn(4, 5, dtype=torch.double)
    seen = {}
    mix = ManifoldMixup("block[b.features]")
    with mix.attach(model):
        model.block.register_forward_hook(lambda m, a, out: seen.update(mixed=out))
        mix.pin(lam=LAM, index=torch.tensor([1, 0, 3, 2]))
        model(x)
    h = model.block.lin(x)
    exact(seen["mixed"]["a"], h.tanh())  # not selected: untouched
    exact(seen["mixed"]["b"].features, mixed(h.view(-1, 2, 2), torch.tensor([1, 0, 3, 2])))
    assert mix.last.elements == ("[b.features]",)
    with ManifoldMixup("block[e]").attach(model):
        with pytest.raises(
            ValueError, match=r"'block\[e\]': its output has no element \[e\]; its elements: \[a\]"
        ):
            model(x)
    with ManifoldMixup("block.lin[0]").attach(model):  # a plain tensor has no elements to select
        with pytest.raises(ValueError, match=r"is a single tensor \(4, 4\), which has no element \[0\]: "
                           r"leave out the selector \('block.lin'\)"):  # fmt: skip
            model(x)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("lstm[", "malformed"),
        ("lstm[]", "selector"),
        ("lstm[0,0]", "same element twice"),
        ("a[b c]", "selector"),
    ],
)
def test_malformed_specs_are_refused_at_construction(spec, message):
    with pytest.raises(ValueError, match=message):
        ManifoldMixup(spec)
    assert parse_site("lstm[1.0, x]").paths == ((1, 0), ("x",))


def test_cutmix_on_a_tuple_asks_for_a_selector_and_says_which_map_it_cut():
    class TwoMaps(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            h = self.conv(x)
            return h, h.mean((2, 3))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = TwoMaps()
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            a, b = self.block(x)
            return self.head(torch.cat([a.mean((2, 3)), b], 1))

    model = Net().double().train()
    x = torch.randn(3, 3, 6, 6, dtype=torch.double)
    with CutMix("block").attach(model):
        with pytest.raises(
            TypeError, match=r"returns 2 tensors that carry the batch .*select it, e.g. 'block\[0\]'"
        ):
            model(x)
    mix = CutMix("block[0]")
    with mix.attach(model):
        mix.pin(index=torch.tensor([2, 0, 1]), box=(1, 4, 2, 5))
        y = model(x)
    assert mix.last.elements == ("[0]",) and mix.last.info["box"] == (1, 4, 2, 5)
    h = model.block.conv(x)
    cut = h.clone()
    cut[:, :, 1:4, 2:5] = h[[2, 0, 1], :, 1:4, 2:5]
    exact(y, model.head(torch.cat([cut.mean((2, 3)), h.mean((2, 3))], 1)))


def test_cutmix_on_a_map_too_small_to_paste_is_refused_at_the_first_forward():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=4), nn.Flatten(), nn.Linear(4, 2)).train()
    with CutMix("0").attach(model):
        with pytest.raises(ValueError, match=r"CutMix at '0': its 1x1 map is too small to ever paste a box"):
            model(torch.randn(2, 3, 4, 4))


# ------------------------------------------------------------------------ sequence-first modules


class SeqLSTM(nn.Module):
    """An nn.LSTM with the default batch_first=False, classifying from h_n (and the mean output)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 5, num_layers=2)
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.fc(h[-1] + out.mean(0) + c[-1])


def test_seq_first_lstm_is_mixed_along_the_batch_when_time_equals_batch():
    torch.manual_seed(0)
    model = SeqLSTM().double().train()
    hand = copy.deepcopy(model)
    x = torch.randn(4, 4, 3, dtype=torch.double)  # (T, B, F) with T == B: nothing can tell them apart by size
    index = torch.tensor([2, 0, 3, 1])
    mix = ManifoldMixup("lstm")
    with mix.attach(model):
        mix.pin(lam=LAM, index=index)
        y = model(x)
    assert mix.last.elements == ("[0]", "[1.0]", "[1.1]") and mix.last.batch_dims == (1, 1, 1)
    out, (h, c) = hand.lstm(x)
    expected = hand.fc(mixed(h, index, 1)[-1] + mixed(out, index, 1).mean(0) + mixed(c, index, 1)[-1])
    exact(y, expected)
    y.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    same_grads(model, hand)


def test_lstm_hn_selected_alone_and_gradclip_per_sample_along_dim_1():
    torch.manual_seed(0)
    model = SeqLSTM().double().train()
    x = torch.randn(6, 3, 3, dtype=torch.double)
    mix = ManifoldMixup("lstm[1.0]")
    with mix.attach(model):
        mix.pin(lam=LAM, index=torch.tensor([1, 2, 0]))
        y = model(x)
    out, (h, c) = model.lstm(x)
    exact(y, model.fc(mixed(h, torch.tensor([1, 2, 0]), 1)[-1] + out.mean(0) + c[-1]))
    clip = GradClip("lstm[0]", max_norm=1e-3)
    with clip.attach(model):
        model(x).sum().backward()
    assert clip.last_norms.shape == (3,)  # one norm per sample (dim 1), not per time step
    expected = []
    out = model.lstm(x)[0].detach().requires_grad_(True)
    model.fc(out.mean(0)).sum().backward()
    expected = out.grad.transpose(0, 1).reshape(3, -1).norm(dim=1)
    exact(clip.last_norms, expected)


def test_unbatched_and_packed_sequences_are_refused():
    lstm = nn.LSTM(3, 4).train()
    with ManifoldMixup("input").attach(lstm):
        with pytest.raises(TypeError, match="called without a batch"):
            lstm(torch.randn(5, 3))
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
    model = nn.Sequential()
    model.add_module("lstm", lstm)
    with ManifoldMixup("lstm[0]").attach(model):
        with pytest.raises(TypeError, match="element \\[0\\] is a PackedSequence"):
            model(packed)


class PackedRows(nn.Module):
    """A model that runs a Linear over a PackedSequence's ``.data``: its rows are all samples' time steps."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.lstm = nn.LSTM(4, 4, batch_first=True)

    def forward(self, packed):
        rows = self.embed(packed.data)
        out, (h, _) = self.lstm(nn.utils.rnn.PackedSequence(rows, packed.batch_sizes, packed.sorted_indices,
                                                            packed.unsorted_indices))  # fmt: skip
        return h[-1]


def test_a_layer_over_a_packed_sequences_rows_is_refused():
    """Its rows are time steps of different samples: mixing them as samples was silent until loss()."""
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(2, 5, 3), [5, 3], batch_first=True)
    model = PackedRows().train()
    with (
        ManifoldMixup("embed").attach(model),
        pytest.raises(TypeError, match="PackedSequence's .data") as err,
    ):
        model(packed)
    assert "has size 8, but the model's input has a batch of 2" in str(err.value) and "\n" not in str(
        err.value
    )
    with ManifoldMixup("lstm[1.0]").attach(model):  # h_n: (layers, B, H), batch at dim 1
        model(packed)


def test_transformer_encoder_with_default_batch_first_false_mixes_dim_1_inside_and_out():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double().train()
    x = torch.randn(3, 3, 8, dtype=torch.double)  # (T, B, D), T == B
    index = torch.tensor([1, 2, 0])
    for spec in ("layers.0", "layers.0.linear1", "layers.0.self_attn"):
        model, hand = copy.deepcopy(encoder), copy.deepcopy(encoder)
        mix = ManifoldMixup(spec)
        with mix.attach(model):
            mix.pin(lam=LAM, index=index)
            y = model(x)
        assert mix.last.batch_dims[0] == 1, spec
        handle = hand.get_submodule(spec).register_forward_hook(
            lambda m, a, out: (
                mixed(out, index, 1) if torch.is_tensor(out) else (mixed(out[0], index, 1), out[1])
            )
        )
        expected = hand(x)
        handle.remove()
        exact(y, expected)
        y.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        same_grads(model, hand)


class EmbedThenEncode(nn.Module):
    """A sequence-first model: its own Linear layers declare no layout."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(2, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(0))


def test_an_undeclared_layer_in_a_sequence_first_model_is_refused_unless_batch_dim_is_given():
    torch.manual_seed(0)
    model = EmbedThenEncode().double().train()
    x = torch.randn(5, 3, 2, dtype=torch.double)
    for spec in ("emb", "input"):
        with ManifoldMixup(spec).attach(model):
            with pytest.raises(
                ValueError, match=rf"cannot tell the batch dimension at '{spec}'.*pass batch_dim"
            ):
                model(x)
    hand = copy.deepcopy(model)
    mix = ManifoldMixup("emb", batch_dim=1)
    with mix.attach(model):
        mix.pin(lam=LAM, index=torch.tensor([2, 0, 1]))
        y = model(x)
    exact(y, hand.head(hand.enc(mixed(hand.emb(x), torch.tensor([2, 0, 1]), 1)).mean(0)))


def test_a_second_tensor_whose_batch_dimension_is_in_doubt_is_refused():
    class Transposed(nn.Module):
        def forward(self, x):
            return x, x.t()  # (B, D) and (D, B)

    model = nn.Sequential(nn.Linear(3, 4), Transposed()).train()
    with ManifoldMixup("1").attach(model):
        with pytest.raises(
            ValueError, match=r"cannot tell the batch dimension of element \[1\] of shape \(4, 2\)"
        ):
            model(torch.randn(2, 3))
    mix = ManifoldMixup("1[0]")
    with mix.attach(model):
        model(torch.randn(2, 3))
    assert mix.last.elements == ("[0]",)


class Pyramid(nn.Module):
    """torchvision's ``IntermediateLayerGetter`` over a ResNet: a dict of maps, (B, 64, 8, 8) and
    (B, 128, 4, 4), then a head over both."""

    def __init__(self):
        super().__init__()
        import torchvision
        from torchvision.models._utils import IntermediateLayerGetter

        self.body = IntermediateLayerGetter(torchvision.models.resnet18(), {"layer1": "a", "layer2": "b"})
        self.head = nn.Linear(64 + 128, 3)

    def forward(self, x):
        maps = self.body(x)
        return self.head(torch.cat([maps["a"].mean((2, 3)), maps["b"].mean((2, 3))], 1))


@pytest.mark.parametrize("batch", [4, 5])
def test_several_maps_carry_the_batch_first_whatever_their_sides(batch):
    """Issue 44: with a batch of 4, the (B, 128, 4, 4) map has the batch's size at three dimensions and was
    refused (at a batch of 5 it was mixed): by the convention, dim 0 is the batch wherever it has the
    batch's size."""
    torch.manual_seed(0)
    model = Pyramid().double().train()
    reference = copy.deepcopy(model)
    index = torch.arange(batch).roll(1)

    def blend(module, args, out):
        return {k: LAM * v + (1 - LAM) * v[index] for k, v in out.items()}

    reference.body.register_forward_hook(blend)
    x = torch.randn(batch, 3, 32, 32, dtype=torch.float64)
    mix = ManifoldMixup("body")
    with mix.attach(model):
        mix.pin(lam=LAM, index=index)
        exact(model(x), reference(x))
    assert mix.last.elements == ("[a]", "[b]") and mix.last.batch_dims == (0, 0)


# ------------------------------------------------------------------------ inputs by name


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.img = nn.Linear(4, 3)
        self.meta = nn.Linear(2, 3)

    def forward(self, x, meta, scale: float = 1.0):
        return (self.img(x) + self.meta(meta)) * scale


def test_several_inputs_are_mixed_with_one_draw_however_they_are_passed():
    torch.manual_seed(0)
    model = TwoInputs().double().train()
    x, meta = torch.randn(4, 4, dtype=torch.double), torch.randn(4, 2, dtype=torch.double)
    index = torch.tensor([3, 2, 1, 0])
    expected = model(mixed(x, index), mixed(meta, index), 2.0)
    for call in (
        lambda: model(x, meta, 2.0),
        lambda: model(x=x, meta=meta, scale=2.0),
        lambda: model(x, meta=meta, scale=2.0),
    ):
        mix = ManifoldMixup("input[x,meta]")
        with mix.attach(model):
            mix.pin(lam=LAM, index=index)
            exact(call(), expected)
        assert mix.last.elements == ("[x]", "[meta]")
    mix = ManifoldMixup("input[1]")  # by position
    with mix.attach(model):
        mix.pin(lam=LAM, index=index)
        y = model(x, meta)
    exact(y, model(x, mixed(meta, index)))
    mix = ManifoldMixup("input")  # a model called with keywords only: its first argument
    with mix.attach(model):
        mix.pin(lam=LAM, index=index)
        y = model(meta=meta, x=x)
    exact(y, model(mixed(x, index), meta))


# ------------------------------------------------------------------------ keyword-called layers


class KeywordCaller(nn.Module):
    """Calls its block with a keyword argument, the HuggingFace calling style."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(input=self.pre(x)).tanh())


def test_gradscale_and_inputscale_scale_a_keyword_called_layer_like_a_positional_one():
    torch.manual_seed(0)
    model = KeywordCaller().double().train()
    x = torch.randn(3, 4, dtype=torch.double)
    hand = copy.deepcopy(model)
    with GradScale("block", factor=-0.5).attach(model):
        model(x).sum().backward()
    hand.head(hand.block(hand.pre(x)).tanh()).sum().backward()
    assert torch.equal(model.block.weight.grad, hand.block.weight.grad)  # the layer's own: untouched
    exact(model.pre.weight.grad, -0.5 * hand.pre.weight.grad)  # upstream of it: scaled
    scale = InputScale("block", factor=(0.5, 1.5), generator=torch.Generator().manual_seed(1))
    with scale.attach(model):
        y = model(x)
    h = model.pre(x) * scale.last.view(-1, 1)
    exact(y, model.head(model.block(h).tanh()))


def test_a_second_mixer_is_refused_at_attach_and_oneof_is_the_way():
    model = KeywordCaller().train()
    first = ManifoldMixup("pre")
    with first.attach(model):
        with pytest.raises(RuntimeError, match=r"already has a mixing regularizer attached.*OneOf"):
            CutMix("input").attach(model)
        with pytest.raises(RuntimeError, match="already has a mixing regularizer"):
            OneOf([ManifoldMixup("pre"), NoisyFeatureMixup("block")]).attach(model)
        ActivationStats("pre").attach(model).remove()  # other hooks are welcome
    with OneOf([ManifoldMixup("pre"), NoisyFeatureMixup("block")]).attach(model):
        model(torch.randn(2, 4))
    first.attach(model).remove()  # once removed, a new one may come


def test_probes_read_the_selected_element():
    torch.manual_seed(0)
    model = SeqLSTM().double().train()
    x = torch.randn(5, 2, 3, dtype=torch.double)
    stats = ActivationStats("lstm[1.0]")
    with stats.attach(model):
        model(x)
    (row,) = stats.rows()
    h_n = model.lstm(x)[1][0]
    assert row["layer"] == "lstm[1.0]"
    assert row["mean"] == pytest.approx(float(h_n.detach().mean()), rel=1e-6)


class PaddedEncoder(nn.Module):
    """Two sequence-first encoder layers with a boolean key padding mask (True: padding); the second
    optionally under activation checkpointing, so its mask-taking call is recomputed."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.first = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.second = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
        self.head = nn.Linear(8, 2)

    def forward(self, x, key_padding_mask):
        h = self.first(x, src_key_padding_mask=key_padding_mask)
        if self.checkpointed:
            h = checkpoint(self.second, h, None, key_padding_mask, use_reentrant=False)
        else:
            h = self.second(h, src_key_padding_mask=key_padding_mask)
        return self.head(h.mean(0))


def padded_batch(checkpointed: bool):
    """A :class:`PaddedEncoder`, its copy for the hand computation, a (T, B, D) batch of 3 with its
    padding mask (True: padding; sample 1 has none), and the pinned permutation."""
    torch.manual_seed(0)
    model = PaddedEncoder(checkpointed).double().train()
    x = torch.randn(5, 3, 8, dtype=torch.double)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    pad[2, 1:] = True
    return model, copy.deepcopy(model), x, pad, torch.tensor([2, 0, 1])


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_boolean_key_padding_mask_downstream_is_the_union_of_real_positions(checkpointed):
    model, hand, x, pad, index = padded_batch(checkpointed)
    mix = ManifoldMixup("first")
    with mix.attach(model):
        mix.pin(lam=LAM, index=index)
        y = model(x, pad)
        y.pow(2).sum().backward()  # inside the with block: a recomputation needs the hooks
    union = pad & pad[index]  # padding only where both partners pad: real in either
    expected = hand.head(
        hand.second(
            mixed(hand.first(x, src_key_padding_mask=pad), index, 1), src_key_padding_mask=union
        ).mean(0)
    )
    exact(y, expected)
    expected.pow(2).sum().backward()
    same_grads(model, hand)


def test_an_input_mix_in_a_whole_model_checkpoint_replays_the_union_of_the_models_mask():
    model, hand, x, pad, index = padded_batch(checkpointed=False)
    mix = ManifoldMixup("input", batch_dim=1)
    with mix.attach(model):
        mix.pin(lam=LAM, index=index)
        y = checkpoint(model, x, pad, use_reentrant=False)  # the recomputation runs the model's hooks
        y.pow(2).sum().backward()
    expected = hand(mixed(x, index, 1), pad & pad[index])
    exact(y, expected)
    expected.pow(2).sum().backward()
    same_grads(model, hand)


def test_removing_the_hooks_before_the_backward_of_a_recomputed_forward_is_refused():
    torch.manual_seed(0)
    model = PaddedEncoder(checkpointed=True).double().train()
    x, pad = torch.randn(5, 3, 8, dtype=torch.double), torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 2:] = True
    with ManifoldMixup("first").attach(model):
        y = model(x, pad)  # the padding union was applied inside the checkpointed second layer
    with pytest.raises(RuntimeError, match=r"ManifoldMixup acted inside an activation-checkpointed region.*"
                       r"call backward\(\) before removing the hooks"):  # fmt: skip
        y.sum().backward()
    with ManifoldMixup("first").attach(model):
        y = model(x, pad)
        y.sum().backward()  # inside: fine
