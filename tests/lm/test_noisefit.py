"""NoiseFiT (mixhook.lm.noisefit) against the authors' code on the same draws, in float64 on a tiny Llama: the
adaptive noise, the layer choice by signal-to-noise ratio, and the training loss over one clean and two noisy
forwards (loss and every gradient), under activation checkpointing too; and what it refuses."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mixhook.lm.noisefit import NoiseFiT, adaptive_noise, blocks_of, choose_layers

transformers = pytest.importorskip("transformers")

# --- the authors' code: akhadangi/NoiseFiT, NoiseFiT.py (commit 1356f6a), the lines the tests need. Two
# substitutions, each marked: their normal draws come from a generator passed in (theirs: torch.randn_like,
# the global generator), and their hook takes a decoder layer's output as transformers 5 gives it (a tensor;
# their output[0] is transformers 4's tuple). Their noise's scale passes through a float32 tensor (the gate,
# torch.tensor(1.0)), so in float64 it is theirs to float32's precision (a relative 6e-8): the tolerances.

EPSILON = 1e-6
DEFAULT_BETA = 0.1


def adaptive_noise_injection(target_embeds, base_std, generator, beta=DEFAULT_BETA, noise_scale=1.0,
                             noise_gate=1.0, logits=None):  # fmt: skip
    if logits is not None:
        p = F.softmax(logits, dim=-1)
        entropy = -(p * torch.log(p + EPSILON)).sum(dim=-1, keepdim=True)
        noise_factor = torch.exp(entropy)
    else:
        embed_var = target_embeds.var(dim=-1, keepdim=True)
        noise_factor = torch.exp(embed_var / (embed_var.mean() + EPSILON))
    noise_factor = torch.clamp(noise_factor, max=5.0)
    median = target_embeds.median(dim=-1, keepdim=True).values
    mad = (target_embeds - median).abs().median(dim=-1, keepdim=True).values
    token_norm = target_embeds.norm(dim=-1, keepdim=True)
    mad = mad.clamp(min=EPSILON * token_norm)
    weight = torch.exp(-beta * torch.abs(target_embeds - median) / (mad + EPSILON))
    gate = torch.tensor(noise_gate, device=target_embeds.device).clamp(0, 1)
    effective_scale = base_std * noise_scale * gate * mad * weight * noise_factor
    noise = torch.empty_like(target_embeds).normal_(generator=generator) * effective_scale  # (substituted)
    return target_embeds + noise


def select_layers(model, batch, noise_std, num_noise_layers, snr_format, generator):
    model.eval()
    layers = list(model.model.layers)
    num_layers = len(layers)
    num_noisy_passes = 10
    with torch.no_grad():
        outputs_clean = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
        hidden_clean = outputs_clean.hidden_states[1:]
        signal_per_layer = [h.abs().mean() for h in hidden_clean]
        noise_diff = torch.zeros((num_noisy_passes, len(hidden_clean)), device=model.device)
        for pass_idx in range(num_noisy_passes):
            for i, h_clean in enumerate(hidden_clean):
                noise_std_hidden = noise_std * h_clean.std().item()
                h_noisy = adaptive_noise_injection(h_clean, base_std=noise_std_hidden, generator=generator)
                noise_diff[pass_idx, i] = (h_noisy - h_clean).abs().mean()
        avg_noise_diff = noise_diff.mean(dim=0)
        snr = torch.tensor(
            [signal_per_layer[i] / (avg_noise_diff[i] + 1e-6) for i in range(num_layers)], device=model.device
        )
    largest = snr_format == "Largest"
    _, indices = torch.topk(snr, num_noise_layers, largest=largest)
    return indices.tolist()


class Authors:
    """NoiseFitTrainer's hook and compute_loss, on a model of our own."""

    def __init__(self, model, indices, noise_std, generator, temperature=1.0, hybrid_loss_alpha=0.5,
                 lambda_consistency=0.1):  # fmt: skip
        self.noise_std, self.temperature, self.generator = noise_std, temperature, generator
        self.hybrid_loss_alpha, self.lambda_consistency = hybrid_loss_alpha, lambda_consistency
        self.inject_noise = False
        for idx in indices:
            model.model.layers[idx].register_forward_hook(self.noise_hook)

    def noise_hook(self, module, input, output):
        if self.inject_noise:
            hidden_states = output  # (substituted: transformers 5's decoder layer returns the tensor)
            noise_std_hidden = self.noise_std * hidden_states.std().item()
            return adaptive_noise_injection(
                hidden_states, base_std=noise_std_hidden * self.noise_std, generator=self.generator
            )
        return output

    def compute_loss(self, model, inputs):
        self.inject_noise = False
        outputs = model(**inputs)
        ce_loss = outputs.loss
        logits = outputs.logits
        labels = inputs["labels"]
        target_mask = labels != -100
        self.inject_noise = True
        logits_noise1 = model(**inputs).logits
        logits_noise2 = model(**inputs).logits
        soft_targets = F.softmax(logits / self.temperature, dim=-1)
        soft_ce_loss1 = F.kl_div(F.log_softmax(logits_noise1, dim=-1), soft_targets, reduction="none").sum(
            dim=-1
        )
        soft_ce_loss2 = F.kl_div(F.log_softmax(logits_noise2, dim=-1), soft_targets, reduction="none").sum(
            dim=-1
        )
        soft_ce_loss = 0.5 * (soft_ce_loss1 + soft_ce_loss2)
        soft_ce_loss = (soft_ce_loss * target_mask.float()).sum() / target_mask.sum()
        consistency_loss = F.kl_div(
            F.log_softmax(logits_noise1, dim=-1), F.softmax(logits_noise2, dim=-1), reduction="none"
        ).sum(dim=-1)
        consistency_loss = (consistency_loss * target_mask.float()).sum() / target_mask.sum()
        hybrid_loss = self.hybrid_loss_alpha * ce_loss + (1 - self.hybrid_loss_alpha) * soft_ce_loss
        return hybrid_loss + self.lambda_consistency * consistency_loss


