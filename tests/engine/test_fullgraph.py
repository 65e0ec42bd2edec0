"""torch.compile(fullgraph=True) with the mixers that trace into the graph (mixhook.engine.traced).

Each test compiles the hooked model with ``fullgraph=True`` (a graph break fails it) under dynamo's
``fail_on_recompile_limit_hit`` with a limit of one compile per frame (a recompile fails it), and compares
a few training steps with an eager twin from the same seeds: the same layers, lams, losses and
gradients (the draws come from the mixer's own generator in the eager order). "aot_eager" runs AOT
autograd and functionalization (where the operators' ordered effects are handled) without code
generation; one test runs inductor.
"""

import pickle

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mixhook import (
    CutMix,
    FMix,
    GridMix,
    ManifoldMixup,
    NoisyFeatureMixup,
    OneOf,
    PatchUp,
    ResizeMix,
    SaliencyMix,
    SmoothMix,
    TokenMix,
)
from mixhook.engine.contract import ForeignLogitsError
from tests.helpers import SmallCNN

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # (tests/conftest.py)


def _gen():
    return torch.Generator().manual_seed(3)


TRACED = {
    "manifold": lambda: ManifoldMixup(["input", "conv1", "conv2"], generator=_gen()),
    "manifold-elem-prob": lambda: ManifoldMixup(["input", "conv2"], mode="elem", prob=0.6, generator=_gen()),
    "manifold-pair-weights": lambda: ManifoldMixup(["conv1", "conv2"], mode="pair", generator=_gen()),
    "cutmix": lambda: CutMix(["input", "conv1"], generator=_gen()),
    "cutmix-elem-timm": lambda: CutMix(["input", "conv1"], mode="elem", rounding="timm", generator=_gen()),
    "fmix": lambda: FMix(["input", "conv1"], generator=_gen()),
    "gridmix": lambda: GridMix(["input", "conv1"], grid=(2, 2), generator=_gen()),
    "smoothmix": lambda: SmoothMix(["input", "conv2"], generator=_gen()),
    "patchup": lambda: PatchUp(["conv1", "conv2"], block_size=3, generator=_gen()),
    "patchup-hard": lambda: PatchUp(["conv1", "conv2"], block_size=3, mode="hard", generator=_gen()),
    "resizemix": lambda: ResizeMix(["input", "conv1"], generator=_gen()),
    "resizemix-bicubic": lambda: ResizeMix(["input", "conv1"], interpolation="bicubic", generator=_gen()),
    "resizemix-area": lambda: ResizeMix(
        ["input", "conv1"], scope=(0.3, 0.8), interpolation="area", generator=_gen()
    ),
    "tokenmix": lambda: TokenMix(["input", "conv1"], generator=_gen()),
    "tokenmix-random-grid": lambda: TokenMix(
        ["input", "conv1"], grid=(4, 4), mask_type="random", generator=_gen()
    ),
    "nfm": lambda: NoisyFeatureMixup(["input", "conv1", "conv2"], generator=_gen()),
    "nfm-elem-mult-only": lambda: NoisyFeatureMixup(
        ["input", "conv2"], add_noise=0, mode="elem", generator=_gen()
    ),
}


def _per_sample(o, t):
    return F.cross_entropy(o, t, reduction="none")


