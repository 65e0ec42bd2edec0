"""mixhook.integrations.transformers: the real HuggingFace Trainer (CPU) with MixupCallback and its
compute_loss_func against a hand loop on the same draws, bit for bit (a padded BERT classifier and a GPT-2
language model with -100 labels, under gradient accumulation with num_items_in_batch); evaluate() unmixed
with the plain loss; resume bit for bit; what is refused. Two processes under accelerate are in
tests/e2e/test_integrations_ddp.py."""

import copy

import pytest
import torch
import torch.nn.functional as F

from mixhook import ManifoldMixup, MixSchedule, UnknownLayerError
from mixhook.integrations.draws import reseed
from tests.helpers import Lazy, one_line

adapter = Lazy("mixhook.integrations.transformers")  # imports transformers: when a test first uses it

transformers = Lazy("transformers")  # imported when a test first uses it, not at collection

BERT_LAYERS = ["bert.encoder.layer.0", "bert.encoder.layer.1"]
GPT2_LAYERS = ["transformer.h.0", "transformer.h.1"]


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config).double()


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()


def rows(kind, n=16, seed=0):
    """A padded dataset: sequence labels (BERT) or token labels with -100 on the padding (GPT-2), so
    the micro-batches hold different numbers of labelled items."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 50, (6,), generator=g)
        length = int(torch.randint(2, 7, (), generator=g))
        mask = (torch.arange(6) < length).long()
        ids = ids * mask
        if kind == "bert":
            labels = torch.randint(0, 3, (), generator=g)
        else:
            labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def arguments(tmp_path, **kwargs):
    options = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=2, optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0,
        weight_decay=0.0, train_sampling_strategy="sequential", report_to=[], save_strategy="no",
        use_cpu=True, seed=7, logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


def hf_trainer(model, args, data, callback, **kwargs):
    return transformers.Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=[callback],
        compute_loss_func=callback.compute_loss, **kwargs,
    )  # fmt: skip


def summed(kind):
    """The task's loss summed over labelled items, written by hand (GPT-2: next-token, shifted)."""
    if kind == "bert":
        return lambda logits, y: F.cross_entropy(logits, y, reduction="sum")
    return lambda logits, y: F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


