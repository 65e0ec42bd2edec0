"""One cell of the matrix: a method trained two steps in one workflow, judged against the hand loop on the
same draws (:func:`run`).

The hand loop (:func:`own_loop`) is what each workflow promises to be: per step the draws reseeded from
``(seed, rank, step)`` (or, in timm's script, the mixer's own generator stream), the labels handed to the
mixer before the forward, a class-balanced partner batch from :class:`~mixhook.integrations.draws.
PartnerStream` where the method takes one, Remix's class counts from the training set, the per-sample
criterion's mean under the mix, SGD at 0.1. A workflow's cell is ``exact`` when its weights equal the hand
loop's (float64, to 1e-12), ``refused`` when it stops before its first step with a one-line error (its
reason kept), ``fails`` otherwise (an error of several lines, weights that differ: there should be none).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

import mixhook
from harness.app_runs import results
from mixhook.integrations.draws import PartnerStream, count_classes, reseed

from .methods import Method, criterion, data, model

ROOT = Path(__file__).resolve().parents[2]

SEED, STEPS, BATCH, LR = 7, 2, 8, 0.1
WORKFLOWS = ("own", "lightning", "hf", "trl", "timm", "app", "resume")
TOLERANCE = 1e-12


@dataclass
class Cell:
    method: str
    workflow: str
    outcome: str  # exact | refused | trains | n/a | fails
    detail: str = ""

    def line(self) -> str:
        return f"{self.method:18} {self.workflow:10} {self.outcome:8} {self.detail}"


def _labels(kind: str, y: torch.Tensor) -> torch.Tensor | None:
    return None if kind == "mlp" else y


def hand_setup(method: Method, n: int = STEPS * BATCH) -> tuple:
    """The hand loop's data (``n`` samples), its mixer (Remix's counts from the labels) and, for a partner
    batch, its :class:`~mixhook.integrations.draws.PartnerStream`."""
    x, y = data(method.kind, n=n)
    mixer = method.make("")
    count_classes(mixer, _labels(method.kind, y), "the hand loop")
    stream = PartnerStream(TensorDataset(x, y), y, default_collate, SEED) if method.needs_partners else None
    return x, y, mixer, stream


FIRST_PART = 1 << 20  # the trainers' HookCallbacks draw the hooks beside a mixer from parts of their own


def hand_step(
    mixer, stream, forward, xb, yb, loss_of, rank: int, step: int, reseeded: bool = True, hooks=()
) -> None:
    """One step's forward and backward of the hand loop (the optimizer's step is the caller's); the
    ``hooks`` beside the mixer reseeded as the trainers' ``HookCallback`` reseeds them."""
    if reseeded:
        reseed(mixer, SEED, rank, step)
        for k, hook in enumerate(hooks):
            reseed(hook, SEED, rank, step, FIRST_PART + k)
    mixer.use_targets(yb)
    if stream is not None:
        mixer.use_partners(*stream.like(xb, rank, step))  # (on the batch's device, as the adapters')
    mixer.loss(loss_of, forward(xb), yb).mean().backward()


def steps_with_own_generators(device: str) -> list[str]:
    """Every method of the matrix trains a step on ``device`` with generators there (lam, partners, boxes,
    masks and noise drawn from them), as the matrix's hand loop steps: the failures, one line each."""
    from .methods import METHODS

    failures = []
    for method in METHODS:
        net = model(method.kind).to(device)
        x, y, hook, stream = hand_setup(method, n=8)
        for h in (hook, *getattr(hook, "mixers", ())):
            if "generator" in vars(h):
                h.generator = torch.Generator(device).manual_seed(5)
        try:
            with hook.attach(net):
                hand_step(hook, stream, net, x.to(device), y.to(device), criterion(method.kind), 0, 0, False)
            grads = [p.grad for p in net.parameters()]
            assert all(g is not None and torch.isfinite(g).all() for g in grads), (
                "a gradient is missing or not finite"
            )
            assert hook.last is not None, "no mix"
        except Exception as e:  # noqa: BLE001  (every method's failure named, not the first only)
            failures.append(f"{method.name}: {type(e).__name__}: {e}")
    return failures