# --- the end of the authors' lines


def llama(layers: int = 4):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double().train()


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 5:] = 0  # a padded sequence
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def gen(seed=7):
    return torch.Generator().manual_seed(seed)


def test_the_noise_is_the_authors_on_the_same_draws():
    h = torch.randn(3, 5, 16, dtype=torch.float64, generator=gen(1)) * torch.linspace(0.1, 3, 16).double()
    ours = adaptive_noise(h, 0.3, gen(), beta=0.2)
    theirs = adaptive_noise_injection(h, 0.3, gen(), beta=0.2)
    torch.testing.assert_close(ours - h, theirs - h, rtol=1e-7, atol=0)  # (the noise: see above)
    assert not torch.equal(ours, h)


@pytest.mark.parametrize("snr", ["largest", "lowest"])
def test_the_layers_chosen_are_the_authors(snr):
    model = llama(6)
    theirs = select_layers(
        copy.deepcopy(model), batch(), 0.1, 3, "Largest" if snr == "largest" else "Lowest", gen()
    )
    ours = choose_layers(model, batch(), k=3, snr=snr, noise_std=0.1, generator=gen())
    assert ours == [f"model.layers.{i}" for i in theirs]
    assert model.training  # (its mode restored)
    assert blocks_of(model) == [f"model.layers.{i}" for i in range(6)]


