"""SFTMix's data side: the response perplexity against a loop over single examples in float64 (padding,
length order, each way of marking the response), the confidence over checkpoints, the median split, the
paired batches (halves, pairs, epochs, refusals), and in TRL's SFTTrainer: the reference run's checkpoints
saved, listed and loaded back to the same confidence, and the paired batches of the Trainer's own loader
(gradient accumulation included)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from harness.language_models import tiny_llama
from mixhook.lm.confidence import PairedSampler, confidence, response_perplexity, split
from tests.helpers import Lazy

adapter = Lazy("mixhook.integrations.lm")
trl = Lazy("trl")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def examples(n=7, key="completion_mask", seed=0):
    """Rows of 4 to 11 tokens, the first two the prompt, the rest the response (``key`` marks it)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (), generator=g))
        ids = torch.randint(3, 64, (length,), generator=g).tolist()
        mask = [0, 0] + [1] * (length - 2)
        if key == "labels":
            rows.append(
                {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)]}
            )
        else:
            rows.append({"input_ids": ids, key: mask})
    return rows


def by_hand(model, row):
    """One example alone, no padding: exp of the mean negative log-likelihood of its response tokens."""
    ids = torch.tensor([row["input_ids"]])
    logits = model(input_ids=ids).logits[0]
    mask = row.get("completion_mask") or row.get("assistant_masks")
    if mask is None:
        mask = [int(t != -100) for t in row["labels"]]
    nll = [-F.log_softmax(logits[t], -1)[ids[0, t + 1]] for t in range(len(mask) - 1) if mask[t + 1]]
    return math.exp(float(sum(nll).detach() / len(nll)))


@pytest.mark.parametrize("key", ["completion_mask", "assistant_masks", "labels"])
def test_the_perplexity_is_each_responses_alone_batched_and_padded_in_any_order(key):
    model = tiny_llama()
    rows = examples(key=key)
    expected = torch.tensor([by_hand(model.eval(), row) for row in rows], dtype=torch.float64)
    model.train()
    for batch_size in (1, 3, 7):
        found = response_perplexity(model, rows, batch_size=batch_size)
        torch.testing.assert_close(found, expected, rtol=1e-12, atol=0)
    assert model.training  # (its mode is given back)
    with pytest.raises(ValueError, match="example 1 has no response token"):
        response_perplexity(model, [rows[0], {"input_ids": [5, 6, 7], "completion_mask": [1, 0, 0]}])
    with pytest.raises(KeyError, match="example 0 needs its response tokens marked"):
        response_perplexity(model, [{"input_ids": [5, 6, 7]}])