def own_loop(method: Method, reseeded: bool = True) -> list[torch.Tensor]:
    """The hand loop: ``STEPS`` steps of ``BATCH`` samples (see the module)."""
    net = model(method.kind)
    x, y, mixer, stream = hand_setup(method)
    loss_of = criterion(method.kind)
    hooks = method.hooks("")
    with mixhook.attach(net, *hooks, mixer):
        # the model's and a learned mixer's own parameters (AutoMix's Mix Block, made at attach)
        opt = torch.optim.SGD([*net.parameters(), *mixer.parameters()], lr=LR)
        for step in range(STEPS):
            xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
            hand_step(mixer, stream, net, xb, yb, loss_of, 0, step, reseeded, hooks)
            opt.step()
            opt.zero_grad()
    return weights(net, mixer)


def weights(net: torch.nn.Module, mixer) -> list[torch.Tensor]:
    """What a cell compares: the model's parameters, then a learned mixer's own (AutoMix's Mix Block: a
    trainer that left its gradients to accumulate over the steps shows only there within two steps)."""
    return [*net.parameters(), *mixer.parameters()]


def _listed(x) -> list[torch.Tensor]:
    return list(x.parameters()) if isinstance(x, torch.nn.Module) else list(x)


def _difference(a, b) -> float:
    """The largest difference between two models' parameters (or two lists of :func:`weights`)."""
    return max(float((p - q).abs().max()) for p, q in zip(_listed(a), _listed(b), strict=True))


def _loader(method: Method) -> DataLoader:
    return DataLoader(TensorDataset(*data(method.kind)), batch_size=BATCH)


# ------------------------------------------------------------------------------------------ workflows


def lightning(method: Method) -> list[torch.Tensor]:
    import lightning as L

    from mixhook.integrations.lightning import HookCallback, MixupCallback, mixed_loss

    loss_of = criterion(method.kind)

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model(method.kind)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return mixed_loss(self, loss_of, self(x), y).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    hooks = method.hooks("")  # (named from the network training_step calls: HookCallback(module="net"))
    if hooks:  # (the mixer at the same module's input, so that it mixes the erased samples)
        lit, mixer = Lit(), method.make("")
        callbacks = [
            MixupCallback(mixer, module="net", seed=SEED),
            HookCallback(*hooks, module="net", seed=SEED),
        ]
    else:
        lit, mixer = Lit(), method.make("net.")
        callbacks = [MixupCallback(mixer, seed=SEED)]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(lit, _loader(method))
    return weights(lit.net, mixer)


