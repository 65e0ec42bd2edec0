"""PEFT: a LoRA fine-tune mixed at a decoder layer of the wrapped model, as a hand-edited forward; what
merge_and_unload() and unload() leave (a replaced LoRA module, an inner model called on its own) refused
in one line, never silently unmixed; a saved adapter holds no hook. Real PEFT on a Llama from a tiny
config."""

import copy

import pytest
import torch

from harness.language_models import tiny_llama
from mixhook import ManifoldMixup, NEFTune, UnknownLayerError
from tests.helpers import Lazy, hook_count

peft = Lazy("peft")

LAM, INDEX = 0.3, torch.tensor([2, 3, 0, 1])
IDS = torch.randint(3, 64, (4, 7), generator=torch.Generator().manual_seed(0))
LAYER = "base_model.model.model.layers.0"
LORA = "base_model.model.model.layers.1.self_attn.q_proj"


def lora_llama():
    model = tiny_llama()
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    return peft.get_peft_model(model, lora).train()


def test_a_lora_fine_tune_mixes_as_a_hand_edited_forward():
    model = lora_llama()
    hand = copy.deepcopy(model)
    with pytest.raises(UnknownLayerError, match=f"did you mean '{LAYER}' \\(the model wraps its layers"):
        ManifoldMixup("model.layers.0").attach(model)
    mix = ManifoldMixup(LAYER)
    with mix.attach(model):
        mix.pin(lam=LAM, index=INDEX)
        logits = model(input_ids=IDS).logits
        logits.pow(2).mean().backward()
    hand.get_submodule(LAYER).register_forward_hook(lambda m, a, out: LAM * out + (1 - LAM) * out[INDEX])
    expected = hand(input_ids=IDS).logits
    expected.pow(2).mean().backward()
    torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-12)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    for (name, p), q in zip(model.named_parameters(), hand.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("how", ["merge_and_unload", "unload"])
def test_merging_or_unloading_is_refused_in_one_line_not_silently_unmixed(how):
    """A mixer on a LoRA module: merge_and_unload() replaces the module by its base layer, in the
    PeftModel too (which then never runs the hooked module: refused at the end of the forward, naming
    the replacement). A mixer anywhere: the model merge_and_unload() returns is the inner model, which the
    PeftModel's hooks never see (refused at its first training forward). NEFTune alike."""
    for layer in (LORA, LAYER):
        model = lora_llama()
        mix = ManifoldMixup(layer)
        noise = NEFTune("base_model.model.model.embed_tokens")
        with mix.attach(model):
            model(input_ids=IDS)
            inner = getattr(model, how)()
            if layer == LORA:
                with pytest.raises(RuntimeError, match="was replaced by a Linear") as err:
                    model(input_ids=IDS)
                assert "merge_and_unload() or unload()" in str(err.value) and "\n" not in str(err.value)
            with pytest.raises(
                RuntimeError, match="LlamaForCausalLM was called on its own, not through the PeftModel"
            ):
                inner(input_ids=IDS)
        with noise.attach(model), pytest.raises(RuntimeError, match="so nothing would be noised"):
            inner(input_ids=IDS)
        with torch.no_grad():
            inner(input_ids=IDS)  # a forward that cannot train is no loss: left alone


def test_a_saved_adapter_holds_no_hook(tmp_path):
    model = lora_llama()
    with ManifoldMixup(LAYER).attach(model), NEFTune("base_model.model.model.embed_tokens").attach(model):
        model(input_ids=IDS)
        model.save_pretrained(tmp_path / "adapter")
    torch.manual_seed(0)
    base = lora_llama().get_base_model()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert hook_count(loaded) == 0
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        if "lora_" in name:
            torch.testing.assert_close(p, q, msg=name)


def test_a_forward_that_failed_leaves_no_stale_inside_for_the_guard():
    """A training forward of the PeftModel that raises half-way (here a batch the embeddings cannot
    take) must not leave the guard believing the next call of the inner model runs inside it."""
    model = lora_llama()
    with ManifoldMixup(LAYER).attach(model):
        with pytest.raises(IndexError):
            model(input_ids=IDS + 1000)  # ids outside the vocabulary: the embedding raises
        with pytest.raises(RuntimeError, match="was called on its own, not through the PeftModel"):
            model.get_base_model()(input_ids=IDS)
        model(input_ids=IDS)  # through the PeftModel: mixed, not refused
