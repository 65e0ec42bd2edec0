"""SFTMix's mix and loss against a hand-written computation in float64 on a tiny Llama (the loss and every
gradient): padded batches with completion-only -100 labels, responses of different lengths, lam per pair
and per batch, the mixup loss per token and per sequence, detached mixed states, the first or last answer
of a conversation; the evaluation loss is the model's own; activation checkpointing changes nothing; and
the refusals."""

import pytest
import torch
import torch.nn.functional as F

from harness.language_models import tiny_llama
from mixhook import SFTMix
from mixhook.packing import PackedBatchError
from tests.helpers import assert_same_step

T = 12


def batch(seed=0, spans=False):
    """Four rows: a prompt of 2 to 4 tokens (-100), then a response, then right padding (-100, masked);
    ``spans``: each response cut in two answers by two -100 tokens (a conversation)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (4, T), generator=g)
    mask, labels = torch.ones_like(ids), ids.clone()
    for i, (prompt, length) in enumerate([(2, 12), (3, 9), (4, 11), (2, 7)]):
        mask[i, length:] = 0
        labels[i, :prompt] = -100
        labels[i, length:] = -100
        if spans:
            labels[i, prompt + 2 : prompt + 4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def by_hand(model, inputs, lam, mu=0.2, reduce="token", detach=False, response="all"):
    """The loss written out: the clean states, each row's labelled positions, the mixed states placed one by
    one, the LM head on both, the cross-entropies summed position by position."""
    ids, labels = inputs["input_ids"], inputs["labels"]
    h = model.model(input_ids=ids, attention_mask=inputs["attention_mask"]).last_hidden_state
    source = h.detach() if detach else h
    n = ids.shape[0]
    spans = []
    for i in range(n):
        labelled = [t for t in range(1, T) if labels[i, t] != -100]
        runs, run = [], []
        for t in labelled:
            if run and t != run[-1] + 1:
                runs.append(run)
                run = []
            run.append(t)
        runs.append(run)
        spans.append({"all": labelled, "first": runs[0], "last": runs[-1]}[response])
    mixed = torch.zeros_like(h)
    rows = []
    for i in range(n):
        p = (i + n // 2) % n
        count = min(len(spans[i]), len(spans[p]))
        for k in range(count):
            a, b = spans[i][k], spans[p][k]
            mixed[i, a - 1] = lam[i] * source[i, a - 1] + (1 - lam[i]) * source[p, b - 1]
            rows.append((i, a - 1, labels[i, a], labels[p, b]))
    logits = model.lm_head(torch.cat([h, mixed]))
    terms = [
        F.cross_entropy(logits[i, t - 1], labels[i, t])
        for i in range(n)
        for t in range(1, T)
        if labels[i, t] != -100
    ]
    ntp = sum(terms) / len(terms)
    each = {}
    for i, q, own, other in rows:
        term = lam[i] * F.cross_entropy(logits[n + i, q], own) + (1 - lam[i]) * F.cross_entropy(
            logits[n + i, q], other
        )
        each.setdefault(i, []).append(term)
    if reduce == "token":
        mix = sum(sum(v) for v in each.values()) / sum(len(v) for v in each.values())
    else:
        mix = sum(sum(v) / len(v) for v in each.values()) / len(each)
    return ntp + mu * mix, logits[:n]


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"lam": "batch"},
        {"reduce": "sequence"},
        {"detach": True},
        {"response": "first", "spans": True},
        {"response": "last", "spans": True},
        {"response": "all", "spans": True},
    ],
)
def test_the_loss_and_every_gradient_are_the_hand_written_ones(options):
    options = dict(options)
    spans = options.pop("spans", False)
    inputs = batch(spans=spans)
    model, hand = tiny_llama(), tiny_llama()
    mix = SFTMix("model.norm", generator=torch.Generator().manual_seed(1), **options)
    with mix.attach(model):
        loss, outputs = mix.loss(model, inputs)
        loss.backward()
    lam = mix.last.draws["lam"]
    assert (lam[:2] + lam[2:] == 1).all() and ((lam[0] == lam[1]) == (options.get("lam") == "batch"))
    expected, clean = by_hand(hand, inputs, lam, **{k: v for k, v in options.items() if k != "lam"})
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(outputs.logits, clean, rtol=0, atol=1e-14)
    for a, b in zip(grads(model), grads(hand), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)
    plain = tiny_llama()(**inputs).loss  # (the model's own loss: l_NTP, beside which the mix weighs)
    torch.testing.assert_close(
        mix.last.terms["ntp"], plain.detach().double(), rtol=1e-6, atol=0
    )  # (HF: float32)
    assert abs(float(loss.detach()) - float(plain.detach())) > 1e-3  # (the mix changes the loss)


def test_an_evaluation_is_the_plain_loss_and_a_forward_outside_loss_is_unmixed():
    inputs = batch()
    model = tiny_llama()
    mix = SFTMix("model.norm")
    with mix.attach(model):
        model.eval()
        with torch.no_grad():
            loss, outputs = mix.loss(model, inputs)
            assert outputs.logits.shape[0] == 4
            torch.testing.assert_close(
                loss, model(**inputs).loss.double(), rtol=1e-6, atol=0
            )  # (its loss: float32)
        model.train()
        assert model(input_ids=inputs["input_ids"]).logits.shape[0] == 4


def test_activation_checkpointing_changes_nothing():
    inputs = batch(3)
    runs = []
    for checkpointing in (False, True):
        model = tiny_llama()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mix = SFTMix("model.norm", generator=torch.Generator().manual_seed(2))
        with mix.attach(model):
            loss, _ = mix.loss(model, inputs)
            loss.backward()
        runs.append((loss, grads(model)))
    assert_same_step(*runs)


def test_bad_batches_and_arguments_are_refused_in_one_line():
    model, inputs = tiny_llama(), batch()
    mix = SFTMix("model.norm")
    with pytest.raises(RuntimeError, match="attach the hook to the model first"):
        mix.loss(model, inputs)
    with mix.attach(model):
        for bad, error, message in (
            ({**inputs, "labels": None}, ValueError, "need labels"),
            ({k: v[:3] for k, v in inputs.items()}, ValueError, "a batch of 3 rows"),
            (
                {**inputs, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]] * 4)},
                PackedBatchError,
                "packed batch",
            ),
        ):
            with pytest.raises(error, match=message) as e:
                mix.loss(model, bad)
            assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="counts must be a \\(2,\\) tensor"):
            mix.loss(model, inputs, torch.tensor(5))
    for kwargs, message in (
        ({"lam": "token"}, "lam must be one of pair, batch"),
        ({"reduce": "row"}, "reduce must be one of"),
        ({"response": "middle"}, "response must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            SFTMix("model.norm", **kwargs)
    with pytest.raises(ValueError, match="one layer"):
        SFTMix(["model.norm", "model.layers.0"]).attach(model)


@pytest.mark.parametrize("reduce", ["token", "sequence"])
def test_counts_are_the_batchs_tokens_and_divide_the_loss_sums(reduce):
    """counts(labels): the labelled tokens (after position 0) and the mixed ones (each row's slots, the
    shorter of its and its partner's responses; per sequence, the rows with one), written out; the loss with
    counts divides each term's sum by them: twice the counts, half the loss, on the same draw."""
    inputs = batch(9, spans=True)
    labels = inputs["labels"]
    lengths = [int((labels[i, 1:] != -100).sum()) for i in range(4)]
    slots = [min(lengths[i], lengths[(i + 2) % 4]) for i in range(4)]
    model = tiny_llama()
    mix = SFTMix("model.norm", reduce=reduce, generator=torch.Generator().manual_seed(4))
    expected = [sum(lengths), sum(slots) if reduce == "token" else sum(s > 0 for s in slots)]
    assert mix.counts(labels).tolist() == expected
    with mix.attach(model):
        own, _ = mix.loss(model, inputs)
        mix.generator.manual_seed(4)
        halved, _ = mix.loss(model, inputs, 2 * mix.counts(labels))
    torch.testing.assert_close(halved, own / 2, rtol=1e-14, atol=0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trls_sfttrainer_with_sftmixs_loss_and_paired_batches_trains_as_the_hand_loop(tmp_path):
    """TRL's SFTTrainer with SFTMixLoss, PairedBatches and the hook in a HookCallback (completion-only
    labels, right padding, two micro-batches per step): its weights after two steps are the hand loop's on
    the Trainer's own batches, the draws reseeded per step from (seed, rank, step), each micro-batch's sums
    divided by the step's counts."""
    import trl

    from harness.language_models import dataset, llama, tokenizer
    from mixhook.integrations.draws import reseed
    from mixhook.integrations.lm import PairedBatches, SFTMixLoss
    from mixhook.integrations.transformers import HookCallback

    class SFTMixTrainer(SFTMixLoss, PairedBatches, trl.SFTTrainer):
        pass

    data = dataset(16).add_column("sftmix_confident", [i % 2 == 0 for i in range(16)])
    trained, hand = llama(), llama()
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0, weight_decay=0.0,
        seed=7, completion_only_loss=True,
    )  # fmt: skip
    trainer = SFTMixTrainer(
        model=trained, args=trl.SFTConfig(**settings), train_dataset=data, processing_class=tokenizer(),
        callbacks=[HookCallback(SFTMix("model.norm", alpha=0.5))],
    )  # fmt: skip
    batches = list(trainer.get_train_dataloader())[:4]
    trainer.train()

    mix, opt = SFTMix("model.norm", alpha=0.5), torch.optim.SGD(hand.parameters(), lr=0.1)
    with mix.attach(hand):
        for step in range(2):
            reseed(mix, 7, 0, step, HookCallback._FIRST_PART)
            micro = batches[2 * step : 2 * step + 2]
            counts = sum(mix.counts(batch["labels"]) for batch in micro)  # (the step's tokens)
            for batch in micro:
                inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
                loss, _ = mix.loss(hand, inputs, counts)
                loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(trained.named_parameters(), hand.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)
    assert not torch.equal(next(trained.parameters()), next(llama().parameters()))  # (it trained)
    with pytest.raises(ValueError, match="HookCallbacks hold 0 SFTMix hooks"):
        SFTMixTrainer(
            model=llama(), args=trl.SFTConfig(**settings), train_dataset=data, processing_class=tokenizer()
        ).compute_loss(hand, inputs)
    with pytest.raises(ValueError, match="so loss_type='dft' would be dropped"):  # (TRL's other loss)
        SFTMixTrainer(
            model=llama(), args=trl.SFTConfig(**{**settings, "loss_type": "dft"}), train_dataset=data,
            processing_class=tokenizer(), callbacks=[HookCallback(SFTMix("model.norm"))],
        ).train()  # fmt: skip


@pytest.mark.slow
def test_with_mu_zero_sftmixs_trainer_trains_as_the_trainers_own_loss_under_gradient_accumulation(tmp_path):
    """SFTMix's l_NTP is the Trainer's own causal LM loss over the step (the sum over its tokens divided by
    num_items_in_batch, every micro-batch's), not each micro-batch's mean: with mu=0, the Trainer with
    SFTMixLoss trains the weights the model's own loss trains (to float32's rounding: the model's loss
    upcasts to it), two micro-batches of different token counts a step. Each micro-batch's mean divided by
    the micro-batches (as NoiseFiT's authors) would differ by 6e-3."""
    import datasets
    import transformers

    from harness.matrix.language import CONFIDENT, data, model
    from mixhook.integrations.lm import PairedBatches, SFTMixLoss
    from mixhook.integrations.transformers import HookCallback

    class Plain(PairedBatches, transformers.Trainer):
        pass

    class SFTMixTrainer(SFTMixLoss, PairedBatches, transformers.Trainer):
        pass

    rows, flags = data(32)
    table = datasets.Dataset.from_dict({**{k: v.tolist() for k, v in rows.items()}, CONFIDENT: flags})
    trained, evaluated, after = {}, {}, {}
    for name, cls, callbacks in (
        ("plain", Plain, []),
        ("sftmix", SFTMixTrainer, [HookCallback(SFTMix("model.norm", mu=0.0))]),
    ):
        net = model()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=3, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0,
            weight_decay=0.0, report_to=[], save_strategy="no", use_cpu=True, seed=7, logging_strategy="no",
            disable_tqdm=True, per_device_eval_batch_size=5,
        )  # fmt: skip
        trainer = cls(model=net, args=args, train_dataset=table, callbacks=callbacks)
        micro = list(trainer.get_train_dataloader())[:2]
        trainer.train()
        trained[name] = dict(net.named_parameters())
        # an odd evaluation batch is no pair to refuse: the plain loss, the Trainer's own (5 rows a batch)
        evaluated[name] = trainer.evaluate(eval_dataset=table.select(range(13)))["eval_loss"]
        # after train(), a training-mode call is the batch's own mean, not a share of the last step's
        net.train()  # (as train() leaves it; evaluate() left it in eval mode)
        after[name] = float(trainer.compute_loss(net, {k: v for k, v in micro[0].items()}))
    tokens = [int((b["labels"][:, 1:] != -100).sum()) for b in micro]
    assert tokens[0] != tokens[1], tokens  # (a mean per micro-batch would weigh their tokens unequally)
    for name, p in trained["plain"].items():
        torch.testing.assert_close(trained["sftmix"][name], p, rtol=0, atol=1e-7, msg=name)
    assert not torch.equal(trained["plain"]["lm_head.weight"], model().lm_head.weight)
    assert evaluated["sftmix"] == pytest.approx(evaluated["plain"], rel=1e-6)
    assert after["sftmix"] == pytest.approx(after["plain"], rel=1e-6)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1 would be dropped"),
        ({"compute_loss_func": True}, "compute_loss_func would be dropped"),
        ({"cp_size": 2}, "cp_size=2 cuts each batch between devices"),
    ],
    ids=["label_smoothing", "compute_loss_func", "context_parallel"],
)
@pytest.mark.parametrize("mixin", ["SFTMixLoss", "NoiseFiTLoss"])
def test_what_a_mixins_own_loss_would_drop_is_refused_in_one_line_before_a_step(
    tmp_path, mixin, setting, message
):
    """The mixins replace the Trainer's loss: a setting that shapes it (label smoothing, a compute_loss_func)
    would be dropped, and a batch cut along its sequence (context parallelism: its size stated here, as no
    CPU can run it) would be mixed and counted wrong; each is refused before the first step."""
    import datasets
    import transformers

    from harness.matrix.language import CONFIDENT, data, model
    from mixhook import NoiseFiT
    from mixhook.integrations import lm as adapter

    hook = SFTMix("model.norm") if mixin == "SFTMixLoss" else NoiseFiT("model.layers.0")
    extra = (adapter.PairedBatches,) if mixin == "SFTMixLoss" else ()
    cls = type("T", (getattr(adapter, mixin), *extra, transformers.Trainer), {})
    rows, flags = data(16)
    table = datasets.Dataset.from_dict({**{k: v.tolist() for k, v in rows.items()}, CONFIDENT: flags})
    options = {k: v for k, v in setting.items() if k == "label_smoothing_factor"}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True, **options,
    )  # fmt: skip
    net = model()
    before = [p.clone() for p in net.parameters()]
    func = (
        (lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum())
        if "compute_loss_func" in setting
        else None
    )
    trainer = cls(
        model=net,
        args=args,
        train_dataset=table,
        callbacks=[adapter.HookCallback(hook)],
        compute_loss_func=func,
    )
    if "cp_size" in setting:
        trainer.get_cp_size = lambda: setting["cp_size"]
    with pytest.raises(ValueError, match=message) as refused:
        trainer.train()
    assert "\n" not in str(refused.value) and mixin in str(refused.value)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before, strict=True))


