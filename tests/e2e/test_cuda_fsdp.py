"""FSDP through the trainers on one GPU: Lightning's ``strategy="fsdp"`` and the HuggingFace Trainer's FSDP
(accelerate's plugin), neither of which runs on a CPU. Each test joins a process group of one rank, which
stays for the rest of its process (Lightning's and accelerate's state), so benchmarks/gpu.sh runs each in a
pytest process of its own (``-k lightning``, ``-k hf``). Two ranks of FSDP1 and FSDP2 with a mixer are
tested on the CPU with gloo (tests/e2e/test_distributed.py). Skipped where no GPU is present."""

import copy

import pytest
import torch

from mixhook import ManifoldMixup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_lightning_fsdp_on_one_gpu_trains_the_hand_loops_weights(tmp_path):
    """Lightning's ``strategy="fsdp"`` (it refuses a CPU accelerator) on the one GPU a lent machine has,
    with MixupCallback: the weights the hand loop trains on the same draws, float32 (two ranks under FSDP1
    and FSDP2 are tested on the CPU with gloo: tests/e2e/test_distributed.py)."""
    pytest.importorskip("lightning")
    from tests.integrations import test_integrations_lightning as lit_tests

    loader = lit_tests.data(dtype=torch.float32)
    lit = lit_tests.Lit()
    twin = copy.deepcopy(lit.net).cuda()
    mixer = ManifoldMixup(["net.0", "net.2"], alpha=1.0, generator=torch.Generator().manual_seed(3))
    trainer = lit_tests.trainer(
        tmp_path, accelerator="cuda", devices=1, strategy="fsdp", max_epochs=2,
        callbacks=[lit_tests.MixupCallback(mixer)],
    )  # fmt: skip
    trainer.fit(lit, loader)
    state = trainer.strategy.lightning_module_state_dict()  # (gathered whole)
    x, y = loader.dataset.tensors
    on_gpu = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.cuda(), y.cuda()), batch_size=8)
    lit_tests.hand_loop(twin, ManifoldMixup(["0", "2"], alpha=1.0), on_gpu, 2, 3)
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(state[f"net.{name}"].cuda(), value, rtol=1e-5, atol=1e-6)
    plain = lit_tests.hand_loop(
        copy.deepcopy(lit_tests.Lit().net).cuda(), ManifoldMixup("0", alpha=1.0, prob=0.0), on_gpu, 2, 3
    )
    assert not torch.allclose(plain[0].weight, twin[0].weight)  # the mix mattered


def test_hf_trainer_fsdp_on_one_gpu_trains_the_hand_loops_weights(tmp_path, monkeypatch):
    """The HuggingFace Trainer's FSDP (accelerate's plugin; it needs a process group: one rank, as
    ``accelerate launch --num_processes 1`` makes it) with MixupCallback: the weights the hand loop trains
    on the same draws, float32 to rounding; a padded BERT classifier, gradient accumulation."""
    import socket

    pytest.importorskip("accelerate")
    from tests.integrations import test_integrations_transformers as hf_tests

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    model = hf_tests.bert().float()
    twin = copy.deepcopy(model).cuda()
    data = hf_tests.rows("bert")
    callback = hf_tests.adapter.MixupCallback(ManifoldMixup(hf_tests.BERT_LAYERS, alpha=1.0))
    args = hf_tests.arguments(
        tmp_path, use_cpu=False, fsdp="full_shard", fsdp_config={"use_orig_params": True}
    )
    trainer = hf_tests.hf_trainer(model, args, data, callback)
    trainer.train()
    trained = trainer.accelerator.get_state_dict(trainer.model)  # (gathered whole)
    on_gpu = [{k: v.cuda() for k, v in row.items()} for row in data]
    hf_tests.hand_loop(twin, ManifoldMixup(hf_tests.BERT_LAYERS, alpha=1.0), on_gpu, "bert")
    for name, value in twin.state_dict().items():
        if name in trained:
            torch.testing.assert_close(trained[name].cuda(), value, rtol=1e-5, atol=1e-6)
    assert any(name in trained for name in twin.state_dict())