def test_the_loss_and_every_gradient_are_the_authors():
    model, inputs = llama(), batch()
    reference = copy.deepcopy(model)
    chosen = [2, 0]
    authors = Authors(reference, chosen, noise_std=0.3, generator=gen())
    expected = authors.compute_loss(reference, inputs)
    expected.backward()
    names = [f"model.layers.{i}" for i in chosen]
    nf = NoiseFiT(names, noise_std=0.3, generator=gen())
    with nf.attach(model):
        loss, outputs = nf.loss(model, inputs)
        loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-7, atol=0)  # (their float32 scale: see above)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-10, msg=name)
    assert set(nf.last.draws) == set(names) and outputs.logits.shape == (3, 7, 40)
    # without noise (noise_std 0) both KL terms vanish: the loss is hybrid_alpha * CE, which the noise raised
    quiet = NoiseFiT(names[0], noise_std=0.0, generator=gen())
    with quiet.attach(model):
        silent, clean = quiet.loss(model, inputs)
    torch.testing.assert_close(silent, 0.5 * clean.loss.double(), rtol=1e-12, atol=0)  # (HF: CE in float32)
    assert float(loss.detach() - silent.detach()) > 1e-8


class Blocks(torch.nn.Module):
    """Three blocks on (B, L, 8) hidden states, each run under activation checkpointing or not."""

    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.checkpointed = checkpointed

    def forward(self, h):
        for block in self.blocks:
            run = lambda x, block=block: torch.tanh(block(x))  # noqa: E731
            h = checkpoint(run, h, use_reentrant=False) if self.checkpointed else run(h)
        return h