def test_the_outputs_hold_the_clean_rows_only_and_logits_to_keep_is_refused():
    inputs = batch()
    model = tiny_llama()
    mix = SFTMix("model.norm")
    with mix.attach(model):
        _, outputs = mix.loss(model, {**inputs, "output_hidden_states": True})
        assert outputs.logits.shape[0] == 4 and outputs.hidden_states[-1].shape[0] == 4
        _, as_tuple = mix.loss(model, {**inputs, "return_dict": False})
        assert as_tuple[0].shape[0] == 4
        with pytest.raises(ValueError, match="leave logits_to_keep unset"):
            mix.loss(model, {**inputs, "logits_to_keep": 3})


def test_a_lora_model_is_mixed_as_its_hand_edited_forward_and_only_the_adapters_train():
    """PEFT's LoRA: the hook at the wrapped model's final norm (its name under base_model.model); the loss
    and the adapters' gradients are the hand-written ones on the inner model, the base weights frozen."""
    peft = pytest.importorskip("peft")
    inputs = batch(4)

    def lora():
        net = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
        for name, p in net.named_parameters():  # (LoRA's B starts at zero: move it, so that it counts)
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(0))
        return net

    model, hand = lora(), lora()
    mix = SFTMix("base_model.model.model.norm", generator=torch.Generator().manual_seed(5))
    with mix.attach(model):
        loss, _ = mix.loss(model, inputs)
        loss.backward()
    expected, _ = by_hand(hand.base_model.model, inputs, mix.last.draws["lam"])
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=1e-14)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, _ in trained)
    for (name, p), q in zip(trained, [q for q in hand.parameters() if q.requires_grad], strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-11, atol=1e-13, msg=name)


