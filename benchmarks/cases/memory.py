"""Case 6: peak CUDA memory of a training step with and without the mix."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks import cases
from mixhook import ManifoldMixup


def memory(device, batch, size) -> dict:
    if device.type != "cuda":
        return {"note": "CUDA only (max_memory_allocated)"}
    torch.manual_seed(0)
    out = {}
    for name, hook in (("none", None), ("mixup_layer2", ManifoldMixup("layer2"))):
        model = cases.preact_resnet18().to(device).train()
        if hook:
            hook.attach(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(batch, 3, size, size, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        for _ in range(2):
            torch.cuda.reset_peak_memory_stats(device)
            logits = model(x)
            loss = hook.loss(F.cross_entropy, logits, y) if hook else F.cross_entropy(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        out[name] = torch.cuda.max_memory_allocated(device) / 2**20
        del model, opt
    return {"peak_MiB": out, "mixup_vs_none": out["mixup_layer2"] / out["none"], "batch": batch}
