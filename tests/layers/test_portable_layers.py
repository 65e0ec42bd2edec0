"""Portable layer specs (stage:k, block:k, depth:f), globs and slices: what they resolve to on each
library's models, that a hook at a portable spec is the hook at the real name (logits and gradients), that
a spec is resolved again at each attach, and the one-line refusals."""

import copy
import pickle

import pytest
import torch
import torchvision
from torch import nn

import mixhook
from harness.language_models import tiny_llama
from mixhook import CutMix, ManifoldMixup, UnknownLayerError, register_layers, resolve_layer, resolve_layers
from mixhook.layers import describe, parse_spec, portable_names
from tests.helpers import Lazy, grads

transformers = Lazy("transformers")
peft = Lazy("peft")
timm = Lazy("timm")

LAM, INDEX = 0.3, torch.tensor([2, 3, 0, 1])


def names(model, *specs):
    return list(resolve_layers(model, list(specs)))


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=5).double()


# ----------------------------------------------------------------------------------------- what they name


def test_stage_block_and_depth_on_a_torchvision_resnet_follow_timms_numbering(resnet):
    assert names(resnet, "stage:0", "stage:2", "stage:-1") == ["relu", "layer2", "layer4"]
    assert names(resnet, "block:0", "block:3", "block:-1") == ["layer1.0", "layer2.1", "layer4.1"]
    # 8 blocks: 0.5 of the depth is 3.5, rounded up; 0 and 1 are the first and the last
    assert names(resnet, "depth:0", "depth:0.5", "depth:1") == ["layer1.0", "layer3.0", "layer4.1"]
    assert names(resnet, "block:3[0]") == ["layer2.1[0]"]  # a selector travels with the spec
    tm = timm.create_model("resnet18", pretrained=False, num_classes=5)  # the same places, by timm's word
    assert names(tm, "stage:0", "stage:2", "block:3", "depth:0.5") == [
        "act1",
        "layer2",
        "layer2.1",
        "layer3.0",
    ]


def test_globs_and_slices_name_real_modules_in_forward_order(resnet):
    assert names(resnet, "layer*.0.conv1") == [f"layer{i}.0.conv1" for i in range(1, 5)]
    assert names(resnet, "**.downsample") == [f"layer{i}.0.downsample" for i in (2, 3, 4)]
    assert names(resnet, "layer1[0:2]") == ["layer1.0", "layer1.1"]
    assert names(resnet, "layer2[-1]") == ["layer2.1"]  # an index on a module list: the member
    assert names(resnet, "layer*[-1]") == [f"layer{i}.1" for i in range(1, 5)]
    assert names(resnet, "layer4.0.downsample[::2]") == ["layer4.0.downsample.0"]
    assert names(resnet, "input", "layer3") == ["input", "layer3"]  # real names as before


def test_a_vit_states_blocks_and_no_stages():
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=3, embed_dim=48, num_heads=2)
    assert names(vit, "block:0", "block:-1", "depth:0.5") == ["blocks.0", "blocks.2", "blocks.1"]
    with pytest.raises(UnknownLayerError, match=r"no feature pyramid .*; name a block: block:k or depth:f$"):
        resolve_layers(vit, ["stage:1"])
    assert portable_names(vit)["blocks.1"] == ["block:1"]


@pytest.mark.slow
def test_huggingface_blocks_come_from_the_config_and_an_encoder_decoder_names_each_part():
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_decoder_layers=2, num_heads=2
    )
    t5 = transformers.T5ForConditionalGeneration(config)
    assert names(t5, "encoder.block:-1", "decoder.block:0", "decoder.depth:1") == [
        "encoder.block.2", "decoder.block.0", "decoder.block.1"
    ]  # fmt: skip
    with pytest.raises(
        UnknownLayerError, match=r"2 block lists .*name one: encoder\.block:k, decoder\.block:k$"
    ):
        resolve_layers(t5, ["block:0"])


def test_a_model_wrapping_a_described_one_is_described_by_it_and_two_are_named_apart(resnet):
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = copy.deepcopy(resnet)

    assert names(Wrapper(), "stage:2", "block:-1") == ["backbone.layer2", "backbone.layer4.1"]

    class Two(Wrapper):
        def __init__(self):
            super().__init__()
            self.other = copy.deepcopy(resnet)

    with pytest.raises(
        UnknownLayerError, match=r"holds 2 models that state their own \(backbone, other\); name one"
    ):
        resolve_layers(Two(), ["stage:2"])
    assert names(Two(), "other.stage:2") == ["other.layer2"]