class _Outputs(torch.nn.Module):
    """The model as the HuggingFace Trainer calls one: keyword inputs, a dict with its logits."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, pixel_values, labels=None):
        return {"logits": self.net(pixel_values)}


def hf(method: Method) -> list[torch.Tensor]:
    import transformers

    from mixhook.integrations.transformers import HookCallback, MixupCallback

    x, y = data(method.kind)
    rows = [{"pixel_values": a, "labels": b} for a, b in zip(x, y, strict=True)]
    wrapped = _Outputs(model(method.kind))
    loss_of = criterion(method.kind)
    mixer = method.make("net.")
    callback = MixupCallback(mixer, criterion=loss_of if method.kind == "mlp" else None)
    hooks = method.hooks("net.")
    beside = [HookCallback(*hooks)] if hooks else []  # (its seed: TrainingArguments.seed, SEED)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS, optim="sgd",
            learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0, weight_decay=0.0,
            train_sampling_strategy="sequential", report_to=[], save_strategy="no", use_cpu=True, seed=SEED,
            logging_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        transformers.Trainer(
            model=wrapped, args=args, train_dataset=rows, callbacks=[callback, *beside],
            compute_loss_func=callback.compute_loss,
        ).train()  # fmt: skip
    return weights(wrapped.net, mixer)


def timm_script(method: Method) -> list[torch.Tensor]:
    """timm's training step (``ClassificationTask``) with :class:`~mixhook.integrations.timm.MixupFn`, its
    criterion wrapped by ``mixup_fn.loss``."""
    from timm.task import ClassificationTask

    from mixhook.integrations.timm import MixupFn

    net, (x, y) = model(method.kind), data(method.kind)
    mixer = method.make("")
    count_classes(mixer, _labels(method.kind, y), "timm's script")  # (its script gives no counts)
    opt = torch.optim.SGD(net.parameters(), lr=LR)  # (timm's train.py: the optimizer, then the mixup)
    handles = [
        h.attach(net) for h in method.hooks("")
    ]  # (attached by hand; their own streams, as the mixer's)
    mixup_fn = MixupFn(net, mixer, opt)
    base = torch.nn.CrossEntropyLoss() if method.kind != "mlp" else criterion("mlp")
    task = ClassificationTask(net, criterion=mixup_fn.loss(base), verbose=False)
    for step in range(STEPS):
        xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        xb, yb = mixup_fn(xb, yb)  # train_one_epoch
        task(xb, yb)["loss"].backward()
        opt.step()
        opt.zero_grad()
    mixup_fn.remove()
    for handle in handles:
        handle.remove()
    return weights(net, mixer)


LM_LAYERS = {
    "ManifoldMixup": "model.layers.0",
    "NoisyFeatureMixup": "model.layers.0",
    "RegMixup": "model.layers.0",
}


def trl(method: Method) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """TRL's SFTTrainer on a tiny Llama (the method at a decoder layer), and the hand loop on the batches
    it drew; ``None`` for the methods shown on images here."""
    import torch.nn.functional as F

    from harness.language_models import llama, sft
    from mixhook.integrations.transformers import MixupCallback

    layer = LM_LAYERS.get(method.name)
    if layer is None:
        return None
    make = type(method.make(""))
    callback = MixupCallback(make(layer))
    items = []

    def loss(outputs, labels, num_items_in_batch=None):
        items.append(num_items_in_batch)
        return callback.compute_loss(outputs, labels, num_items_in_batch)

    net, hand = llama(), llama()
    with tempfile.TemporaryDirectory() as out:
        trainer = sft(net, out, [callback], loss, max_steps=STEPS)
        batches = list(trainer.get_train_dataloader())[:STEPS]
        trainer.train()

    def summed(logits, labels):
        return (
            F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="none"
            )
            .view(labels.shape[0], -1)
            .sum(1)
        )

    mixer, opt = make(layer), torch.optim.SGD(hand.parameters(), lr=LR)
    with mixer.attach(hand):
        for step, (batch, n) in enumerate(zip(batches, items, strict=True)):
            reseed(mixer, SEED, 0, step)
            out = hand(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            (mixer.loss(summed, out.logits, batch["labels"]).sum() / n).backward()
            opt.step()
            opt.zero_grad()
    return net, hand


APP = ["trainer.epochs=2", "data.train_size=96", "trainer.batch_size=16", "trainer.progress_bar=false"]
NARROW = "+model.width=0.25"  # the default PreActResNet-18 a quarter wide: its checkpoints 16 times smaller


def _app(*overrides, out: str) -> None:
    from harness.app_runs import config
    from mixhook.app import run as app_run

    app_run.main(config(*APP, *_narrow(overrides)), out_dir=out)


def _narrow(overrides) -> list[str]:
    """The default model narrowed, where the overrides keep it (a ``model=`` or an ``experiment=`` may
    choose another: the ViT recipe's)."""
    chosen = any(o.startswith(("model=", "experiment=")) for o in overrides)
    return [*overrides] if chosen else [*overrides, NARROW]


def app(method: Method) -> Cell:
    """The app with the method's shipped ``mixup=`` config on the default data (digits, PreActResNet-18):
    ``trains`` (two short epochs, its summary written), or its one-line refusal, then the run with the
    overrides that refusal names."""
    refusal = ""
    if method.where:
        err = io.StringIO()
        with tempfile.TemporaryDirectory() as out, contextlib.redirect_stderr(err):
            try:
                _app(f"mixup={method.app}", *method.app_beside, out=out)
                return Cell(method.name, "app", "fails", "the default data took it: drop where=")
            except SystemExit:
                refusal = err.getvalue().strip().splitlines()[-1] + "; "
    with tempfile.TemporaryDirectory() as out:
        _app(f"mixup={method.app}", *method.app_beside, *method.where, out=out)
        trained = json.loads((Path(out) / "summary.json").read_text())
    where = " ".join((f"mixup={method.app}", *method.app_beside, *method.where))
    return Cell(method.name, "app", "trains", f"{refusal}{where}: {len(trained) and 'summary written'}")


def resume(method: Method) -> Cell:
    """``train.py`` with the method killed (SIGKILL) after a random number (1 to 8) of its checkpoints, then
    ``trainer.resume=auto``: the metrics and summary equal an uninterrupted run's."""
    settings = [
        f"mixup={method.app}",
        *method.app_beside,
        *method.where,
        "trainer.checkpoint_every=1",
        "seed=3",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        reference, killed = Path(tmp) / "reference", Path(tmp) / "killed"
        _app(*settings, out=str(reference))
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *APP, *_narrow(settings), f"hydra.run.dir={killed}"],
            cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        # killed after a random number of its checkpoints (one per step): a point in its progress, not in
        # time, which a loaded machine would move (the run could end first)
        deadline, writes, seen = time.time() + 300, random.Random(method.name).randint(1, 8), None
        while writes:
            if proc.poll() is not None or time.time() > deadline:
                if seen is None:
                    why = f"no checkpoint: {proc.communicate()[1][-200:]}"
                    return Cell(method.name, "resume", "fails", why)
                break
            try:
                stat = (killed / "last.pt").stat()
            except FileNotFoundError:
                stat = None
            if stat is not None and (stat.st_ino, stat.st_mtime_ns) != seen:
                seen, writes = (stat.st_ino, stat.st_mtime_ns), writes - 1
            time.sleep(0.005)
        proc.kill()
        proc.wait()
        if (killed / "summary.json").exists():
            return Cell(method.name, "resume", "fails", "the run ended before it could be killed")
        state = torch.load(killed / "last.pt", weights_only=True)
        _app(*settings, "trainer.resume=auto", out=str(killed))
        same = results(killed) == results(reference)
    at = f"killed after epoch {state['epoch']}, step {state['step']}"
    return Cell(method.name, "resume", "exact" if same else "fails", at if same else f"{at}: metrics differ")


# ------------------------------------------------------------------------------------------ a cell


def _one_line(error: BaseException) -> str | None:
    text = str(error)
    return text if text and "\n" not in text.strip() else None


def run(method: Method, workflow: str) -> Cell:
    """Run ``method`` in ``workflow`` and judge it (see the module)."""
    err = io.StringIO()
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            logging.disable(logging.WARNING)
            return _judged(method, workflow)
    except SystemExit as exit_:  # the app's refusal: its one line went to stderr
        lines = err.getvalue().strip().splitlines()
        return Cell(method.name, workflow, "refused", lines[-1] if lines else f"exit {exit_.code}")
    except Exception as error:  # noqa: BLE001 - a cell records what any failure was
        line = _one_line(error)
        if line is not None and isinstance(error, ValueError | TypeError | RuntimeError):
            return Cell(method.name, workflow, "refused", f"{type(error).__name__}: {line}")
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Cell(method.name, workflow, "fails", f"{type(error).__name__}: {first}")
    finally:
        logging.disable(logging.NOTSET)


def _judged(method: Method, workflow: str) -> Cell:
    if method.kind == "lm":
        return _language(method, workflow)
    if workflow in ("app", "resume"):
        if method.app is None:
            return Cell(method.name, workflow, "n/a", "no shipped config")
        return app(method) if workflow == "app" else resume(method)
    if workflow == "trl":
        found = trl(method)
        if found is None:
            return Cell(method.name, workflow, "n/a", "shown on images here (TRL trains language models)")
        got, expected = found
    elif workflow == "own":
        return _deterministic(method, own_loop)
    else:
        runner = {"lightning": lightning, "hf": hf, "timm": timm_script}[workflow]
        got = runner(method)
        expected = own_loop(method, reseeded=workflow != "timm")
    fresh = list(model(method.kind).parameters()) if workflow != "trl" else None
    return _verdict(method, workflow, got, expected, fresh)


def _deterministic(method: Method, loop) -> Cell:
    """The hand loop run twice: the same weights (it is the reference of every other cell)."""
    same = _difference(loop(method), loop(method)) == 0
    return Cell(method.name, "own", "exact" if same else "fails", "")


def _verdict(method: Method, workflow: str, got, expected, fresh: list | None) -> Cell:
    """``exact`` where the workflow's weights equal the hand loop's (to ``TOLERANCE``) and differ from the
    untrained ``fresh`` ones (``None``: not compared), else ``fails``."""
    diff = _difference(got, expected)
    changed = _difference(_listed(got)[: len(fresh)], fresh) if fresh is not None else 1.0
    if diff <= TOLERANCE and changed > 0:
        return Cell(method.name, workflow, "exact", f"{diff:.1e}")
    return Cell(method.name, workflow, "fails", f"differs from the hand loop by {diff:.2e}")


def _language(method: Method, workflow: str) -> Cell:
    """A cell of a hook with a loss of its own (:mod:`.language`)."""
    from . import language

    if workflow == "own":
        return _deterministic(method, language.own_loop)
    if workflow not in ("hf", "trl"):
        return Cell(method.name, workflow, "n/a", language.NOT_HERE)
    got, expected = (language.hf if workflow == "hf" else language.trl)(method)
    return _verdict(method, workflow, got, expected, list(language.model().parameters()))