def test_under_bf16_autocast_the_mix_keeps_the_layers_dtype_and_matches_the_hand_written_loss():
    inputs = batch(5)
    model, hand = tiny_llama().float(), tiny_llama().float()
    mix = SFTMix("model.norm", generator=torch.Generator().manual_seed(6))
    seen = {}
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.__setitem__("dtype", a[0].dtype))
    with mix.attach(model), torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = mix.loss(model, inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, _ = by_hand(hand, inputs, mix.last.draws["lam"])
        dtype = hand.model(input_ids=inputs["input_ids"]).last_hidden_state.dtype
    assert seen["dtype"] == dtype  # (the clean and mixed rows in the norm's own dtype)
    torch.testing.assert_close(loss, expected.to(loss.dtype), rtol=2e-2, atol=0)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_model_that_returns_its_logits_as_a_tensor_is_read_as_one():
    """A model of one's own returning the logits tensor itself (not a ModelOutput or a tuple): its rows are
    the logits' rows, not the first row taken for a tuple's first element."""

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_llama()

        def forward(self, **kwargs):
            return self.inner(**kwargs).logits

    inputs = batch(6)
    wrapped, hf = Plain(), tiny_llama()
    losses = []
    for model, layer in ((wrapped, "inner.model.norm"), (hf, "model.norm")):
        mix = SFTMix(layer, generator=torch.Generator().manual_seed(7))
        with mix.attach(model):
            loss, outputs = mix.loss(model, inputs)
        losses.append(loss)
    assert outputs.logits.shape[0] == 4
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


@pytest.mark.parametrize("how", ["merge_and_unload", "unload"])
def test_a_merged_or_unloaded_lora_model_is_mixed_as_its_own_hand_edited_forward(how):
    """SFTMix on a LoRA model, then merge_and_unload() or unload(): the inner model they return holds the
    hooked norm itself, so mix.loss on it (or on the PeftModel) is the hand-written loss of that model (the
    merged one's equal to the LoRA model's: the same function), not an unmixed one."""
    peft = pytest.importorskip("peft")
    inputs = batch(7)
    lora = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_llama(), lora)
    mix = SFTMix("base_model.model.model.norm", generator=torch.Generator().manual_seed(8))
    with mix.attach(model):
        before, _ = mix.loss(model, inputs)
        inner = getattr(model, how)()
        for net in (inner, model):
            mix.generator.manual_seed(8)
            loss, _ = mix.loss(net, inputs)
            expected, _ = by_hand(inner, inputs, mix.last.draws["lam"])
            torch.testing.assert_close(loss, expected, rtol=1e-13, atol=1e-14)
            assert mix.last.tokens > 0
    if how == "merge_and_unload":
        torch.testing.assert_close(loss, before, rtol=1e-12, atol=1e-13)
    else:
        assert abs(loss.item() - before.item()) > 1e-4  # (the adapters gone: another function)


