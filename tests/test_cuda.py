"""The CUDA paths: mixing on the GPU with a CPU generator, autocast dtypes, the benchmark on CUDA.
Skipped cleanly where no GPU is present (CI has none)."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
import torchvision

from mixhook import CutMix, GradScale, ManifoldMixup, NoisyFeatureMixup, PatchUp
from tests.test_benchmarks import run_bench

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("cls", [ManifoldMixup, CutMix, PatchUp, NoisyFeatureMixup])
def test_mixing_on_cuda_matches_cpu(cls):
    torch.manual_seed(0)
    cpu = torchvision.models.resnet18(num_classes=4).double().train()
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(4, 3, 32, 32, dtype=torch.double)
    outs = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        kwargs = {"block_size": 3} if cls is PatchUp else {}
        mix = cls("layer1", generator=torch.Generator().manual_seed(3), **kwargs)
        with mix.attach(model):
            out = model(x.to(device))
            mix.loss(F.cross_entropy, out, torch.tensor([0, 1, 2, 3], device=device)).backward()
        outs.append(out.cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_blend_keeps_the_activation_dtype(dtype):
    model = torchvision.models.resnet18(num_classes=4).cuda().train()
    mix = ManifoldMixup(["input", "layer2"])
    with mix.attach(model), torch.autocast("cuda", dtype=dtype):
        for layer in ("input", "layer2"):
            mix.pin(layer=layer)
            out = model(torch.randn(4, 3, 32, 32, device="cuda"))
            loss = mix.loss(F.cross_entropy, out, torch.tensor([0, 1, 2, 3], device="cuda"))
            assert out.dtype == dtype and torch.isfinite(loss)
            loss.backward()


def test_gradscale_on_cuda():
    model = torchvision.models.resnet18(num_classes=4).cuda().train()
    with GradScale("layer2.0.bn1", -1.0).attach(model):
        model(torch.randn(2, 3, 32, 32, device="cuda")).sum().backward()
    assert torch.isfinite(model.layer2[0].conv1.weight.grad).all()


def test_quick_benchmark_on_cuda(tmp_path):
    result = run_bench("--quick", "--device", "cuda", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    (json_file,) = tmp_path.glob("cuda-*-quick.json")
    data = json.loads(json_file.read_text())
    assert data["memory"]["peak_MiB"]["none"] > 0
    assert data["recompiles"]["graphs_compiled_after_warmup"] == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_app_trains_on_cuda_in_mixed_precision_compiled_with_probes(tmp_path, precision):
    from mixhook.app import run as app
    from tests.test_app import config

    out = tmp_path / precision
    cfg = config(
        "trainer.device=cuda", f"trainer.precision={precision}", "trainer.compile=true",
        "trainer.channels_last=true", "data.train_size=200", "trainer.epochs=1", "trainer.progress_bar=false",
        "probes.layers=[layer1,layer2]", "probes.every=2",
    )  # fmt: skip
    acc = app.main(cfg, out_dir=str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["precision"] == precision and summary["test_acc"] == acc
    assert (out / "probes.csv").read_text().count("layer2") >= 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_torchrun_with_nccl_on_two_gpus(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "train.py"), "data.train_size=200", "trainer.epochs=1", "trainer.progress_bar=false",
         f"hydra.run.dir={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["device"].startswith("cuda")
