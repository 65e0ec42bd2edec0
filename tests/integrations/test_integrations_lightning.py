"""mixhook.integrations.lightning: the real Lightning Trainer (CPU) with MixupCallback against a hand loop
on the same draws (weights bit for bit, float64 and bf16-mixed, gradient accumulation, a schedule with
mixup_off_epoch, a OneOf), validation unmixed, resume bit for bit, and what is refused. DDP with
ddp_spawn is in tests/e2e/test_integrations_ddp.py."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import CutMix, ManifoldMixup, MixSchedule, OneOf, UnknownLayerError
from mixhook.hooks import StateError
from mixhook.integrations.draws import reseed
from tests.helpers import Lazy, lightning_ddp, one_line, per_sample_ce

L = Lazy("lightning")  # imported by the first test that runs, not at collection (see Lazy)
integration = Lazy("mixhook.integrations.lightning")  # imports lightning


def net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )  # fmt: skip


def Lit(*args, **kwargs):  # noqa: N802  (the LightningModule below, defined when first used)
    return lit_class()(*args, **kwargs)


def __getattr__(name: str):  # LitModule, as pickle finds it (ddp_spawn pickles the module to its workers)
    if name == "LitModule":
        return lit_class()
    raise AttributeError(name)


def MixupCallback(*args, **kwargs):  # noqa: N802
    return integration.MixupCallback(*args, **kwargs)


def mixed_loss(*args, **kwargs):
    return integration.mixed_loss(*args, **kwargs)


@functools.cache
def lit_class():
    class LitModule(L.LightningModule):
        """A LightningModule as users write one: training_step takes the loss with mixed_loss."""

        def __init__(self, step: str = "mixed", lr: float = 0.1):
            super().__init__()
            self.net, self.step, self.lr = net(), step, lr
            self.val_losses: list = []

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.step == "plain":  # the mistake: a plain criterion on a mixed forward
                return F.cross_entropy(self(x), y)
            if self.step == "inner":  # calls the submodule, not self
                return mixed_loss(self, F.cross_entropy, self.net(x), y)
            return mixed_loss(self, F.cross_entropy, self(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = mixed_loss(self, F.cross_entropy, logits, y)  # a step shared with training may call it
            self.val_losses.append((loss.detach(), F.cross_entropy(logits, y).detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    LitModule.__module__, LitModule.__qualname__ = __name__, "LitModule"  # picklable: see __getattr__
    return LitModule


def data(n=48, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 3, 6, 6, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def trainer(tmp_path=None, **kwargs):
    options = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    options.update(kwargs)
    if tmp_path is not None:
        options["default_root_dir"] = tmp_path
    return L.Trainer(**options)


def hand_loop(model, mixer, loader, epochs, seed, accumulate=1, schedule=None, autocast=None):
    """What MixupCallback does, written in a plain loop: reseed per batch, the mixed loss, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mixer.attach(model):
        for epoch in range(epochs):
            for i, (x, y) in enumerate(loader):
                if schedule is not None:
                    schedule.set(epoch + 1, i / len(loader))
                reseed(mixer, seed, 0, integration.step_key(epoch, i))
                with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                    loss = mixer.loss(F.cross_entropy, model(x), y)
                (loss / accumulate).backward()
                if (i + 1) % accumulate == 0 or i + 1 == len(loader):
                    opt.step()
                    opt.zero_grad()
    return model


def oneof(prefix):
    return OneOf(
        [
            ManifoldMixup([f"{prefix}0", f"{prefix}2"], alpha=1.0),
            CutMix(f"{prefix}1", alpha=1.0),
        ],
        generator=torch.Generator().manual_seed(3),
    )


