"""torch.compile with mixhook's hooks: no recompiles after warm-up, and the hook-guard pitfall is caught.

Dynamo's own tracing and guards are what is tested; the "eager" backend runs the captured graphs
without code generation, so these tests take seconds.
"""

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from mixhook import ManifoldMixup
from tests.helpers import SmallCNN


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_training_with_three_layers_stops_compiling_after_warm_up():
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = SmallCNN().train()
    mix = ManifoldMixup(["input", "conv1", "conv2"], generator=torch.Generator().manual_seed(0))
    mix.attach(model)
    compiled = torch.compile(model, backend=counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    counts, layers, lams = [], set(), set()
    for _ in range(30):
        loss = mix.loss(F.cross_entropy, compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        counts.append(len(graphs))
        layers.add(mix.last.layer)
        lams.add(float(mix.last.lam))
    assert layers == {"input", "conv1", "conv2"} and len(lams) == 30
    assert counts[-1] == counts[9] > 0  # nothing compiled after the first 10 steps
    mix.remove()


def test_a_hooked_twin_of_a_compiled_model_is_caught_not_silently_unmixed():
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(0)
    plain, hooked = SmallCNN().train(), SmallCNN().train()
    torch.compile(plain, backend="eager")(x)  # compiled first, without hooks
    mix = ManifoldMixup("conv2")
    with mix.attach(hooked):
        with pytest.raises(RuntimeError, match="skip_nnmodule_hook_guards = False"):
            torch.compile(hooked, backend="eager")(x)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):  # set before compiling either
            torch.compile(plain, backend="eager")(x)
            torch.compile(hooked, backend="eager")(x)
        assert mix.last is not None and mix.last.layer == "conv2"