def test_bad_examples_are_refused_in_one_line_and_each_modules_mode_is_given_back():
    model = tiny_llama()
    model.model.layers[0].eval()  # (a module the user put in eval mode stays so)
    row = {"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]}
    for bad, message in (
        ({**row, "attention_mask": [0, 1, 1, 1]}, "example 0 is padded"),
        ({**row, "completion_mask": [0, 1, 1]}, "completion_mask marks 3 tokens, its input_ids has 4"),
    ):
        with pytest.raises(ValueError, match=message):
            response_perplexity(model, [bad])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        response_perplexity(model, [row], batch_size=0)
    response_perplexity(model, [row])
    assert model.training and not model.model.layers[0].training

    class Tuple(torch.nn.Module):  # (a model that returns a tuple: its first element is the logits)
        def __init__(self):
            super().__init__()
            self.inner = tiny_llama()

        def forward(self, **kwargs):
            return (self.inner(**kwargs).logits,)

    wrapped = Tuple()
    torch.testing.assert_close(response_perplexity(wrapped, [row]), response_perplexity(wrapped.inner, [row]))


def test_the_confidence_is_minus_the_mean_perplexity_over_checkpoints_loaded_one_at_a_time():
    rows = examples()
    nets = [tiny_llama(), tiny_llama(hidden_size=8)]
    loaded = []

    def loader(i):
        def load():
            loaded.append(i)
            return nets[i]

        return load

    conf, perplexities = confidence([loader(0), loader(1)], rows, batch_size=4)
    assert loaded == [0, 1] and perplexities.shape == (2, 7)
    each = torch.stack([response_perplexity(net, rows, batch_size=4) for net in nets])
    torch.testing.assert_close(perplexities, each, rtol=0, atol=0)
    torch.testing.assert_close(conf, -(each[0] + each[1]) / 2, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="no reference checkpoint"):
        confidence([], rows)


def test_the_split_is_at_the_median_with_ties_in_order():
    c = torch.tensor([0.3, -1.0, 2.0, 0.3, 5.0, -7.0, 0.3])
    assert split(c).tolist() == [True, False, True, False, True, False, False]  # (3 of 7; the first 0.3)
    assert split(torch.tensor([1.0, 2.0])).tolist() == [False, True]
    with pytest.raises(ValueError, match=r"the confidence of examples \[1\] is not finite"):
        split(torch.tensor([1.0, float("nan")]))


def test_the_paired_sampler_makes_half_and_half_batches_new_each_epoch_the_same_for_the_same_epoch():
    flags = torch.tensor([True, False] * 9 + [False, False, False])  # 9 confident, 12 not
    sampler = PairedSampler(flags, batch_size=4, seed=3)
    assert len(sampler) == 16 and sampler.batches() == 4  # (9 confident: 4 batches of 2)
    epochs = {}
    for epoch in (0, 1, 0):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for b in range(0, len(order), 4):
            assert flags[order[b : b + 2]].all() and not flags[order[b + 2 : b + 4]].any()
        assert len(set(order)) == len(order)
        epochs.setdefault(epoch, []).append(order)
    assert epochs[0][0] == epochs[0][1] and epochs[0][0] != epochs[1][0]
    assert list(PairedSampler(flags, 4, seed=4)) != epochs[0][0]
    for bad, message in (
        ({"batch_size": 3}, "even and at least 2"),
        ({"batch_size": 40}, "make no batch of 40"),
    ):
        with pytest.raises(ValueError, match=message):
            PairedSampler(flags, **bad)
    with pytest.raises(ValueError, match="one True/False flag per example"):
        PairedSampler([0, 1, 1], 2)


# ------------------------------------------------------------------------------------ in TRL's SFTTrainer


def trainer(net, out, callbacks=(), cls=None, data=None, **options):
    from harness.language_models import dataset, tokenizer

    settings = dict(
        output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=1, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", seed=7, completion_only_loss=True,
    )  # fmt: skip
    settings.update(options)
    return (cls or trl.SFTTrainer)(
        model=net, args=trl.SFTConfig(**settings), train_dataset=data if data is not None else dataset(),
        processing_class=tokenizer(), callbacks=list(callbacks),
    )  # fmt: skip


@pytest.mark.slow
def test_the_reference_run_saves_its_checkpoints_evenly_and_they_score_as_the_models_did(
    tmp_path, monkeypatch
):
    from harness.language_models import dataset, llama

    net = llama()
    seen = {}

    class Snapshot(adapter.ReferenceCheckpoints):  # (the weights as they were at each save)
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step in self._steps:
                seen[state.global_step] = {k: v.clone() for k, v in model.state_dict().items()}
            return super().on_step_end(args, state, control, model=model, **kwargs)

    run = trainer(net, tmp_path, [Snapshot(count=3)], max_steps=7)
    run.train()
    listing = json.loads((tmp_path / "reference" / "reference.json").read_text())
    steps = [int(name.removeprefix("step-")) for name in listing["checkpoints"]]
    assert steps == [2, 5, 7] == sorted(seen)  # (round(k * 7 / 3))
    rows = [dict(r) for r in dataset()]
    loaded = adapter.reference_models(tmp_path / "reference", torch_dtype=torch.float64)
    conf, per = confidence(loaded, rows, batch_size=5)
    for k, step in enumerate(steps):
        model = llama()
        model.load_state_dict(seen[step])
        torch.testing.assert_close(per[k], response_perplexity(model, rows), rtol=1e-12, atol=0)
    assert not torch.equal(per[0], per[2])  # (the run trained between them)
    with pytest.raises(FileNotFoundError, match="ReferenceCheckpoints writes it"):
        adapter.reference_models(tmp_path)
    # a fresh run in the same directory lists its own checkpoints only (the earlier run's were 2, 5, 7)
    trainer(llama(), tmp_path, [adapter.ReferenceCheckpoints(count=2)], max_steps=4).train()
    listing = json.loads((tmp_path / "reference" / "reference.json").read_text())
    assert listing == {"checkpoints": ["step-2", "step-4"], "max_steps": 4, "count": 2}
    monkeypatch.chdir(tmp_path.parent)  # (the list's names are found from anywhere)
    assert len(adapter.reference_models(tmp_path / "reference")) == 2
    with pytest.raises(ValueError, match="3 checkpoints over a run of 2 steps"):
        trainer(llama(), tmp_path / "short", [adapter.ReferenceCheckpoints(count=3)], max_steps=2).train()


@pytest.mark.slow
def test_the_trainers_batches_are_paired_halves_under_accumulation(tmp_path):
    from harness.language_models import dataset, llama

    data = dataset(16)
    flags = [bool(i % 3 == 0) for i in range(8)] + [True] * 4 + [False] * 4
    data = data.add_column("sftmix_confident", flags)

    class Paired(adapter.PairedBatches, trl.SFTTrainer):
        pass

    run = trainer(llama(), tmp_path, cls=Paired, data=data, gradient_accumulation_steps=2)
    loader = run.get_train_dataloader()
    kept = run.train_dataset  # (TRL's: tokenized, the column carried along)
    ids = [list(r["input_ids"]) for r in kept]
    flags = list(kept["sftmix_confident"])
    firsts = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        assert len(batches) == min(sum(flags), len(flags) - sum(flags)) // 2 >= 3
        for batch in batches:
            rows = [ids.index([t for t in row.tolist() if t != 0]) for row in batch["input_ids"]]
            assert [flags[r] for r in rows] == [True, True, False, False]
        firsts.append(batches[0]["input_ids"])
    assert not torch.equal(firsts[0], firsts[1])
    with pytest.raises(ValueError, match="no 'sftmix_confident' column"):
        trainer(llama(), tmp_path, cls=Paired).get_train_dataloader()
    for options, message in (
        ({"train_sampling_strategy": "group_by_length"}, "would be replaced by SFTMix's pairing"),
        ({"accelerator_config": {"split_batches": True}}, "split_batches cuts each batch between devices"),
    ):
        with pytest.raises(ValueError, match=message):
            trainer(llama(), tmp_path, cls=Paired, data=data, **options).get_train_dataloader()
    stream = trainer(llama(), tmp_path, cls=Paired, data=data)
    stream.train_dataset = stream.train_dataset.to_iterable_dataset()
    with pytest.raises(ValueError, match="the training set has no length"):
        stream.get_train_dataloader()


@pytest.mark.slow
def test_each_epoch_is_set_on_the_sampler_itself_so_a_resumed_epoch_on_two_processes_is_the_same(tmp_path):
    """The Trainer sets the epoch through its loader, which on several processes a resumed epoch's
    skip_first_batches wraps beyond its reach (the sampler stayed at epoch 0): PairedBatches sets it on the
    sampler at each epoch; accelerate's loader for process 1 of 2, resumed after 2 batches, then draws the
    uninterrupted epoch's batches."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from torch.utils.data import DataLoader

    from harness.language_models import dataset, llama

    data = dataset(16).add_column("sftmix_confident", [i % 2 == 0 for i in range(16)])

    class Paired(adapter.PairedBatches, trl.SFTTrainer):
        pass

    epochs = []

    class Seen(transformers_callback()):
        def on_step_begin(self, args, state, control, **kwargs):
            epochs.append(run._paired.epoch)

    run = trainer(llama(), tmp_path, [Seen()], cls=Paired, data=data, num_train_epochs=2)
    run.train()
    assert epochs == [0, 0, 0, 0, 1, 1, 1, 1]

    flags = torch.tensor([i % 2 == 0 for i in range(16)])

    def loader():
        plain = DataLoader(list(range(16)), batch_size=4, sampler=PairedSampler(flags, 4, seed=1))
        return prepare_data_loader(
            plain, torch.device("cpu"), num_processes=2, process_index=1, put_on_device=False
        )

    def epoch(
        dl, sampler, reach
    ):  # the Trainer's set_epoch on the loader, then PairedBatches' on the sampler
        dl.set_epoch(1)
        if reach:
            sampler.set_epoch(1)
        return [b.tolist() for b in dl]

    first = loader()
    uninterrupted = epoch(first, first.batch_sampler.batch_sampler.sampler, reach=True)
    for reach in (False, True):
        resumed = skip_first_batches(loader(), 1)
        sampler = resumed.batch_sampler.batch_sampler.batch_sampler.sampler
        assert (epoch(resumed, sampler, reach) == uninterrupted[1:]) == reach  # (without it: epoch 0's)


def transformers_callback():
    import transformers

    return transformers.TrainerCallback
