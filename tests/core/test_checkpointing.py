"""Activation checkpointing is exact: a recomputed forward re-applies the same mix, noise and scaling, and
probes record once per step. Every form (torch.utils.checkpoint in both modes, checkpoint_sequential, timm's
set_grad_checkpointing, HuggingFace's gradient_checkpointing_enable) gives the gradients of the same model
without checkpointing, in float64, for every kind of hook; what cannot be made exact is refused."""

import copy
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from mixhook import (
    ActivationStats,
    CutMix,
    GradScale,
    GradStats,
    InputScale,
    ManifoldMixup,
    NoisyFeatureMixup,
    PatchUp,
    recompute,
)
from mixhook.recompute import RecomputeError
from tests.helpers import Lazy, grads, hook_count
from tests.helpers import exact as helpers_exact

timm = Lazy("timm")  # imported when a test first uses it, not at collection
transformers = Lazy("transformers")


@pytest.fixture
def replays(monkeypatch):
    """Counts the replays during backward, to show that a test's recomputation went through them."""
    calls = []
    original = recompute.Tracker.replay

    def counted(self, hook, spec, what, lenient=False):
        payload = original(self, hook, spec, what, lenient)
        calls.append((type(hook).__name__, spec, payload is not None))
        return payload

    monkeypatch.setattr(recompute.Tracker, "replay", counted)
    return calls


exact = partial(helpers_exact, rtol=1e-10, atol=1e-12)  # (this file's tolerance)


def gen(seed=3):
    return torch.Generator().manual_seed(seed)


class Blocks(nn.Module):
    """stem -> a -> b -> head, with a and b optionally checkpointed (mode: None, "reentrant", "non")."""

    def __init__(self, mode=None):
        super().__init__()
        self.mode = mode
        self.stem = nn.Linear(6, 6)
        self.a = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.2))
        self.b = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.stem(x)
        for block in (self.a, self.b):
            h = (
                block(h)
                if self.mode is None
                else checkpoint(block, h, use_reentrant=self.mode == "reentrant")
            )
        return self.head(h)


class Sequential(nn.Module):
    """The same through checkpoint_sequential over [stem, a, b] in two segments."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Tanh())
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if self.reentrant is None:
            return self.head(self.body(x))
        return self.head(checkpoint_sequential(self.body, 2, x, use_reentrant=self.reentrant))


HOOKS = {
    "manifold": lambda layer: ManifoldMixup(layer, generator=gen()),
    "nfm": lambda layer: NoisyFeatureMixup(layer, generator=gen()),
    "input_scale": lambda layer: InputScale(layer, factor=(0.5, 1.5), generator=gen()),
    "grad_scale": lambda layer: GradScale(layer, factor=-0.3),
}


def run(model, hooks, x, steps=2):
    """Two training steps (forward, backward); returns logits, gradients and the hooks' records."""
    torch.manual_seed(11)  # dropout: the same global stream for both models
    with_stats = [ActivationStats(layer) for layer in ("a.0", "b")] if hasattr(model, "a") else []
    handles = [h.attach(model) for h in (*hooks, *with_stats)]
    outs, gs = [], []
    for _ in range(steps):
        model.zero_grad()
        y = model(x)
        y.pow(2).sum().backward()
        outs.append(y.detach())
        gs.append(grads(model))
    for handle in handles:
        handle.remove()
    assert hook_count(model) == 0
    return outs, gs, [s.rows() for s in with_stats]


@pytest.mark.parametrize("mode", ["reentrant", "non"])
@pytest.mark.parametrize("kind", sorted(HOOKS))
def test_torch_checkpoint_gives_the_gradients_of_the_model_without_it(mode, kind, replays):
    torch.manual_seed(0)
    plain = Blocks().double().train()
    ckpt = copy.deepcopy(plain)
    ckpt.mode = mode
    x = torch.randn(5, 6, dtype=torch.double)
    layer = "a.0" if kind != "input_scale" else "b.0"
    ref = run(plain, [HOOKS[kind](layer)], x)
    got = run(ckpt, [HOOKS[kind](layer)], x)
    for a, b in zip(ref[0], got[0], strict=True):
        exact(b, a)
    for ga, gb in zip(ref[1], got[1], strict=True):
        assert ga.keys() == gb.keys()
        for name in ga:
            exact(gb[name], ga[name])
    assert ref[2] == got[2] and len(got[2][0]) == 2  # probes: one row per step, the same values
    if kind != "grad_scale":  # (deterministic: re-applied without a record)
        assert sum(drew for _, _, drew in replays) == 2  # one replay per step


