"""Case 5: graphs compiled by a compiled model over many training steps with changing lam and layer, with
``fullgraph=True`` (a graph break fails the case) and the graph breaks dynamo counted."""

from __future__ import annotations

import torch
import torch._dynamo
import torch._dynamo.utils
import torch.nn.functional as F
from torch import nn

from benchmarks import cases
from mixhook import ManifoldMixup


def recompiles(device, steps, warmup, batch, size, small: bool) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch.manual_seed(0)
    if small:
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.Flatten(),
            nn.LazyLinear(10),
        )
        layers = ["input", "0", "2"]
    else:
        model = cases.preact_resnet18()
        layers = ["input", "layer1", "layer2"]
    model = model.to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    model(x)  # materialise lazy modules
    mix = ManifoldMixup(layers, generator=torch.Generator().manual_seed(0))
    mix.attach(model)
    compiled = torch.compile(model, backend=counting_backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    per_step, seen_layers, lams = [], set(), set()
    for _ in range(steps):
        loss = mix.loss(F.cross_entropy, compiled(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        per_step.append(len(graphs))
        seen_layers.add(mix.last.layer)
        lams.add(round(float(mix.last.lam), 6))
    return {
        "model": "small CNN" if small else "preact_resnet18",
        "steps": steps,
        "warmup_steps": warmup,
        "layers": layers,
        "distinct_layers_mixed": len(seen_layers),
        "distinct_lams": len(lams),
        "graphs_compiled_total": len(graphs),
        "graphs_compiled_after_warmup": len(graphs) - per_step[warmup - 1],
        "fullgraph": True,
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "backend": "a counting backend (dynamo tracing and guards as with any backend)",
    }