def test_a_copy_of_the_hooked_model_is_the_plain_model_and_its_loss_is_refused_in_one_line():
    """An EMA's deepcopy or a pickle of the hooked model runs the plain model (its mixhook hooks detached),
    and SFTMix.loss on such a copy says the hooked layer did not run; a copy of the hook comes detached and
    mixes the model it is attached to as the original does, on the same draws."""
    import copy
    import pickle

    inputs = batch(8)
    model, plain = tiny_llama(), tiny_llama()
    tokens = {k: inputs[k] for k in ("input_ids", "attention_mask")}
    mix = SFTMix("model.norm", generator=torch.Generator().manual_seed(9))
    with mix.attach(model):
        expected, _ = mix.loss(model, inputs)
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            torch.testing.assert_close(twin(**tokens).logits, plain(**tokens).logits, rtol=0, atol=0)
            with pytest.raises(RuntimeError, match="the hooked layer did not run in it") as refused:
                mix.loss(twin, inputs)
            assert "\n" not in str(refused.value)
        twin_mix = copy.deepcopy(mix)
    assert twin_mix._model is None
    twin_mix.generator.manual_seed(9)
    with twin_mix.attach(plain):
        loss, _ = twin_mix.loss(plain, inputs)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_a_trainer_without_paired_batches_is_refused_before_its_first_step(tmp_path):
    """SFTMixLoss alone (the mutant that drops PairedBatches) would pair row k with row k + B/2 of a shuffled
    batch, plain random-pair mixup without a word: refused in one line before a weight moves."""
    import datasets
    import transformers

    from harness.matrix.language import CONFIDENT, data, model
    from mixhook.integrations.lm import SFTMixLoss
    from mixhook.integrations.transformers import HookCallback

    class Unpaired(SFTMixLoss, transformers.Trainer):
        pass

    rows, flags = data(16)
    table = datasets.Dataset.from_dict({**{k: v.tolist() for k, v in rows.items()}, CONFIDENT: flags})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    net = model()
    before = [p.clone() for p in net.parameters()]
    trainer = Unpaired(
        model=net, args=args, train_dataset=table, callbacks=[HookCallback(SFTMix("model.norm"))]
    )
    with pytest.raises(ValueError, match="not SFTMix's pairs .* put PairedBatches") as refused:
        trainer.train()
    assert "\n" not in str(refused.value)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before, strict=True))