def test_without_the_replay_the_recomputation_would_differ():
    """The test above can fail: a hook that draws anew in the recomputation gives other gradients."""
    torch.manual_seed(0)
    plain = Blocks().double().train()
    ckpt = copy.deepcopy(plain)
    ckpt.mode = "reentrant"
    x = torch.randn(5, 6, dtype=torch.double)
    redraw = {}

    def naive(module, args, output):  # what a hook that ignores recomputation does
        g = redraw.setdefault(torch.is_grad_enabled(), torch.Generator().manual_seed(len(redraw)))
        return output * (0.5 + torch.rand(output.shape, generator=g, dtype=output.dtype))

    results = []
    for model in (plain, ckpt):
        redraw.clear()
        handle = model.a[0].register_forward_hook(naive)
        model(x).sum().backward()
        handle.remove()
        results.append(grads(model))
    assert not torch.allclose(results[0]["stem.weight"], results[1]["stem.weight"])


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_sequential_with_a_mix_and_scaling(reentrant):
    torch.manual_seed(0)
    plain = Sequential(None).double().train()
    ckpt = copy.deepcopy(plain)
    ckpt.reentrant = reentrant
    x = torch.randn(4, 6, dtype=torch.double, requires_grad=True)
    results = []
    for model in (plain, ckpt):
        hooks = [
            NoisyFeatureMixup("body.1.0", generator=gen()),
            InputScale("body.2", (0.5, 2.0), generator=gen(5)),
        ]
        stats = GradStats("body.1")
        results.append(run(model, [*hooks, stats], x))
        results[-1] += (stats.rows(),)
    (out_a, g_a, _, rows_a), (out_b, g_b, _, rows_b) = results
    for a, b in zip(
        out_a + [g["head.weight"] for g in g_a], out_b + [g["head.weight"] for g in g_b], strict=True
    ):
        exact(b, a)
    for name in g_a[-1]:
        exact(g_b[-1][name], g_a[-1][name])
    assert [r["step"] for r in rows_b] == [1, 2]  # once per step, under recomputation too
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-9)


def test_two_forwards_before_one_backward_each_replay_their_own_mix():
    torch.manual_seed(0)
    plain = Blocks().double().train()
    ckpt = copy.deepcopy(plain)
    ckpt.mode = "non"
    x1, x2 = torch.randn(4, 6, dtype=torch.double), torch.randn(4, 6, dtype=torch.double)
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(1)
        with ManifoldMixup("a.0", generator=gen()).attach(model):
            (model(x1).sum() + model(x2).pow(2).sum()).backward()
        results.append(grads(model))
    for name in results[0]:
        exact(results[1][name], results[0][name])


@pytest.mark.parametrize("cls", [CutMix, PatchUp])
def test_region_mixers_replay_their_box_and_mask(cls):
    class Conv(nn.Module):
        def __init__(self, mode):
            super().__init__()
            self.mode, self.stem, self.block = (
                mode,
                nn.Conv2d(2, 3, 3, padding=1),
                nn.Conv2d(3, 3, 3, padding=1),
            )
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            h = self.stem(x)
            h = checkpoint(self.block, h, use_reentrant=self.mode) if self.mode is not None else self.block(h)
            return self.head(h.mean((2, 3)))

    torch.manual_seed(0)
    x = torch.randn(3, 2, 8, 8, dtype=torch.double)
    results = []
    for mode in (None, True, False):
        model = Conv(mode).double().train()
        torch.manual_seed(0)
        model.load_state_dict(Conv(None).double().state_dict())
        options = {"block_size": 3} if cls is PatchUp else {}
        with cls("block", generator=gen(), **options).attach(model):
            model(x).sum().backward()
        results.append(grads(model))
    for other in results[1:]:
        for name in results[0]:
            exact(other[name], results[0][name])


def test_the_whole_hooked_model_inside_a_checkpoint():
    torch.manual_seed(0)
    inner = Blocks().double().train()
    x = torch.randn(4, 6, dtype=torch.double)
    reference = copy.deepcopy(inner)
    torch.manual_seed(1)  # dropout
    with ManifoldMixup("input", generator=gen()).attach(reference):
        reference(x).sum().backward()
    torch.manual_seed(1)
    with ManifoldMixup("input", generator=gen()).attach(inner):  # non-reentrant: replayed exactly
        checkpoint(inner, x, use_reentrant=False).sum().backward()
    for name, g in grads(reference).items():
        exact(grads(inner)[name], g)
    with ManifoldMixup("a.0", generator=gen()).attach(inner):  # reentrant: its graph is made after
        with pytest.raises(
            RecomputeError, match=r"cannot find the forward it recomputes.*use_reentrant=False"
        ):
            checkpoint(inner, x.requires_grad_(True), use_reentrant=True).sum().backward()