def test_a_registration_states_a_users_model_and_its_subclasses():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(1, 4, 3)
            self.body = nn.Sequential(*(nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU()) for _ in range(4)))

    class Deeper(Net):
        pass

    with pytest.raises(
        UnknownLayerError, match=r"\(Net\) states no stages or blocks .*register_layers\(Net,"
    ):
        resolve_layers(Net(), ["block:0"])
    register_layers(Net, stages=["stem", "body.1", "body.3"], blocks=["body.*"])
    try:
        assert names(Deeper(), "stage:1", "block:2", "depth:1") == ["body.1", "body.2", "body.3"]
        assert describe(Net()).source == "registered for Net"
        register_layers(Net, blocks=lambda model: ["body.0", "body.2"])
        assert names(Net(), "block:-1") == ["body.2"]
        with pytest.raises(UnknownLayerError, match="registration states no stages"):
            resolve_layers(Net(), ["stage:0"])
    finally:
        mixhook.layers.structure._REGISTERED.pop(Net, None)
    with pytest.raises(TypeError, match="a list of layer specs or a function"):
        register_layers(Net, blocks="body.*")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("stage:5", r"'stage:5': ResNet has 5 stages, stage:0\.\.4 \(or stage:-5\.\.-1\): relu, layer1"),
        ("block:-9", r"has 8 blocks, block:0\.\.7 \(or block:-8\.\.-1\)"),
        ("layers.*.mlp", r"'layers\.\*\.mlp': the glob matches no module of ResNet"),
        (
            "layer1.0[0:2]",
            r"'layer1\.0' is a BasicBlock, not a module list; an index or a slice takes members",
        ),
        ("layer1[5]", r"'layer1' has 2 members; index 0\.\.1"),
        ("layer1[3:]", "the slice takes none of 'layer1'"),
        ("nosuch.block:0", "ResNet has no module 'nosuch' to look in"),
    ],
)
def test_bad_specs_are_refused_in_one_line_naming_what_is_valid(resnet, spec, match):
    with pytest.raises(UnknownLayerError, match=match) as info:
        resolve_layers(resnet, [spec])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("stage:x", "stage takes an integer index"),
        ("depth:1.5", r"depth takes a fraction of the model's depth in \[0, 1\]"),
        ("level:2", "'level' is not a portable kind; write stage:k, block:k or depth:f"),
        ("blocks[1:4:0]", "a slice's step cannot be 0"),
        ("a.x**.b", r"\*\* alone"),
    ],
)
def test_malformed_specs_are_refused_before_any_model(spec, match):
    with pytest.raises(ValueError, match=match):
        ManifoldMixup(spec)
    with pytest.raises(ValueError, match=match):
        parse_spec(spec)


def test_two_specs_naming_one_layer_are_refused(resnet):
    with pytest.raises(UnknownLayerError, match=r"'layer2' is named more than once \('stage:2' is 'layer2'"):
        ManifoldMixup(["layer2", "stage:2"]).attach(resnet)
    with pytest.raises(UnknownLayerError, match=r"attention='layer\*' names 4 layers"):
        resolve_layer(resnet, "layer*", "attention")


def test_a_model_that_states_nothing_is_refused_not_guessed():
    model = torchvision.models.densenet121(num_classes=3)
    with pytest.raises(UnknownLayerError, match=r"\(DenseNet\) states no stages or blocks") as info:
        ManifoldMixup("stage:1").attach(model)
    assert "\n" not in str(info.value)
    assert portable_names(model) == {}


# ------------------------------------------------------------------------------------- hooks at a spec


def _step(model, mixer, x, pin=None):
    model.zero_grad()
    with mixer.attach(model):
        mixer.pin(**(pin or {"lam": LAM, "index": INDEX}))
        logits = model(x)
        mixer.loss(torch.nn.functional.cross_entropy, logits, torch.tensor([0, 1, 2, 3])).backward()
    return logits.detach(), grads(model)


@pytest.mark.slow
def test_a_mixer_at_a_portable_spec_is_the_mixer_at_its_real_name(resnet):
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for spec, real in (("stage:2", "layer2"), ("depth:0.5", "layer3.0"), ("layer4[-1]", "layer4.1")):
        got = _step(resnet, ManifoldMixup(spec), x)
        want = _step(resnet, ManifoldMixup(real), x)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[1].keys() == want[1].keys()
        for name in want[1]:
            torch.testing.assert_close(got[1][name], want[1][name], rtol=0, atol=0, msg=name)
    box = {"box": torch.tensor([0, 2, 0, 2])}
    got, want = _step(resnet, CutMix("stage:1"), x, box), _step(resnet, CutMix("layer1"), x, box)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def test_a_spec_is_resolved_again_at_each_attach_and_a_copy_keeps_it_as_written(resnet):
    model = copy.deepcopy(resnet)
    mix = ManifoldMixup(["input", "stage:3"])
    with mix.attach(model):
        assert mix.layers == ("input", "layer3") and mix.specs == ("input", "stage:3")
        assert mix.resolved == {"input": ("input",), "stage:3": ("layer3",)}
        state = mix.state_dict()
        clone = copy.deepcopy(mix)
        assert clone.layers == ("input", "stage:3") and clone.model is None
    assert mix.layers == ("input", "stage:3") and mix.resolved == {}
    assert state["layers"] == ["input", "stage:3"]
    again = pickle.loads(pickle.dumps(mix))
    again.load_state_dict(state)

    class Wrapped(nn.Module):  # the model changed (a wrapper, as PEFT adds): the spec follows it
        def __init__(self, inner):
            super().__init__()
            self.net = inner

        def forward(self, x):
            return self.net(x)

    wrapped = Wrapped(model)
    with mix.attach(wrapped):
        assert mix.layers == ("input", "net.layer3")
        x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
        mix.pin(layer="stage:3", lam=LAM, index=INDEX)  # a pin may name the spec
        wrapped(x)
        assert mix.last.layer == "net.layer3"