def test_in_bf16_the_mix_and_its_label_weights_use_one_lam():
    """A bf16 model: each mixed slot is lam * a + (1 - lam) * b computed in float32 with the float32 lam the
    label weights use, rounded once to bf16 (a mix with lam rounded to bf16 would weigh the states by
    another lam than the targets)."""
    inputs = batch(8)
    model = tiny_llama().to(torch.bfloat16)
    mix = SFTMix("model.norm", generator=torch.Generator().manual_seed(3))
    seen = {}
    model.model.norm.register_forward_hook(lambda m, a, out: seen.__setitem__("h", out.detach().clone()))
    model.lm_head.register_forward_pre_hook(lambda m, a: seen.__setitem__("head", a[0].detach().clone()))
    with mix.attach(model):
        mix.loss(model, inputs)
    h, head, lam = seen["h"], seen["head"], mix.last.draws["lam"].float()
    labels = inputs["labels"]
    assert head.dtype == torch.bfloat16 and head.shape[0] == 6  # (4 clean rows, then one per pair)
    for i in range(2):
        p = i + 2
        mine = [t for t in range(1, T) if labels[i, t] != -100]
        theirs = [t for t in range(1, T) if labels[p, t] != -100]
        count = min(len(mine), len(theirs))  # (the shorter response's slots)
        for a, b in zip(mine[:count], theirs[:count], strict=True):
            want = (lam[i] * h[i, a - 1].float() + (1 - lam[i]) * h[p, b - 1].float()).to(torch.bfloat16)
            assert torch.equal(head[4 + i, a - 1], want)
    assert float(lam[0]) != float(lam[0].to(torch.bfloat16))  # (the draw is not a bf16 number itself)