def test_a_block_recomputed_by_activation_checkpointing_gets_the_same_noise_again():
    """The gradients of a noisy forward are the same whether its blocks are recomputed in backward or not
    (the noise of the recomputation replays the forward's draws)."""
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=gen(2))
    grads = []
    for checkpointed in (False, True):
        model = Blocks(checkpointed).double().train()
        nf = NoiseFiT(["blocks.0", "blocks.2"], noise_std=0.5, generator=gen())
        with nf.attach(model), nf.noisy():
            out = model(x)
            (out**2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
        clean = Blocks(False).double()(x)
        assert not torch.allclose(out, clean)  # (noised)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_the_hook_noises_only_the_noisy_forwards_that_train():
    model, inputs = llama(), batch()
    nf = NoiseFiT("model.layers.1", noise_std=0.5, generator=gen())
    clean = model(**inputs).logits
    with nf.attach(model):
        torch.testing.assert_close(model(**inputs).logits, clean, rtol=0, atol=0)  # outside noisy()
        with nf.noisy():
            assert not torch.allclose(model(**inputs).logits, clean)
            with torch.no_grad():
                torch.testing.assert_close(model(**inputs).logits, clean, rtol=0, atol=0)
            model.eval()
            torch.testing.assert_close(model(**inputs).logits, clean, rtol=0, atol=0)
            model.train()
    with nf.noisy():
        torch.testing.assert_close(model(**inputs).logits, clean, rtol=0, atol=0)  # detached: nothing


def test_a_resumed_hook_draws_what_the_uninterrupted_one_does():
    model, inputs = llama(), batch()
    nf = NoiseFiT("model.layers.1", generator=gen())
    with nf.attach(model):
        nf.loss(model, inputs)
        state = nf.state_dict()
        after, _ = nf.loss(model, inputs)
    resumed = NoiseFiT("model.layers.1", generator=gen(99))
    resumed.load_state_dict(state)
    with resumed.attach(model):
        again, _ = resumed.loss(model, inputs)
    torch.testing.assert_close(again, after, rtol=0, atol=0)


def test_bad_input_is_refused_in_one_line():
    model, inputs = llama(), batch()
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 4\] \(the blocks\), got 5"):
        choose_layers(model, inputs, k=5)
    with pytest.raises(ValueError, match=r"snr must be one of largest, lowest, got 'Largest'"):
        choose_layers(model, inputs, snr="Largest")
    with pytest.raises(ValueError, match=r"hybrid_alpha must be in \[0, 1\], got 2"):
        NoiseFiT("model.layers.0", hybrid_alpha=2)
    nf = NoiseFiT("model.layers.0")
    with pytest.raises(RuntimeError, match=r"attach the hook to the model first"):
        nf.loss(model, inputs)
    with nf.attach(model):
        with pytest.raises(ValueError, match=r"the inputs need labels, \(B, T\) token ids"):
            nf.loss(model, {k: v for k, v in inputs.items() if k != "labels"})
        with pytest.raises(ValueError, match=r"counts must be a \(2,\) tensor"):
            nf.loss(model, inputs, torch.tensor(5))
    with pytest.raises(ValueError, match=r"mean must be one of batch, step, got 'token'"):
        NoiseFiT("model.layers.0", mean="token")
    rotary = NoiseFiT("model.rotary_emb")  # its output is a pair (cos, sin), no hidden state
    with (
        rotary.attach(model),
        rotary.noisy(),
        pytest.raises(TypeError, match=r"NoiseFiT at 'model.rotary_emb'"),
    ):
        model(**inputs)
    with pytest.raises(ValueError, match=r"Sequential states no transformer blocks"):
        blocks_of(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.slow
@pytest.mark.parametrize("accumulation, mean", [(1, "batch"), (2, "batch"), (2, "step")])
def test_the_trainer_with_noisefits_loss_trains_as_the_hand_loop(tmp_path, accumulation, mean):
    """The HuggingFace Trainer with NoiseFiTLoss and the hook in a HookCallback: its weights after two
    steps are the hand loop's (the same draws: reseeded per step from (seed, rank, step)); under gradient
    accumulation the mean over the micro-batches (the authors' means), or with mean="step" each
    micro-batch's sums divided by the step's tokens (its micro-batches label different numbers of them)."""
    from mixhook.integrations.draws import reseed
    from mixhook.integrations.lm import NoiseFiTLoss
    from mixhook.integrations.transformers import HookCallback

    class NoiseFiTTrainer(NoiseFiTLoss, transformers.Trainer):
        pass

    g = torch.Generator().manual_seed(5)
    n = 3 * 2 * accumulation
    ids = torch.randint(0, 40, (n, 7), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for i in range(n):
        labels[i, : 2 + (i * 5) // n] = -100  # (prompts of 2 to 6 tokens: the micro-batches' counts differ)
    rows = [
        {"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels, strict=True)
    ]
    layers = ["model.layers.0", "model.layers.2"]

    trained = llama().float()
    hook = NoiseFiT(layers, noise_std=0.5, mean=mean)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=accumulation,
        max_steps=2, optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0,
        weight_decay=0.0, train_sampling_strategy="sequential", report_to=[], save_strategy="no",
        use_cpu=True,
        seed=11, logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    NoiseFiTTrainer(model=trained, args=args, train_dataset=rows, callbacks=[HookCallback(hook)]).train()

    hand = llama().float()
    nf = NoiseFiT(layers, noise_std=0.5)
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    with nf.attach(hand):
        for step in range(2):
            reseed(nf, 11, 0, step, HookCallback._FIRST_PART)
            first = step * accumulation * 3
            micro = [slice(first + 3 * k, first + 3 * k + 3) for k in range(accumulation)]
            counts = [nf.counts(labels[rows_]) for rows_ in micro]
            assert accumulation == 1 or not torch.equal(counts[0], counts[1])
            for rows_ in micro:
                batch = {"input_ids": ids[rows_], "attention_mask": mask[rows_], "labels": labels[rows_]}
                if mean == "step":
                    loss, _ = nf.loss(hand, batch, sum(counts))  # (the step's tokens)
                    loss.backward()
                else:
                    loss, _ = nf.loss(hand, batch)
                    (loss / accumulation).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(trained.named_parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    assert not torch.equal(next(trained.parameters()), next(llama().float().parameters()))  # (it trained)


def test_the_trainers_loss_needs_one_noisefit_hook(tmp_path):
    from mixhook.integrations.lm import NoiseFiTLoss

    class NoiseFiTTrainer(NoiseFiTLoss, transformers.Trainer):
        pass

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1)
    trainer = NoiseFiTTrainer(model=llama().float(), args=args)
    with pytest.raises(ValueError, match=r"HookCallbacks hold 0 NoiseFiT hooks; give it one"):
        trainer.compute_loss(trainer.model, batch())