def test_a_layer_that_runs_twice_inside_a_recomputed_region_is_refused():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.shared, self.head = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(
                checkpoint(lambda h: self.shared(self.shared(h)), self.stem(x), use_reentrant=False)
            )

    model = Twice().train()
    with ManifoldMixup("shared").attach(model):
        with pytest.raises(RecomputeError, match="runs 2 times per forward"):
            model(torch.randn(2, 3)).sum().backward()


def test_timm_vit_with_grad_checkpointing(replays):
    torch.manual_seed(0)
    options = dict(img_size=16, patch_size=8, embed_dim=16, depth=3, num_heads=2, num_classes=3)
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, **options).double().train()
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    x = torch.randn(3, 3, 16, 16, dtype=torch.double)
    results = []
    for model in (plain, ckpt):
        hooks = [
            NoisyFeatureMixup("blocks.1", generator=gen()),
            InputScale("blocks.2.mlp", (0.5, 1.5), generator=gen(2)),
        ]
        results.append(run(model, hooks, x, steps=1))
    for name, g in results[0][1][0].items():
        exact(results[1][1][0][name], g)
    assert ("NoisyFeatureMixup", "blocks.1", True) in replays and (
        "InputScale",
        "blocks.2.mlp",
        True,
    ) in replays


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [True, False])
def test_huggingface_gradient_checkpointing(reentrant, replays):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, attn_implementation="eager",
    )  # fmt: skip
    plain = transformers.BertForSequenceClassification(config).double().train()
    ckpt = copy.deepcopy(plain)
    enable = getattr(ckpt, "activation_checkpointing_enable", None)  # transformers >= 5 renames it
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    else:
        ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(1, 40, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(5)  # dropout
        hooks = [
            ManifoldMixup("bert.encoder.layer.1.attention", generator=gen()),  # inside the recomputed block
            GradScale("bert.encoder.layer.2.attention", -0.5),
            InputScale("bert.encoder.layer.2.output", (0.5, 1.5), generator=gen(4)),
        ]
        stats = ActivationStats("bert.encoder.layer.1.output")
        handles = [h.attach(model) for h in (*hooks, stats)]
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits.pow(2).sum().backward()
        for handle in handles:
            handle.remove()
        results.append((logits, grads(model), stats.rows()))
    exact(results[1][0], results[0][0])
    for name, g in results[0][1].items():
        exact(results[1][1][name], g)
    assert len(results[1][2]) == 1 and results[1][2][0]["mean"] == pytest.approx(results[0][2][0]["mean"])
    assert ("ManifoldMixup", "bert.encoder.layer.1.attention", True) in replays


@pytest.mark.parametrize("mode", ["reentrant", "non"])
def test_input_scale_alone_replays_in_its_first_step(mode):
    """With no other hook on the model, PyTorch calls the model's forward without reading its hooks (there
    were none when it was called): the tracker's hook is there from the attach, so the first forward's
    factors are found at the recomputation (they were not: RecomputeError)."""
    torch.manual_seed(0)
    plain = Blocks().double().train()
    ckpt = copy.deepcopy(plain)
    ckpt.mode = mode
    x = torch.randn(5, 6, dtype=torch.double)
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(11)
        scale = InputScale("b.0", factor=(0.5, 1.5), generator=gen())
        with scale.attach(model):
            y = model(x)
            y.pow(2).sum().backward()
        results.append((y, grads(model)))
        assert hook_count(model) == 0
    exact(results[1][0], results[0][0])
    for name, g in results[0][1].items():
        exact(results[1][1][name], g)


def test_eval_forwards_note_nothing_and_an_eval_recomputation_replays_nothing():
    """No-grad eval forwards leave nothing behind (no hooks registered, no record); an eval forward with
    gradients under activation checkpointing (input gradients of an eval model) recomputes unmixed."""
    torch.manual_seed(0)
    model = Blocks("non").double()
    x = torch.randn(5, 6, dtype=torch.double, requires_grad=True)
    mix = ManifoldMixup("a.0", generator=gen())
    with mix.attach(model):
        count = hook_count(model)
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                model(x)
        assert hook_count(model) == count and mix._tracker.record is None
        out = model(x)
        out.sum().backward()
        plain = copy.deepcopy(model)
        mix_free = x.detach().clone().requires_grad_()
    plain.mode = None
    plain(mix_free).sum().backward()
    exact(x.grad, mix_free.grad)