@pytest.mark.parametrize(
    "precision, accumulate",
    [("64-true", 1), ("64-true", 2), ("bf16-mixed", 1)],
    ids=["f64", "accum2", "bf16"],
)
def test_fit_equals_the_hand_loop_on_the_same_draws(precision, accumulate):
    """Lightning's fit with the callback (OneOf of Manifold Mixup at two layers and CutMix, a schedule
    that ramps prob and stops mixing after epoch 2) trains the weights a hand loop trains with the same
    draws, bit for bit: float64, gradient accumulation, bf16-mixed under autocast."""
    dtype = torch.float64 if precision == "64-true" else torch.float32
    loader = data(dtype=dtype)
    lit = Lit().to(dtype)
    twin = copy.deepcopy(lit.net)
    mixer = oneof("net.")
    schedule = MixSchedule(mixer, off_epoch=2)
    callback = MixupCallback(mixer, schedule=schedule)
    assert callback.seed == 3
    trainer(max_epochs=3, precision=precision, accumulate_grad_batches=accumulate, callbacks=[callback]).fit(
        lit, loader
    )
    assert mixer.model is None  # removed at teardown
    mixer2 = oneof("")
    hand_loop(
        twin, mixer2, loader, 3, 3, accumulate, MixSchedule(mixer2, off_epoch=2),
        torch.bfloat16 if precision == "bf16-mixed" else None,
    )  # fmt: skip
    for a, b in zip(lit.net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    # and the draws mattered: without the mix, the weights differ
    plain = hand_loop(
        copy.deepcopy(Lit().to(dtype).net), ManifoldMixup("0", alpha=1.0, prob=0.0), loader, 3, 3
    )
    assert not torch.equal(next(plain.parameters()), next(lit.net.parameters()))


def test_a_clean_and_mixed_method_trains_through_mixed_loss_as_the_hand_loop_does():
    """RegMixup doubles the batch inside the forward; mixed_loss takes the 2B logits and the B labels."""
    from mixhook import RegMixup

    loader = data()
    lit = Lit().double()
    twin = copy.deepcopy(lit.net)
    callback = MixupCallback(
        RegMixup("net.2", alpha=2.0, eta=0.5, generator=torch.Generator().manual_seed(4))
    )
    trainer(max_epochs=2, callbacks=[callback]).fit(lit, loader)
    hand_loop(twin, RegMixup("2", alpha=2.0, eta=0.5), loader, 2, 4)
    for a, b in zip(lit.net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_validation_is_unmixed_and_its_loss_plain():
    lit = Lit().double()
    mixer = ManifoldMixup("net.2", alpha=1.0)
    trainer(max_epochs=1, limit_val_batches=2, callbacks=[MixupCallback(mixer)]).fit(lit, data(), data())
    assert len(lit.val_losses) == 2
    for loss, plain in lit.val_losses:
        assert torch.equal(loss, plain)


def test_a_resumed_fit_draws_and_trains_what_the_uninterrupted_one_does(tmp_path):
    """Two epochs, a checkpoint, then two more from it, equal the four epochs straight bit for bit; the
    callback's seed comes back from Lightning's checkpoint (the resumed mixer was built with another)."""
    loader = data()

    def fit(epochs, mixer_seed, ckpt=None, root=None):
        lit = Lit().double()
        mixer = ManifoldMixup(
            ["net.0", "net.2"], alpha=1.0, generator=torch.Generator().manual_seed(mixer_seed)
        )
        every = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True) if root else None
        callbacks = [MixupCallback(mixer)] + ([every] if every else [])
        t = trainer(root, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=root is not None)
        t.fit(lit, loader, ckpt_path=ckpt)
        return lit

    straight = fit(4, 7)
    fit(2, 7, root=tmp_path)
    resumed = fit(4, 99, ckpt=str(tmp_path / "last.ckpt"))  # the seed 7 comes from the checkpoint
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["callbacks"]["MixupCallback"]["seed"] == 7
    # a checkpoint of other layers is refused in one line
    other = MixupCallback(ManifoldMixup("net.4", alpha=1.0))
    with pytest.raises(StateError, match="layers"):
        trainer(max_epochs=3, callbacks=[other]).fit(
            Lit().double(), loader, ckpt_path=str(tmp_path / "last.ckpt")
        )


def test_a_plain_loss_on_a_mixed_forward_is_refused_before_its_backward():
    lit = Lit("plain").double()
    before = copy.deepcopy(lit.net)
    with pytest.raises(RuntimeError, match="its loss was not taken under the mix") as error:
        trainer(max_epochs=1, callbacks=[MixupCallback(ManifoldMixup("net.2", alpha=1.0))]).fit(lit, data())
    assert "mixed_loss(self" in one_line(error)
    for a, b in zip(lit.net.parameters(), before.parameters(), strict=True):
        assert torch.equal(a, b)  # refused before any update


def test_a_step_that_does_not_call_the_hooked_module_is_refused_and_module_fixes_it():
    """training_step calls self.net(x): hooks on the LightningModule never see a forward (a silent no-op
    without the check); module="net" attaches to what the step calls."""
    with pytest.raises(RuntimeError, match="no training forward of the module") as error:
        trainer(max_epochs=1, callbacks=[MixupCallback(ManifoldMixup("net.2", alpha=1.0))]).fit(
            Lit("inner").double(), data()
        )
    one_line(error)
    mixer = ManifoldMixup("2", alpha=1.0)
    trainer(max_epochs=1, callbacks=[MixupCallback(mixer, module="net")]).fit(Lit("inner").double(), data())


def test_bad_input_is_one_line():
    with pytest.raises(UnknownLayerError, match="nosuch"):
        trainer(max_epochs=1, callbacks=[MixupCallback(ManifoldMixup("net.nosuch", alpha=1.0))]).fit(
            Lit().double(), data()
        )
    with pytest.raises(UnknownLayerError, match="nett"):
        trainer(max_epochs=1, callbacks=[MixupCallback(ManifoldMixup("2", alpha=1.0), module="nett")]).fit(
            Lit().double(), data()
        )
    lit = Lit().double()
    mixer = ManifoldMixup("net.2", alpha=1.0)
    with mixer.attach(lit):  # attached by hand and given to the callback
        with pytest.raises(RuntimeError, match="already attached") as error:
            trainer(max_epochs=1, callbacks=[MixupCallback(mixer)]).fit(lit, data())
        one_line(error)
    other = Lit().double()
    with ManifoldMixup("net.0", alpha=1.0).attach(other):  # another mixer on the same module
        with pytest.raises(RuntimeError, match="already has a mixing regularizer"):
            trainer(max_epochs=1, callbacks=[MixupCallback(ManifoldMixup("net.2", alpha=1.0))]).fit(
                other, data()
            )
    x, y = next(iter(data()))
    with pytest.raises(RuntimeError, match="not run by a Lightning Trainer") as error:
        mixed_loss(Lit().double(), F.cross_entropy, Lit().double()(x), y)
    one_line(error)
    with pytest.raises(ValueError, match="MixSchedule of the callback's mixer"):
        MixupCallback(ManifoldMixup("net.2", alpha=1.0), schedule=MixSchedule(ManifoldMixup("x", alpha=1.0)))
    with pytest.raises(TypeError, match="mixhook regularizer"):
        MixupCallback(nn.Linear(2, 2))


def test_under_ddps_forward_redirection_only_the_real_forward_mixes():
    """Lightning's DDP calls training_step through the LightningModule's __call__ (its forward patched):
    hooks on the module see that call first. The callback makes the mixer skip it, so with "input" among
    the layers the batch is not mixed twice and the draws are the hand loop's (one process, gloo)."""
    loader = data()
    lit = Lit().double()
    twin = copy.deepcopy(lit.net)
    mixer = ManifoldMixup(["input", "net.2"], alpha=1.0, generator=torch.Generator().manual_seed(4))
    with lightning_ddp():
        t = trainer(
            max_epochs=2,
            strategy="ddp",
            devices=1,
            use_distributed_sampler=False,
            callbacks=[MixupCallback(mixer)],
        )
        t.fit(lit, loader)
    hand_loop(twin, ManifoldMixup(["input", "2"], alpha=1.0), loader, 2, 4)
    for a, b in zip(lit.net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["balanced", "remix"])
def test_partner_batches_and_class_counts_come_from_the_training_set(policy):
    """Balanced-MixUp's class-balanced partner batch (drawn per step from (seed, rank, step)) and Remix's
    class counts come from the training loader's data set, with no call from the user: the weights equal
    a hand loop's that draws the partner batches with PartnerStream and counts the classes itself."""
    from mixhook.integrations.draws import PartnerStream, dataset_labels
    from mixhook.policies import BalancedMixup, Remix

    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 6, 6, generator=g, dtype=torch.float64)
    y = torch.cat([torch.zeros(28, dtype=torch.long), torch.ones(8, dtype=torch.long), torch.full((4,), 2)])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    def make(prefix="net."):
        mixer = ManifoldMixup(f"{prefix}2", alpha=1.0, generator=torch.Generator().manual_seed(4))
        return mixer.use(BalancedMixup() if policy == "balanced" else Remix())

    class PerSample(lit_class()):
        def training_step(self, batch, batch_idx):
            xb, yb = batch
            return mixed_loss(self, per_sample_ce, self(xb), yb).mean()

    lit = PerSample()
    lit.net.double()
    twin = copy.deepcopy(lit.net)
    mixer = make()
    trainer(max_epochs=1, callbacks=[MixupCallback(mixer)]).fit(lit, loader)
    hand, opt = make(""), torch.optim.SGD(twin.parameters(), lr=0.1)
    stream = PartnerStream(loader.dataset, dataset_labels(loader.dataset), loader.collate_fn, seed=4)
    if policy == "remix":
        hand.policies[0].count(y, 3)
        assert mixer.policies[0].counts.tolist() == [28, 8, 4]
    partners = []
    with hand.attach(twin):
        for i, (xb, yb) in enumerate(loader):
            reseed(hand, 4, 0, integration.step_key(0, i))
            if policy == "balanced":
                xp, yp = stream.batch(0, integration.step_key(0, i), xb.shape[0])
                hand.use_partners(xp, yp)
                partners.append(yp)
            hand.loss(per_sample_ce, twin(xb), yb).mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(lit.net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    if policy == "balanced":  # the partners' classes come about equally often, the batches' do not
        seen = torch.bincount(torch.cat(partners), minlength=3)
        assert seen.min() >= 6 and torch.bincount(y)[0] > 3 * torch.bincount(y)[2]


def test_a_resumed_automix_fit_continues_its_mix_block_and_copy(tmp_path):
    """AutoMix's Mix Block (in the optimizer, with its momentum buffers) and momentum copy travel in
    Lightning's checkpoint: one epoch, a checkpoint, then another from it, equal two epochs straight bit
    for bit (the model, the Mix Block and the copy)."""
    from harness.matrix.methods import data, model
    from mixhook import AutoMix

    x, y = data("cnn")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model("cnn")

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return mixed_loss(self, F.cross_entropy, self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def fit(epochs, ckpt=None, root=None):
        lit = Lit()
        mix = AutoMix("input", features="net.conv1", momentum=0.5, end_momentum=0.5)
        every = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True) if root else None
        callbacks = [MixupCallback(mix, seed=3)] + ([every] if every else [])
        trainer(root, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=root is not None).fit(
            lit, loader, ckpt_path=ckpt
        )
        return [*lit.parameters(), *mix.parameters(), *mix.momentum_model.parameters()]

    straight = fit(2)
    fit(1, root=tmp_path)
    resumed = fit(2, ckpt=str(tmp_path / "last.ckpt"))
    assert len(straight) == len(resumed) > len(list(model("cnn").parameters())) * 2
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)