def _train(make, compiled: bool, steps: int = 6, backend: str = "aot_eager", wrap=None, compiles: int = 1):
    """``steps`` training steps of a SmallCNN with ``make()`` attached; per step: the mixed layer, lam,
    loss and gradients. A frame compiled more than ``compiles`` times (once per mixer whose hooks share
    it) fails."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SmallCNN().train()
    mix = make()
    if isinstance(mix, ManifoldMixup) and mix.mode == "pair":
        mix.layer_weights = [1, 3]
    mix.attach(model)
    net = model
    if compiled:
        net = torch.compile(wrap(model) if wrap else model, backend=backend, fullgraph=True)
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    out = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=compiles):
        for _ in range(steps):
            model.zero_grad()
            loss = mix.loss(_per_sample, net(x), y).mean()
            loss.backward()
            last = mix.last
            lam = None if last is None else last.lam.clone()
            out.append(
                (
                    None if last is None else last.layer,
                    lam,
                    loss.detach(),
                    [p.grad.clone() for p in model.parameters()],
                )
            )
    mix.remove()
    return out


def _same(eager, compiled):
    assert [s[0] for s in compiled] == [s[0] for s in eager]
    for (_, lam, loss, grads), (_, lam_c, loss_c, grads_c) in zip(eager, compiled, strict=True):
        if lam is not None:
            torch.testing.assert_close(lam_c, lam, rtol=0, atol=0)  # the same draws
        torch.testing.assert_close(loss_c, loss)
        torch.testing.assert_close(grads_c, grads)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TRACED))
def test_fullgraph_training_equals_eager_with_the_same_draws_and_no_recompile(kind):
    eager = _train(TRACED[kind], compiled=False)
    assert len({s[0] for s in eager}) > 1 or kind.startswith("manifold-elem")  # several layers were drawn
    _same(eager, _train(TRACED[kind], compiled=True))


@pytest.mark.slow
def test_one_of_traced_mixers_chooses_in_the_graph():
    """timm's switch between mixup and CutMix: OneOf's choice runs in mixhook::begin before its mixers'."""

    def make():
        mixers = [
            CutMix(["input", "conv1"], generator=_gen()),
            ManifoldMixup(["input", "conv2"], generator=_gen()),
        ]
        return OneOf(mixers, p=[0.5, 0.5], generator=torch.Generator().manual_seed(7))

    eager = _train(make, compiled=False, steps=10)
    assert {"conv1", "conv2"} <= {s[0] for s in eager}  # each mixer was chosen (conv1: CutMix's only)
    _same(eager, _train(make, compiled=True, steps=10, compiles=2))  # (the two mixers' model hooks)


def test_every_traced_method_is_traceable_and_no_other_is():
    for make in TRACED.values():
        assert make().traceable
    assert not ManifoldMixup("conv1", partners="global").traceable
    assert CutMix("conv1", tokens=(2, 2)).traceable
    assert not SaliencyMix("conv1").traceable  # its box follows the saliency: mixed between graphs

    class Doubled(ManifoldMixup):  # a subclass that changes mix() without its traced path, whose mixes the
        def mix(self, leaves, draw):  # inherited one would silently leave out: not traced (between graphs)
            return super().mix(leaves, draw)

    assert not Doubled("conv1").traceable


@pytest.mark.slow
def test_no_graph_break_and_the_hooks_inline_into_a_compiled_caller():
    torch.manual_seed(0)
    model = SmallCNN().train()
    mix = ManifoldMixup(["input", "conv1", "conv2"], generator=_gen())
    mix.attach(model)
    explained = torch._dynamo.explain(model)(torch.randn(4, 3, 8, 8))
    assert explained.break_reasons == []
    mix.remove()
    # a compiled function calling the model traces its hooks into its own graph: one graph
    eager = _train(TRACED["manifold"], compiled=False)
    _same(eager, _train(TRACED["manifold"], compiled=True, wrap=lambda m: lambda x: m(x)))


@pytest.mark.slow
def test_inductor_equals_eager():
    for kind in ("manifold", "cutmix-elem-timm"):
        _same(
            _train(TRACED[kind], compiled=False, steps=3),
            _train(TRACED[kind], compiled=True, steps=3, backend="inductor"),
        )


def _compiled_model(make, backend="aot_eager"):
    torch.manual_seed(0)
    model = SmallCNN().train()
    mix = make()
    mix.attach(model)
    return model, mix, torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.slow
def test_an_eval_forward_and_two_forwards_before_their_losses_get_their_own_mix():
    model, mix, net = _compiled_model(TRACED["manifold"])
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    first = net(x)
    state_first = mix.last
    model.eval()
    evaluated = net(x)  # with gradients: an eval forward in between
    model.train()
    second = net(x)
    state_second = mix.last
    assert state_first is not state_second
    # in reverse order: each loss is bound to its own forward
    assert mix.state_for(second) is state_second
    assert mix.state_for(first) is state_first
    assert mix.state_for(evaluated) is None
    plain = F.cross_entropy(evaluated, y)
    torch.testing.assert_close(mix.loss(F.cross_entropy, evaluated, y), plain)
    lam = float(state_first.lam)
    expected = lam * F.cross_entropy(first, y) + (1 - lam) * F.cross_entropy(first, y[state_first.index])
    torch.testing.assert_close(mix.loss(F.cross_entropy, first, y), expected)
    # logits of another (compiled) model are refused, never given this mixer's mix
    other = torch.compile(SmallCNN().train(), backend="aot_eager")
    with pytest.raises(ForeignLogitsError):
        mix.loss(F.cross_entropy, other(x), y)