def test_a_pattern_shares_its_layer_weight_among_the_layers_it_names():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(*(nn.Linear(3, 3) for _ in range(4)))

        def forward(self, x):
            return self.blocks(x)

    mix = ManifoldMixup(["input", "blocks[0:4]"], generator=torch.Generator().manual_seed(0))
    mix.layer_weights = [1, 1]
    model = Net()
    with mix.attach(model):
        assert mix.layers == ("input", "blocks.0", "blocks.1", "blocks.2", "blocks.3")
        seen = []
        for _ in range(800):
            model(torch.randn(4, 3))
            seen.append(mix.last.layer)
    share = seen.count("input") / len(seen)
    assert 0.44 < share < 0.56, share  # the input half the time, each block an eighth
    assert all(0.08 < seen.count(f"blocks.{k}") / len(seen) < 0.17 for k in range(4))


@pytest.mark.parametrize("wrapped", [False, True], ids=["llama", "llama-under-peft"])
def test_huggingface_block_specs_are_the_real_names_hook(wrapped):
    model, prefix = tiny_llama(num_hidden_layers=3), ""
    if wrapped:
        lora = peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.0, init_lora_weights=False)
        model, prefix = peft.get_peft_model(model, lora), "base_model.model."
    model.train()
    ids = torch.randint(3, 64, (4, 7), generator=torch.Generator().manual_seed(0))
    results = []
    for spec in ("block:-1", "depth:0.5", f"{prefix}model.layers.2", f"{prefix}model.layers.1"):
        model.zero_grad()
        mix = ManifoldMixup(spec)
        with mix.attach(model):
            mix.pin(lam=LAM, index=INDEX)
            logits = model(input_ids=ids).logits
            loss = mix.loss(lambda z, y: z.pow(2).mean() + 0 * y.sum(), logits, ids)
            loss.backward()
        results.append((logits.detach(), loss.detach(), grads(model)))
    for got, want in ((results[0], results[2]), (results[1], results[3])):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])
    assert not torch.equal(results[0][0], results[1][0])  # two different layers, two different mixes


@pytest.mark.parametrize(
    ("config_cls", "model_cls", "options", "spec", "real"),
    [
        ("BertConfig", "BertForSequenceClassification",
         dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32), "block:1",
         "bert.encoder.layer.1"),
        ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=16, n_layer=3, n_head=2, n_positions=32), "depth:0.5",
         "transformer.h.1"),
        ("T5Config", "T5ForConditionalGeneration",
         dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
              decoder_start_token_id=0, dropout_rate=0.0), "decoder.block:1", "decoder.block.1"),
    ],
)  # fmt: skip
def test_bert_gpt2_and_t5_block_specs_are_the_real_names_hook(config_cls, model_cls, options, spec, real):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(vocab_size=64, attn_implementation="eager", **options)
    model = getattr(transformers, model_cls)(config).double().train()
    for module in model.modules():  # (dropout off: two forwards may differ by the mix alone; T5's
        # attention drops with its config's dropout_rate)
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    assert names(model, spec) == [real]
    ids = torch.randint(3, 64, (4, 7), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, **({"decoder_input_ids": ids[:, :5]} if "T5" in config_cls else {})}
    results = []
    for layer in (spec, real):
        model.zero_grad()
        mix = ManifoldMixup(layer)
        with mix.attach(model):
            mix.pin(lam=LAM, index=INDEX)
            logits = model(**inputs).logits
            loss = mix.loss(lambda z, y: z.pow(2).mean() + 0 * y.sum(), logits, ids)
            loss.backward()
        results.append((logits.detach(), loss.detach(), grads(model)))
    (got_logits, got_loss, got_grads), (logits, loss, want) = results
    assert torch.equal(got_logits, logits) and torch.equal(got_loss, loss)
    assert got_grads.keys() == want.keys() and all(torch.equal(got_grads[n], want[n]) for n in want)