def test_a_non_finite_state_where_no_pair_mixes_spreads_nothing():
    """A padded position's state that is not finite (the model's business: no label reads it) stays out of
    the mixed rows, which select their slots rather than multiply the others by 0 (inf * 0 is NaN, and its
    gradient would reach the partner's states the unused slot had gathered): the loss is the hand-written
    one, and the gradient at the norm's output is finite at every other position."""
    inputs = batch(2)
    model, hand = tiny_llama(), tiny_llama()
    kept = {}

    def poison(module, args, out):
        out = out.clone()
        out[3, 10] = float("inf")  # (row 3 is 7 tokens long: position 10 is padding)
        out.retain_grad()
        kept["h"] = out
        return out

    for net in (model, hand):
        net.model.norm.register_forward_hook(poison)
    mix = SFTMix("model.norm", generator=torch.Generator().manual_seed(9))
    with mix.attach(model):
        loss, _ = mix.loss(model, inputs)
    expected, _ = by_hand(hand, inputs, mix.last.draws["lam"])
    torch.testing.assert_close(loss, expected, rtol=1e-13, atol=1e-14)
    with mix.attach(model):  # (again, its norm output kept: the hand-written forward's was kept last)
        loss, _ = mix.loss(model, inputs)
        h = kept["h"]
        loss.backward()
    elsewhere = torch.ones(h.shape[:2], dtype=torch.bool)
    elsewhere[3, 10] = False
    assert torch.isfinite(loss) and torch.isfinite(h.grad[elsewhere]).all()