@pytest.mark.slow
def test_pins_skips_and_pin_last_are_followed_compiled():
    model, mix, net = _compiled_model(TRACED["cutmix"])
    x = torch.randn(6, 3, 8, 8)
    mix.pin(layer="conv1", lam=0.75, index=[5, 4, 3, 2, 1, 0], box=(1, 5, 2, 6))
    net(x)
    assert mix.last.layer == "conv1" and mix.last.info["box"] == (1, 5, 2, 6)
    assert mix.last.index.tolist() == [5, 4, 3, 2, 1, 0]
    assert float(mix.last.lam) == 1 - 16 / 64
    mix.skip_next()
    out = net(x)
    assert mix.last is None and mix.state_for(out) is None
    first = net(x)
    state = mix.last
    mix.pin_last()
    again = net(x)
    assert mix.last.layer == state.layer and mix.last.info["box"] == state.info["box"]
    assert torch.equal(mix.last.index, state.index)
    torch.testing.assert_close(again, first)  # the same mix of the same batch


@pytest.mark.slow
def test_a_resumed_compiled_run_repeats_the_draws():
    model, mix, net = _compiled_model(TRACED["manifold"])
    x = torch.randn(6, 3, 8, 8)
    net(x)
    state = pickle.loads(pickle.dumps(mix.state_dict()))
    after = []
    for _ in range(3):
        net(x)
        after.append((mix.last.layer, float(mix.last.lam), mix.last.index.tolist()))
    mix.load_state_dict(state)
    again = []
    for _ in range(3):
        net(x)
        again.append((mix.last.layer, float(mix.last.lam), mix.last.index.tolist()))
    assert again == after


