"""mixhook under TRL's SFTTrainer (the trainer most language-model fine-tuning runs), through the
HuggingFace adapter: Manifold Mixup at a decoder layer (MixupCallback and its compute_loss_func) and
NEFTune at the embeddings (HookCallback) train the weights a hand loop trains on the same draws, with
TRL's completion-only loss mask (its -100 labels) honoured; a resumed run draws what the uninterrupted one
drew; packing, and NEFTune twice, are refused in one line."""

import pytest
import torch
import torch.nn.functional as F

from harness.language_models import llama, sft
from mixhook import ManifoldMixup, NEFTune, RegMixup
from mixhook.integrations.draws import reseed
from mixhook.packing import PackedBatchError
from tests.helpers import Lazy

adapter = Lazy("mixhook.integrations.transformers")  # imports transformers: when a test first uses it
lm_adapter = Lazy("mixhook.integrations.lm")

transformers = Lazy("transformers")
trl = Lazy("trl")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # TRL: compute_loss_func is deprecated


def summed(logits, labels):
    """The causal LM loss summed over the labelled tokens: position t predicts label t + 1."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
    )


def hand_loop(model, batches, items, mixer, neftune, accumulate=2, seed=7):
    """What the SFTTrainer does with the two callbacks, in a plain loop: per optimizer step, the draws
    reseeded from (seed, rank 0, step), each micro-batch's mixed summed loss over the labelled tokens of
    the step's micro-batches (``items``: the Trainer's count), SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mixer.attach(model), neftune.attach(model):
        model.train()
        for step, first in enumerate(range(0, len(batches), accumulate)):
            reseed(mixer, seed, 0, step)
            reseed(neftune, seed, 0, step, adapter.HookCallback._FIRST_PART)
            for batch, n in zip(
                batches[first : first + accumulate], items[first : first + accumulate], strict=True
            ):
                out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                (mixer.loss(summed, out.logits, batch["labels"]) / n).backward()
            opt.step()
            opt.zero_grad()
    return model