def test_token_losses_are_weighted_cross_entropies_with_their_gradient_in_float64_and_bf16(monkeypatch):
    """token_losses (SFTMix's one pass over the clean and mixed logits) against F.cross_entropy written out
    per target in float64, the loss and the gradient, over several chunks of rows; bf16 logits get a bf16
    gradient near float32's; a row without weight is 0 with a 0 gradient even where its logits are not
    finite; and a backward that would differentiate its gradient again is refused."""
    from mixhook.lm import tokens

    monkeypatch.setattr(tokens, "CHUNK", 3 * 11)  # (three rows of 11 a chunk: 7 rows in three chunks)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7, 2), generator=g)
    weights = torch.rand(7, 2, generator=g, dtype=torch.float64)
    weights[2] = 0
    scale = torch.rand(7, generator=g, dtype=torch.float64)
    got = tokens.token_losses(logits, targets, weights)
    (got * scale).sum().backward()
    mine = logits.grad.clone()
    logits.grad = None
    want = sum(weights[:, k] * F.cross_entropy(logits, targets[:, k], reduction="none") for k in range(2))
    (want * scale).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(mine, logits.grad, rtol=1e-13, atol=1e-15)
    assert got[2] == 0 and (mine[2] == 0).all()

    half = logits.detach().to(torch.bfloat16).requires_grad_()
    poisoned = half.detach().clone()
    poisoned[2] = float("nan")  # (row 2 has no weight)
    poisoned.requires_grad_()
    tokens.token_losses(poisoned, targets, weights).sum().backward()
    tokens.token_losses(half, targets, weights).sum().backward()
    assert half.grad.dtype == torch.bfloat16 and (poisoned.grad[2] == 0).all()
    assert torch.isfinite(poisoned.grad).all()
    wide = half.detach().float().requires_grad_()
    sum(weights[:, k].float() * F.cross_entropy(wide, targets[:, k], reduction="none") for k in range(2)).sum(
    ).backward()  # fmt: skip
    torch.testing.assert_close(half.grad.float(), wide.grad, rtol=1e-2, atol=1e-2)

    again = logits.detach().clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no second derivative") as refused:
        torch.autograd.grad(tokens.token_losses(again, targets, weights).sum(), again, create_graph=True)
    assert "\n" not in str(refused.value)
