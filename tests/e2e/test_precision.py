"""trainer.precision (autocast bf16/fp16 with a grad scaler), trainer.compile and trainer.channels_last
in the app: runs finish on CPU, the mix happens in the activation's dtype, checkpoints carry the scaler."""

import json

import pytest
import torch

from harness.app_runs import config
from mixhook import CutMix, ManifoldMixup
from mixhook.app import run as app
from mixhook.app.training import checkpoint as ckpt

TINY = [
    "model._target_=tests.toy_models.TinyConvNet", "allow_targets=[tests.toy_models.*]",
    "mixup.layer=[input,conv1,bn,conv2]",
    "data.train_size=200", "trainer.epochs=2", "trainer.batch_size=32", "trainer.progress_bar=false",
]  # fmt: skip


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_runs_finish_and_say_their_precision(tmp_path, precision):
    out = tmp_path / precision
    acc = app.main(config(*TINY, f"trainer.precision={precision}"), out_dir=str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == precision and summary["test_acc"] == acc
    state = ckpt.load(out / "last.pt")
    if precision == "fp16":  # the grad scaler's state travels with the checkpoint
        assert state["scaler"]["scale"] > 0 and state["scaler"]["growth_interval"] == 2000
    else:
        assert state["scaler"] is None


@pytest.mark.parametrize("loss", ["ce", "bce_softmax"])
def test_every_step_runs_under_autocast_whatever_the_loss(loss):
    """The bce_softmax path once overwrote the autocast dtype with the logits' dtype after the first step:
    bf16 training silently became float32 from the second step on. Every step's forward must be bf16."""
    from mixhook.app.training.loop import Training, train_one_epoch
    from mixhook.app.training.task import Classification
    from tests.toy_models import TinyConvNet

    torch.manual_seed(0)
    model, mixer, dtypes = TinyConvNet(3, 5).train(), ManifoldMixup("conv2"), []
    model.conv1.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    batches = [(torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))) for _ in range(3)]
    with mixer.attach(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)
        train_one_epoch(
            Training(
                model,
                sgd,
                torch.device("cpu"),
                mixer,
                progress_bar=False,
                task=Classification(loss),
                precision="bf16",
            ),
            batches,
        )
    assert dtypes == [torch.bfloat16] * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", [ManifoldMixup, CutMix])
def test_the_mix_runs_in_the_activations_dtype_under_autocast(dtype, kind):
    from tests.toy_models import TinyConvNet

    torch.manual_seed(0)
    model, mixer, seen = TinyConvNet(3, 5).train(), kind("conv2"), {}

    def record(module, args):  # what the head receives: the mixed map, pooled
        seen["dtype"] = args[0].dtype

    model.head.register_forward_pre_hook(record)
    with mixer.attach(model), torch.autocast("cpu", dtype=dtype):
        mixer.pin(lam=0.3, index=[1, 0, 3, 2])
        logits = model(torch.randn(4, 3, 8, 8))
    assert seen["dtype"] == dtype and mixer.last.lam.dtype == torch.float64
    loss = mixer.loss(torch.nn.functional.cross_entropy, logits.float(), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_compile_and_channels_last_runs_finish_with_the_same_checkpoint_layout(tmp_path):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    app.main(config(*TINY, "trainer.epochs=1"), out_dir=str(eager))
    acc = app.main(config(*TINY, "trainer.epochs=1", "trainer.compile=true", "trainer.channels_last=true"),
                   out_dir=str(compiled))  # fmt: skip
    assert 0.0 <= acc <= 1.0
    keys = [set(ckpt.load(d / "last.pt")["model"]) for d in (eager, compiled)]
    assert keys[0] == keys[1] and not any(k.startswith("_orig_mod") for k in keys[1])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.precision=16", "trainer.precision='16' is not a precision; valid: 32, bf16, fp16"),
        ("trainer.precision=float16", "trainer.precision='float16' is not a precision"),
    ],
)
def test_bad_precision_is_refused(override, message):  # trainer.compile=maybe: test_bad_input.py
    with pytest.raises(app.ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        app.build(config(override))


def test_fused_sgd_under_fp16_is_refused_because_a_skipped_first_step_corrupts_its_momentum():
    """The torch behaviour the refusal guards against, shown on this torch (CPU): the grad scaler skips
    the first step (an inf gradient); stock SGD then has no momentum, fused SGD's holds whatever the memory
    held (LibreYOLO/libreyolo#771). Later skipped steps are handled alike by both."""

    def momentum(fused):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4096))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        x = torch.randn(4096)
        x[0] = float("inf")
        scaler.scale((p * x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        return p.detach().clone(), opt.state[p].get("momentum_buffer")

    stock, fused = momentum(False), momentum(True)
    assert stock[1] is None and torch.equal(stock[0], fused[0])  # neither moved the weights
    assert fused[1] is not None  # a buffer from a step that never happened: the next step uses it
    with pytest.raises(
        app.ConfigError, match=r"^optim.fused=true with trainer.precision=fp16: torch's fused SGD"
    ):
        app.build(config(*TINY, "trainer.precision=fp16", "+optim.fused=true"))
    app.build(config(*TINY, "trainer.precision=bf16", "+optim.fused=true")).mixup.remove()