@pytest.mark.slow
def test_sft_with_manifold_mixup_and_neftune_equals_the_hand_loop(tmp_path):
    """TRL runs the model twice per micro-batch (the loss, then a forward without gradients for its
    metrics): only the first is mixed and noised, and the second draws nothing (under gradient
    accumulation the next micro-batch draws what the hand loop's does); the completion-only mask's -100
    labels leave the prompts out of both partners' losses."""
    model, hand = llama(), llama()
    mixup = adapter.MixupCallback(ManifoldMixup("model.layers.0"))
    noise = adapter.HookCallback(NEFTune("model.embed_tokens", alpha=5.0))
    items = []

    def loss(outputs, labels, num_items_in_batch=None):
        items.append(num_items_in_batch)
        return mixup.compute_loss(outputs, labels, num_items_in_batch)

    trainer = sft(model, tmp_path, [mixup, noise], loss, gradient_accumulation_steps=2)
    batches = list(trainer.get_train_dataloader())
    assert all((b["labels"][:, :2] == -100).all() for b in batches)  # the prompts carry no loss
    trainer.train()
    hand_loop(hand, batches, items, ManifoldMixup("model.layers.0"), NEFTune("model.embed_tokens", alpha=5.0))
    for (name, p), q in zip(model.named_parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
def test_neftune_alone_under_trls_own_loss_adds_the_hand_loops_noise(tmp_path):
    """Without a compute_loss_func TRL takes its own loss from a fused LM head (the log-probabilities of
    the labels, computed in float32 whatever the model's dtype, so the weights are compared elsewhere):
    the noise is added in that forward, the one that trains, and is the hand loop's noise, draw for draw."""

    def recording(model, noises):
        def record(module, args, out):
            if torch.is_grad_enabled():
                noises.append((out - F.embedding(args[0], module.weight)).detach())

        return model.model.embed_tokens.register_forward_hook(record)  # after NEFTune's: the noised output

    model, hand, noises, hand_noises = llama(), llama(), [], []
    trainer = sft(model, tmp_path, [adapter.HookCallback(NEFTune("model.embed_tokens", alpha=5.0))])
    batches = list(trainer.get_train_dataloader())
    recording(model, noises)
    trainer.train()
    neftune, opt = NEFTune("model.embed_tokens", alpha=5.0), torch.optim.SGD(hand.parameters(), lr=0.1)
    with neftune.attach(hand):
        recording(hand, hand_noises)
        hand.train()
        for step, batch in enumerate(batches):
            reseed(neftune, 7, 0, step, adapter.HookCallback._FIRST_PART)
            out = hand(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            (summed(out.logits, batch["labels"]) / (batch["labels"][:, 1:] != -100).sum()).backward()
            opt.step()
            opt.zero_grad()
    assert len(noises) == len(batches) == len(hand_noises)
    for noise, expected, batch in zip(noises, hand_noises, batches, strict=True):
        torch.testing.assert_close(noise, expected, rtol=0, atol=1e-12)
        assert not noise[batch["attention_mask"] == 0].any() and noise.abs().max() > 0


@pytest.mark.slow
def test_a_subclass_taking_the_mixed_loss_trains_what_compute_loss_func_trains(tmp_path):
    """TRL deprecates compute_loss_func (removed in TRL 2.0): the subclass of the Language models page
    takes the same loss through the Trainer's own compute_loss, with no warning and no second forward."""

    class MixupSFTTrainer(trl.SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return transformers.Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    models = []
    for subclass in (False, True):
        model = llama()
        mixup = adapter.MixupCallback(ManifoldMixup("model.layers.0"))
        if subclass:
            trainer = sft(model, tmp_path, [mixup], gradient_accumulation_steps=2, cls=MixupSFTTrainer)
            trainer.compute_loss_func = mixup.compute_loss
        else:
            trainer = sft(model, tmp_path, [mixup], mixup.compute_loss, gradient_accumulation_steps=2)
        trainer.train()
        models.append(model)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.slow
def test_a_resumed_sft_run_draws_what_the_uninterrupted_one_drew(tmp_path):
    def run(out, resume=None, steps=3):
        model = llama()
        callbacks = [
            adapter.MixupCallback(ManifoldMixup("model.layers.0")),
            adapter.HookCallback(NEFTune("model.embed_tokens")),
        ]
        trainer = sft(
            model,
            out,
            callbacks,
            callbacks[0].compute_loss,
            max_steps=steps,
            save_strategy="steps",
            save_steps=1,
        )
        trainer.train(resume_from_checkpoint=resume)
        return model

    whole = run(tmp_path / "whole")
    run(tmp_path / "part", steps=1)
    resumed = run(tmp_path / "part", resume=str(tmp_path / "part" / "checkpoint-1"))
    for p, q in zip(resumed.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.slow
def test_packing_neftune_twice_and_restored_callback_states_are_refused(tmp_path):
    mixup = adapter.MixupCallback(ManifoldMixup("model.layers.0"))
    trainer = sft(llama(), tmp_path, [mixup], mixup.compute_loss, packing=True, max_length=16)
    with pytest.raises(PackedBatchError, match="several sequences share a row") as err:
        trainer.train()
    assert "packing=False" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="the noise would be added twice"):
        sft(llama(), tmp_path, [adapter.HookCallback(NEFTune("model.embed_tokens"))], neftune_noise_alpha=5.0)
    regmixup = adapter.MixupCallback(RegMixup("model.layers.0"))  # 2B rows of logits: TRL's metrics read B
    with pytest.raises(ValueError, match="RegMixup keeps the clean batch .* TRL's SFTTrainer") as err:
        sft(llama(), tmp_path, [regmixup], regmixup.compute_loss)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="HookCallback on resume by a new one without its hooks"):
        sft(
            llama(), tmp_path, [adapter.HookCallback(NEFTune("model.embed_tokens"))],
            restore_callback_states_from_checkpoint=True,
        )  # fmt: skip


@pytest.mark.slow
def test_noisefits_loss_in_the_sft_trainer_trains_as_the_hand_loop(tmp_path):
    """NoiseFiTLoss mixed into TRL's SFTTrainer (its compute_loss replaces TRL's, as the authors' subclass
    replaces the Trainer's): with the completion-only mask's -100 labels, right padding and gradient
    accumulation, the weights after the run are the hand loop's on the collator's batches and the same
    draws (each micro-batch's NoiseFiT loss, a mean over its labelled tokens, divided by the steps)."""
    from mixhook import NoiseFiT

    class NoiseFiTSFTTrainer(lm_adapter.NoiseFiTLoss, trl.SFTTrainer):
        pass

    layers = ["model.layers.0", "model.layers.1"]
    model, hand = llama(), llama()
    trainer = sft(model, tmp_path, [adapter.HookCallback(NoiseFiT(layers, noise_std=0.5))],
                  cls=NoiseFiTSFTTrainer, gradient_accumulation_steps=2)  # fmt: skip
    batches = list(trainer.get_train_dataloader())
    assert all((b["labels"][:, :2] == -100).all() for b in batches)  # the prompts carry no loss
    assert any((b["attention_mask"] == 0).any() for b in batches)  # (padded rows)
    trainer.train()
    nf, opt = NoiseFiT(layers, noise_std=0.5), torch.optim.SGD(hand.parameters(), lr=0.1)
    with nf.attach(hand):
        hand.train()
        for step, first in enumerate(range(0, len(batches), 2)):
            reseed(nf, 7, 0, step, adapter.HookCallback._FIRST_PART)
            micro = batches[first : first + 2]  # (the last step has one: the Trainer divides by its count)
            for batch in micro:
                (nf.loss(hand, batch)[0] / len(micro)).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    assert not torch.equal(next(model.parameters()), next(llama().parameters()))  # (it trained)