def test_a_layer_the_compiled_forward_does_not_run_is_refused_before_the_loss():
    class Skips(SmallCNN):
        def forward(self, x):
            return self.head(self.act(self.conv1(x)).mean((2, 3)))  # conv2 never runs

    torch.manual_seed(0)
    model = Skips().train()
    mix = ManifoldMixup("conv2")
    mix.attach(model)
    net = torch.compile(model, backend="aot_eager", fullgraph=True)
    logits = net(torch.randn(4, 3, 8, 8))
    with pytest.raises(RuntimeError, match="'conv2' did not run during a compiled forward"):
        mix.loss(F.cross_entropy, logits, torch.zeros(4, dtype=torch.long))


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = checkpoint(self.block, F.relu(self.conv1(x)), use_reentrant=False)
        return self.head(h.mean((2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_mixed_layer_inside_activation_checkpointing_is_mixed_between_graphs_exactly(backend):
    """A compiled recomputation would call the draw again (a second mix, or AOT's refusal): the layer is
    mixed between graphs, where the recomputation replays the forward's mix; fullgraph=True is refused
    with the reason."""
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _Checkpointed().train()
        mix = ManifoldMixup(["conv1", "block.0"], generator=_gen())
        mix.layer_weights = [1, 3]
        mix.attach(model)
        net = torch.compile(model, backend=backend) if compiled else model
        x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
        steps = []
        for _ in range(4):
            model.zero_grad()
            mix.loss(F.cross_entropy, net(x), y).backward()
            steps.append((mix.last.layer, [p.grad.clone() for p in model.parameters()]))
        results.append(steps)
    assert {s[0] for s in results[0]} == {"conv1", "block.0"}
    assert [s[0] for s in results[1]] == [s[0] for s in results[0]]
    torch.testing.assert_close([s[1] for s in results[1]], [s[1] for s in results[0]])
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported) as refused:
        torch.compile(model, backend=backend, fullgraph=True)(x)
    assert "inside an activation-checkpointed region" in str(refused.value)


def test_a_channels_last_map_is_cut_along_height_and_width_compiled():
    class NHWC(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 8)
            self.head = nn.Linear(8, 5)

        def forward(self, x):  # x: (B, H, W, 3)
            return self.head(self.embed(x).mean((1, 2)))

    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = NHWC().train()
        mix = CutMix("embed", layout="NHWC", generator=_gen())
        mix.attach(model)
        net = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        x, y = torch.randn(4, 6, 7, 3), torch.randint(0, 5, (4,))
        loss = mix.loss(F.cross_entropy, net(x), y)
        loss.backward()
        results.append((mix.last.info["box"], loss.detach(), [p.grad.clone() for p in model.parameters()]))
        mix.remove()
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[1][1:], results[0][1:])


@pytest.mark.slow
def test_batches_and_maps_of_other_sizes_trace_with_dynamic_shapes():
    """The last batch of an epoch (or another map size) recompiles with symbolic sizes: the draws' sizes
    travel as the operator's arguments, so the graph stays whole and the mixes equal eager."""
    makers = [
        lambda: ManifoldMixup(["input", "conv1", "conv2"], mode="elem", generator=_gen()),
        lambda: CutMix(["input", "conv1"], mode="elem", generator=_gen()),
        lambda: PatchUp(["conv1"], block_size=3, generator=_gen()),
    ]
    for make in makers:
        results = []
        for compiled in (False, True):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = SmallCNN().train()
            mix = make()
            mix.attach(model)
            net = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
            steps = []
            for batch, side in [(8, 8), (6, 8), (5, 8), (7, 9)]:
                x, y = torch.randn(batch, 3, side, side), torch.randint(0, 5, (batch,))
                model.zero_grad()
                loss = mix.loss(_per_sample, net(x), y).mean()
                loss.backward()
                steps.append((mix.last.layer, loss.detach(), [p.grad.clone() for p in model.parameters()]))
            results.append(steps)
        assert [s[0] for s in results[1]] == [s[0] for s in results[0]]
        torch.testing.assert_close([s[1:] for s in results[1]], [s[1:] for s in results[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_traced_blend_equals_the_eager_blend_bit_for_bit(dtype):
    from mixhook.functional import blend, lerp_rows

    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 5, 4, 4, generator=g).to(dtype)
    index = torch.randperm(6, generator=g)
    lam = torch.tensor(0.3137, dtype=torch.float64)
    assert torch.equal(lerp_rows(h, lam.expand(6), index), blend(h, float(lam), index))
    per_sample = torch.rand(6, dtype=torch.float64, generator=g)
    assert torch.equal(lerp_rows(h, per_sample, index, one=False), blend(h, per_sample, index))


@pytest.mark.slow
def test_an_eager_forward_after_a_compiled_one_does_not_take_its_record():
    model, mix, net = _compiled_model(TRACED["manifold"])
    x = torch.randn(6, 3, 8, 8)
    compiled_logits = net(x)
    compiled_state = mix.last
    eager_logits = model(x)  # the same model, called without compiling
    eager_state = mix.last
    assert eager_state is not compiled_state
    assert mix.state_for(compiled_logits) is compiled_state
    assert mix.state_for(eager_logits) is eager_state


@pytest.mark.slow
def test_a_copy_of_a_hooked_model_compiles_whole_and_mixes_nothing():
    """An EMA or deepcopy of the hooked model holds inert hooks: compiled with fullgraph=True it runs as
    the plain model, its logits are refused by the original's mixer, whose draws it does not touch."""
    import copy

    model, mix, net = _compiled_model(TRACED["manifold"])
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    out = net(x)
    state, generator = mix.last, mix.generator.get_state()
    twin = copy.deepcopy(model)
    compiled_twin = torch.compile(twin, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        logits = compiled_twin(x)
        torch.testing.assert_close(logits, twin.head(twin.conv2(twin.act(twin.conv1(x))).mean((2, 3))))
    assert mix.last is state and torch.equal(mix.generator.get_state(), generator)
    assert mix.state_for(out) is state
    with pytest.raises(ForeignLogitsError):
        mix.loss(F.cross_entropy, logits, y)


@pytest.mark.parametrize("interpolation", ["nearest", "nearest-exact", "bilinear", "bicubic", "area"])
def test_the_traced_resizemix_paste_equals_the_resize_on_every_box(interpolation):
    """The graph pastes the partner through the resize's separable weights over the whole map (fixed
    shapes); equal, values and gradients, to F.interpolate into the box: inside, at a border, whole,
    empty, on a non-square map."""
    from mixhook.mixers.resizemix import paste_resized, resize_weights
    from mixhook.sites import Leaf

    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 3, 9, 12, dtype=torch.float64, generator=g)
    index = torch.randperm(5, generator=g)
    mix = ResizeMix("conv1", interpolation=interpolation)
    exact = interpolation.startswith("nearest")
    for box in [(2, 7, 3, 10), (0, 4, 8, 12), (0, 9, 0, 12), (5, 8, 0, 3), (4, 4, 2, 9)]:
        values = [index, torch.tensor(box), resize_weights(9, *box[:2], interpolation)]
        values.append(resize_weights(12, *box[2:], interpolation))
        eager_h, traced_h = h.clone().requires_grad_(), h.clone().requires_grad_()
        eager = paste_resized(eager_h, index, box, interpolation)
        traced = mix.mix_traced([Leaf((), traced_h, 0)], values)[()]
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-12, "atol": 1e-12}
        torch.testing.assert_close(traced, eager, **tol)
        weights = torch.randn(h.shape, dtype=torch.float64, generator=g)
        (eager * weights).sum().backward()
        (traced * weights).sum().backward()
        torch.testing.assert_close(traced_h.grad, eager_h.grad, rtol=1e-12, atol=1e-12)


VIT_MIXERS = {
    "cutmix": lambda: CutMix(["blocks.0", "blocks.1"], tokens="auto", generator=_gen()),
    "cutmix-elem": lambda: CutMix(["blocks.0", "blocks.1"], mode="elem", tokens="auto", generator=_gen()),
    "fmix-keep": lambda: FMix(["blocks.0", "blocks.1"], tokens="auto", prefix="keep", generator=_gen()),
    "tokenmix": lambda: TokenMix(["blocks.0", "blocks.1"], tokens=(4, 4), generator=_gen()),
    "resizemix": lambda: ResizeMix(
        ["blocks.0", "blocks.1"], scope=(0.5, 0.8), tokens="auto", generator=_gen()
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(VIT_MIXERS))
def test_a_vit_mixed_on_its_tokens_compiles_whole_and_equals_eager(kind):
    """A timm ViT's tokens through the patch grid (class token blended or kept, a lam per sample): one
    graph, the same draws, losses and gradients as eager."""
    import timm

    def run(compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        options = {"img_size": 16, "patch_size": 4, "embed_dim": 12, "depth": 2, "num_heads": 2}
        model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, **options).train()
        mix = VIT_MIXERS[kind]()
        mix.attach(model)
        net = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        x, y = torch.randn(6, 3, 16, 16), torch.randint(0, 5, (6,))
        out = []
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=1):
            for _ in range(5):
                model.zero_grad()
                logits = net(x)
                mix.loss(_per_sample, logits, y).mean().backward()
                out.append(
                    (mix.last.layer, mix.last.lam, logits.detach(), [p.grad for p in model.parameters()])
                )
        mix.remove()
        return out

    eager, compiled = run(False), run(True)
    assert len({s[0] for s in eager}) > 1  # several layers were drawn
    assert [s[0] for s in compiled] == [s[0] for s in eager]
    for (_, lam, logits, grads), (_, lam_c, logits_c, grads_c) in zip(eager, compiled, strict=True):
        torch.testing.assert_close(lam_c, lam, rtol=0, atol=0)
        torch.testing.assert_close(logits_c, logits)
        torch.testing.assert_close(grads_c, grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_traced_leading_token_blend_equals_the_eager_one_bit_for_bit(dtype):
    from mixhook.engine.tokens import TokenGrid, traced_weight
    from mixhook.sites import Leaf

    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(6, 1 + 9, 8, generator=g).to(dtype)
    mixed = torch.randn(6, 8, 3, 3, generator=g).to(dtype)
    index = torch.randperm(6, generator=g)
    grid = TokenGrid((3, 3), "blend", "CutMix")
    for lam in [torch.tensor(0.3137, dtype=torch.float64), torch.rand(6, dtype=torch.float64, generator=g)]:
        eager = grid.from_map(Leaf((), tokens, 0), mixed, lam, index, permutation=True)
        traced = grid.from_map_traced(Leaf((), tokens, 0), mixed, traced_weight(lam, 6, dtype), index)
        assert torch.equal(traced, eager)


@pytest.mark.slow
def test_a_compile_that_captures_cuda_graphs_partitions_on_mixhooks_operators():
    """torch.compile(mode="reduce-overhead") must run mixhook::begin/draw between the captured graphs, fresh
    at every replay. Their cudagraph_unsafe tag is not read through the with_effects wrapper of an ordered
    operator (torch 2.11 on CUDA captured mixhook::draw, and the capture refusal fired), so mixhook names
    them in inductor's custom_should_partition_ops when a compile captures graphs, and only then. (The
    replay itself is tests/e2e/test_cuda.py's; on the CPU no graph is captured.)"""
    import torch._inductor.config as inductor

    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    for mode, named in ((None, []), ("reduce-overhead", ["mixhook::begin", "mixhook::draw"])):
        torch._dynamo.reset()
        with inductor.patch(custom_should_partition_ops=[]):
            model, mix, net = _compiled_model(lambda: ManifoldMixup(["input", "conv1"], generator=_gen()))
            if mode:
                net = torch.compile(model, mode=mode, fullgraph=True)
            mix.loss(F.cross_entropy, net(x), y).backward()
            assert mix.last is not None
            assert inductor.custom_should_partition_ops == named