def hand_loop(model, mixer, data, kind, epochs=2, batch=4, accumulate=2, seed=7, schedule=None):
    """What the Trainer does with the callback, in a plain loop: per optimizer step reseed (rank 0, the
    step), each micro-batch's mixed summed loss over the labelled items of the whole window, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [
        {k: torch.stack([r[k] for r in data[i : i + batch]]) for k in data[0]}
        for i in range(0, len(data), batch)
    ]
    criterion, step = summed(kind), 0
    with mixer.attach(model):
        model.train()
        for epoch in range(epochs):
            for w in range(0, len(batches), accumulate):
                if schedule is not None:
                    schedule.set(epoch + 1, w / len(batches))
                reseed(mixer, seed, 0, step)
                window = batches[w : w + accumulate]
                # num_items_in_batch as the Trainer counts it: every label not -100 of the window (for
                # GPT2LMHeadModel unshifted too: its loss_type is unset, so the Trainer does not shift
                # the count; the model's own loss divides by the same count)
                n = sum(int(b["labels"].ne(-100).sum()) for b in window)
                for b in window:
                    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
                    (mixer.loss(criterion, out.logits, b["labels"]) / n).backward()
                opt.step()
                opt.zero_grad()
                step += 1
    return model


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_train_equals_the_hand_loop_under_gradient_accumulation(kind, tmp_path):
    """Trainer.train with the callback (padded batches, two layers, gradient_accumulation_steps=2, a
    schedule switching mixing off after epoch 1) trains the weights a hand loop trains on the same draws,
    bit for bit: the loss normalized by num_items_in_batch, the language model's labels shifted."""
    model = bert() if kind == "bert" else gpt2()
    twin = copy.deepcopy(model)
    layers = BERT_LAYERS if kind == "bert" else GPT2_LAYERS
    data = rows(kind)
    mixer = ManifoldMixup(layers, alpha=1.0)
    callback = adapter.MixupCallback(mixer, schedule=MixSchedule(mixer, off_epoch=1))
    hf_trainer(model, arguments(tmp_path, num_train_epochs=3), data, callback).train()
    mixer2 = ManifoldMixup(layers, alpha=1.0)
    hand_loop(twin, mixer2, data, kind, epochs=3, schedule=MixSchedule(mixer2, off_epoch=1))
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    unmixed = hand_loop(
        copy.deepcopy(bert() if kind == "bert" else gpt2()),
        ManifoldMixup(layers, alpha=1.0, prob=0.0),
        data,
        kind,
        epochs=3,
    )
    assert not torch.equal(next(unmixed.parameters()), next(model.parameters()))  # the mix mattered


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_without_a_mix_the_loss_is_the_models_own_in_the_trainer(kind, tmp_path):
    """prob=0: the callback's task loss (cross-entropy, the language model's shifted) normalized by
    num_items_in_batch trains what the Trainer trains with the model's own loss (which takes float64
    logits in float32: equal to 1e-6). Without gradient accumulation: with it, the Trainer's own loss of
    a head that takes **kwargs but drops num_items_in_batch (BertForSequenceClassification) is the sum of
    the micro-batches' means, gradients times the accumulation steps (transformers#47688, open); the
    callback's is the window's mean (the hand loop of the test above)."""
    model = bert() if kind == "bert" else gpt2()
    twin = copy.deepcopy(model)
    layers = BERT_LAYERS if kind == "bert" else GPT2_LAYERS
    data = rows(kind)
    args = arguments(tmp_path, gradient_accumulation_steps=1)
    hf_trainer(model, args, data, adapter.MixupCallback(ManifoldMixup(layers, alpha=1.0, prob=0.0))).train()
    transformers.Trainer(model=twin, args=args, train_dataset=data).train()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_evaluate_is_unmixed_and_its_loss_the_models_own(tmp_path):
    model = bert()
    data = rows("bert")
    trainer = hf_trainer(
        model, arguments(tmp_path), data, adapter.MixupCallback(ManifoldMixup(BERT_LAYERS, alpha=1.0))
    )
    trainer.train()
    mixed = trainer.evaluate()["eval_loss"]
    plain = transformers.Trainer(
        model=copy.deepcopy(model), args=arguments(tmp_path), eval_dataset=data[:8]
    ).evaluate()
    assert mixed == pytest.approx(plain["eval_loss"], rel=1e-12)


@pytest.mark.slow
def test_a_resumed_train_draws_and_trains_what_the_uninterrupted_one_does(tmp_path):
    """Checkpoints every 2 steps; resumed from checkpoint-2 (by path, with a callback built with another
    seed: the checkpoint's comes back from trainer_state.json) it ends where the straight run ends."""
    data = rows("bert")
    straight = bert()
    hf_trainer(
        straight,
        arguments(tmp_path / "a"),
        data,
        adapter.MixupCallback(ManifoldMixup(BERT_LAYERS, alpha=1.0)),
    ).train()
    saving = arguments(tmp_path / "b", save_strategy="steps", save_steps=2)
    hf_trainer(bert(), saving, data, adapter.MixupCallback(ManifoldMixup(BERT_LAYERS, alpha=1.0))).train()
    resumed = bert()
    callback = adapter.MixupCallback(ManifoldMixup(BERT_LAYERS, alpha=1.0), seed=123)
    hf_trainer(resumed, saving, data, callback).train(
        resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2")
    )
    assert callback.seed == 7
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    other = adapter.MixupCallback(ManifoldMixup("bert.encoder.layer.1", alpha=1.0))
    with pytest.raises(ValueError, match="resume with the same layers"):
        hf_trainer(bert(), saving, data, other).train(
            resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2")
        )