def test_a_hook_callback_erases_as_the_hand_loop_does_beside_a_mixer_and_resumes(tmp_path):
    """HookCallback: Random Erasing at the network's input and a hidden layer, drawn from (seed, rank, step)
    as the hand loop reseeds it, beside a MixupCallback at the same module's input (erased, then mixed):
    the weights of the hand loop bit for bit; resumed from a checkpoint, the uninterrupted run's."""
    from mixhook import RandomErasing
    from mixhook.integrations.lightning import HookCallback

    loader = data()

    def fit(epochs, ckpt=None, root=None, seed=7):
        lit = Lit("inner").double()
        mixer = ManifoldMixup("input", alpha=1.0, generator=torch.Generator().manual_seed(seed))
        erasing = RandomErasing(["input", "1"], p=0.75, generator=torch.Generator().manual_seed(seed + 1))
        every = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, save_last=True) if root else None
        callbacks = [MixupCallback(mixer, module="net"), HookCallback(erasing, module="net")]
        t = trainer(root, max_epochs=epochs, callbacks=callbacks + ([every] if every else []),
                    enable_checkpointing=root is not None)  # fmt: skip
        t.fit(lit, loader, ckpt_path=ckpt)
        return lit

    straight = fit(2)
    hand = net().double()
    mixer = ManifoldMixup("input", alpha=1.0)
    erasing = RandomErasing(["input", "1"], p=0.75)
    opt = torch.optim.SGD(hand.parameters(), lr=0.1)
    with mixhook_attach(hand, mixer, erasing):
        for epoch in range(2):
            for i, (x, y) in enumerate(loader):
                step = integration.step_key(epoch, i)
                reseed(mixer, 7, 0, step)
                reseed(
                    erasing, 8, 0, step, integration.HookCallback.FIRST_PART
                )  # (its seed: its generator's)
                mixer.loss(F.cross_entropy, hand(x), y).backward()
                opt.step()
                opt.zero_grad()
    for a, b in zip(straight.net.parameters(), hand.parameters(), strict=True):
        assert torch.equal(a, b)
    fit(1, root=tmp_path)
    resumed = fit(2, ckpt=str(tmp_path / "last.ckpt"), seed=50)  # (the seeds come from the checkpoint)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def mixhook_attach(model, *hooks):
    import mixhook

    return mixhook.attach(model, *hooks)


def test_what_a_hook_callback_refuses_is_one_line():
    from mixhook import RandomErasing
    from mixhook.integrations.lightning import HookCallback

    with pytest.raises(TypeError, match="HookCallback needs mixhook hooks that are not mixers"):
        HookCallback(ManifoldMixup("net.0"))
    with pytest.raises(ValueError) as error:
        HookCallback(RandomErasing("input"))
    assert one_line(error).startswith(
        "HookCallback: RandomErasing at 'input' of the LightningModule would act"
    )
    mixer = MixupCallback(ManifoldMixup("input", alpha=1.0))  # (the LightningModule's input)
    with pytest.raises(ValueError) as error:
        trainer(max_epochs=1, callbacks=[mixer, HookCallback(RandomErasing("input"), module="net")]).fit(
            Lit("inner").double(), data()
        )
    assert "the MixupCallback mixes the input of the LightningModule before RandomErasing acts" in one_line(
        error
    )