def test_without_compute_loss_func_the_step_is_refused_before_the_update(tmp_path):
    """The model's own loss on a mixed forward (labels not mixed) is refused before the optimizer step."""
    model = bert()
    before = copy.deepcopy(model)
    callback = adapter.MixupCallback(ManifoldMixup(BERT_LAYERS, alpha=1.0))
    trainer = transformers.Trainer(
        model=model, args=arguments(tmp_path), train_dataset=rows("bert"), callbacks=[callback]
    )
    with pytest.raises(RuntimeError, match="compute_loss_func=callback.compute_loss") as error:
        trainer.train()
    one_line(error)
    for a, b in zip(model.parameters(), before.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_input_is_one_line(tmp_path):
    data = rows("bert")
    with pytest.raises(UnknownLayerError, match="nosuch"):
        hf_trainer(
            bert(), arguments(tmp_path), data, adapter.MixupCallback(ManifoldMixup("bert.nosuch", alpha=1.0))
        )
    model, mixer = bert(), ManifoldMixup(BERT_LAYERS, alpha=1.0)
    with mixer.attach(model):
        with pytest.raises(RuntimeError, match="already attached") as error:
            hf_trainer(model, arguments(tmp_path), data, adapter.MixupCallback(mixer))
        one_line(error)
    with pytest.raises(ValueError, match="restore_callback_states_from_checkpoint=True") as error:
        hf_trainer(
            bert(), arguments(tmp_path, restore_callback_states_from_checkpoint=True), data,
            adapter.MixupCallback(ManifoldMixup(BERT_LAYERS, alpha=1.0)),
        )  # fmt: skip
    one_line(error)
    callback = adapter.MixupCallback(ManifoldMixup(BERT_LAYERS, alpha=1.0))
    with pytest.raises(RuntimeError, match="not set up"):
        callback.compute_loss({"logits": torch.zeros(2, 3)}, torch.zeros(2, dtype=torch.long))
    hf_trainer(bert(), arguments(tmp_path), data, callback)
    with pytest.raises(ValueError, match="no 'labels'"):
        callback.compute_loss({"logits": torch.zeros(2, 3)}, None)
    with pytest.raises(TypeError, match="mixhook regularizer"):
        adapter.MixupCallback(torch.nn.Linear(2, 2))
    from mixhook.policies import BalancedMixup

    text = [{"input_ids": torch.ones(4, dtype=torch.long), "labels": torch.tensor(0.5)} for _ in range(8)]
    balanced = adapter.MixupCallback(ManifoldMixup(BERT_LAYERS).use(BalancedMixup()))
    trainer = hf_trainer(bert(), arguments(tmp_path), text, balanced)  # float labels: no classes to balance
    with pytest.raises(ValueError, match="class-balanced partner batch, and the training set") as error:
        trainer.train()
    one_line(error)


class Pixels(torch.nn.Module):
    """A small image classifier as the Trainer takes one (``pixel_values``, a dict of outputs), with a last
    map pooled into a Linear (SnapMix's) and square maps (PuzzleMix's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 6, 3, padding=1)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, pixel_values, labels=None):
        h = F.relu(self.conv2(F.relu(self.conv(pixel_values))))
        return {"logits": self.fc(h.mean((2, 3)))}


def images(n=16):
    g = torch.Generator().manual_seed(1)
    return [
        {"pixel_values": torch.randn(1, 8, 8, generator=g, dtype=torch.float64),
         "labels": torch.randint(0, 3, (), generator=g)}
        for _ in range(n)
    ]  # fmt: skip


def methods():
    from mixhook import PuzzleMix, RegMixup, SaliencyMix, SnapMix
    from mixhook.policies import Remix

    return {
        "remix": lambda: ManifoldMixup("conv", alpha=1.0).use(Remix()),  # the counts from the training set
        "saliencymix-gradient": lambda: SaliencyMix("conv", saliency="gradient"),  # labels before the forward
        "puzzlemix": lambda: PuzzleMix("conv", grids="auto"),  # and a lam per sample
        "snapmix": lambda: SnapMix("input", features="conv2", classifier="fc"),  # its maps need the labels
        "regmixup": lambda: RegMixup("conv", alpha=1.0),  # the clean batch beside the mix: 2B rows
    }


@pytest.mark.parametrize("method", ["saliencymix-gradient", "puzzlemix", "snapmix", "regmixup", "remix"])
def test_methods_that_need_the_labels_before_the_forward_or_keep_the_clean_batch_train_as_the_hand_loop(
    method, tmp_path
):
    """The Trainer takes the labels out of the batch before the forward; the callback's collator keeps them
    for the methods that need them then, and the loss of a clean batch's 2B rows is their mean."""
    make, data = methods()[method], images()
    model = Pixels().double()
    start = copy.deepcopy(model)
    callback = adapter.MixupCallback(make())
    args = arguments(tmp_path, gradient_accumulation_steps=1, num_train_epochs=1, max_steps=3)
    hf_trainer(model, args, data, callback).train()
    mixer, opt = make(), torch.optim.SGD(start.parameters(), lr=0.1)
    if method == "remix":
        labels = torch.stack([r["labels"] for r in data])
        mixer.policies[0].count(labels, 3)
        assert callback.mixer.policies[0].counts.tolist() == mixer.policies[0].counts.tolist()
    with mixer.attach(start):
        for step in range(3):
            x = torch.stack([r["pixel_values"] for r in data[4 * step : 4 * step + 4]])
            y = torch.stack([r["labels"] for r in data[4 * step : 4 * step + 4]])
            reseed(mixer, 7, 0, step)
            mixer.use_targets(y)
            logits = start(x)["logits"]
            mixer.loss(lambda z, t: F.cross_entropy(z, t, reduction="none"), logits, y).mean().backward()
            opt.step()
            opt.zero_grad()
    assert mixer.last is not None
    for a, b in zip(model.parameters(), start.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


@pytest.mark.slow
@pytest.mark.parametrize("given", [False, True], ids=["trainers-optimizer", "optimizer-given"])
def test_a_resumed_automix_run_continues_its_mix_block_copy_and_their_optimizer_state(tmp_path, given):
    """AutoMix's Mix Block and momentum copy are not the Trainer's: each checkpoint keeps them (and, where
    the callback added the Mix Block's group to the Trainer's optimizer, its AdamW state, left out of
    optimizer.pt so that the Trainer's new optimizer loads it) in mixhook.pt; resumed from checkpoint-2,
    the model, the Mix Block and the copy end where the straight run ends, also with an optimizer given
    to the Trainer that holds the Mix Block (its gradients cleared after each step all the same). A
    checkpoint without mixhook.pt is refused in one line."""
    from harness.matrix.cells import _Outputs
    from harness.matrix.methods import data, model
    from mixhook import AutoMix

    x, y = data("cnn", n=32)
    rows = [{"pixel_values": a, "labels": b} for a, b in zip(x, y, strict=True)]

    def train(out, resume=None, **saving):
        net = _Outputs(model("cnn"))
        mix = AutoMix("input", features="net.conv1", channels=4, momentum=0.5, end_momentum=0.5)
        callback = adapter.MixupCallback(mix)
        args = arguments(
            out, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=4,
            optim="adamw_torch", learning_rate=0.01, **saving,
        )  # fmt: skip
        own = torch.optim.AdamW([*net.parameters(), *mix.parameters()], lr=0.01, weight_decay=0.0)
        trainer = hf_trainer(net, args, rows, callback, optimizers=(own, None) if given else (None, None))
        trainer.train(resume_from_checkpoint=resume)
        if not given:
            assert len(trainer.optimizer.param_groups) == callback._group + 1  # (the Mix Block's: the last)
        mix.catch_up()  # (the copy's update for the last step, which a checkpoint makes at saving)
        return [*net.parameters(), *mix.parameters(), *mix.momentum_model.parameters()]

    straight = train(tmp_path / "a")
    train(tmp_path / "b", save_strategy="steps", save_steps=2)
    saved = torch.load(tmp_path / "b" / "checkpoint-2" / "optimizer.pt", weights_only=False)
    own = torch.load(tmp_path / "b" / "checkpoint-2" / "mixhook.pt", weights_only=False)
    if given:  # (the optimizer given holds the Mix Block: its checkpoint has its state)
        assert len(saved["param_groups"]) == 1 and "group" not in own and "mix_block" in own["mixer"]
    else:
        assert len(saved["param_groups"]) == 2 and len(own["state"]) == len(own["group"]["params"]) > 0
    resumed = train(tmp_path / "b", str(tmp_path / "b" / "checkpoint-2"), save_strategy="steps", save_steps=2)
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    (tmp_path / "b" / "checkpoint-2" / "mixhook.pt").unlink()
    with pytest.raises(ValueError) as error:
        train(tmp_path / "b", str(tmp_path / "b" / "checkpoint-2"))
    assert "mixhook.pt" in one_line(error)
