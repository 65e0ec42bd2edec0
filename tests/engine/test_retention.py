"""Nothing outlives its step (issue 81), for every carded method and every policy (the matrix's methods, from
the cards: a new method is covered without editing this file), and for the noise hooks.

Between steps a mixer keeps what its API promises: ``.last`` and the record ``pin_last`` repeats (both of
the last training forward, dropped when the next one begins: benchmarks/kept.py's ``RECORDS``), its
generator and its learned state. The checks, after steps of the matrix's hand loop (forward, ``loss()``,
backward, SGD): no tensor reachable from the mixer carries a ``grad_fn``; what it keeps beside the records
neither grows with the steps nor with the batch; the live tensors of the process do not grow from one step
to a later one; after ``remove()`` the model, each of its modules, the last step's logits and an activation
are freed, and the mixer keeps no graph and no record for ``pin_last``. Each check is shown able to fail.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from benchmarks.kept import RECORDS, kept
from harness.language_models import tiny_llama
from harness.matrix.cells import hand_setup
from harness.matrix.methods import METHODS, Method, criterion, model
from mixhook import ManifoldMixup, NEFTune, NoiseFiT
from mixhook.copies import own
from mixhook.engine.contract import Mixed

BATCH = 8
# the steps before the first count (what a method plans once per site or per grid it draws is made by then)
# and the steps after it
WARM, MORE = 10, 40


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


class _Run:
    """The matrix's hand loop for one method: steps of ``batch`` samples, what the last step made held
    weakly (its logits, the first layer's output)."""

    def __init__(self, method: Method, batch: int = BATCH):
        self.net = model(method.kind)
        self.x, self.y, self.mixer, self.stream = hand_setup(method, n=batch)
        self.loss_of, self.refs = criterion(method.kind), {}
        first = next(m for name, m in self.net.named_modules() if name and not list(m.children()))
        own(first.register_forward_hook(self._activation))  # (a copy of the model drops it: AutoMix's)
        self.handle = self.mixer.attach(self.net)
        self.opt = torch.optim.SGD([*self.net.parameters(), *self.mixer.parameters()], lr=0.01)

    def _activation(self, module, args, output) -> None:
        if isinstance(output, torch.Tensor):
            self.refs["activation"] = weakref.ref(output)

    def steps(self, n: int) -> _Run:
        for _ in range(n):
            self.mixer.use_targets(self.y)
            if self.stream is not None:
                self.mixer.use_partners(*self.stream.like(self.x, 0, 0))
            logits = self.net(self.x)
            self.refs["logits"] = weakref.ref(logits)
            self.mixer.loss(self.loss_of, logits, self.y).mean().backward()
            self.opt.step()
            self.opt.zero_grad()
        return self

    def kept(self):
        return kept(self.mixer, self.net.modules())


def problems(method: Method) -> list[str]:
    """What ``method`` keeps that it should not (one line each; empty: nothing)."""
    out = []
    run = _Run(method).steps(WARM)
    early = run.kept()
    out += [f"after a step, a tensor with a grad_fn: {path}" for path in early.graph]
    # every object alive now set aside (gc.freeze): gc.get_objects() then lists only what is made after,
    # without a scan of the whole process before and after (which took most of this test's time)
    gc.collect()
    gc.freeze()
    try:
        later = run.steps(MORE).kept()
        if later.total(records=False) != early.total(records=False):
            out.append(
                f"keeps more with more steps: {early.bytes} after {WARM}, {later.bytes} after {WARM + MORE}"
            )
        # the tensors made in those steps and alive after them, beside what the mixer records of the last
        # one (counted as made and still alive, not as a total: other tests' tensors may die meanwhile)
        new = [t for t in _live_tensors() if id(t) not in later.records]
    finally:
        gc.unfreeze()
    if new:
        shapes = ", ".join(str(tuple(t.shape)) for t in new[:4])
        out.append(f"{len(new)} more live tensors after {MORE} more steps (beside the records): {shapes}")
    del new
    wider = _Run(method, 2 * BATCH).steps(3).kept()
    if wider.total(records=False) != early.total(records=False):
        out.append(f"keeps more with a larger batch: {early.bytes} at {BATCH}, {wider.bytes} at {2 * BATCH}")
    mixer, refs = run.mixer, {**run.refs, **{f"module {n or 'model'}": weakref.ref(m) for n, m in
                                              run.net.named_modules()}}  # fmt: skip
    run.handle.remove()
    del run
    gc.collect()
    out += [f"after remove(), {name} is alive" for name, ref in refs.items() if ref() is not None]
    after = kept(mixer)
    out += [f"after remove(), a tensor with a grad_fn: {path}" for path in after.graph]
    out += [
        f"after remove(), {name} keeps {n} bytes" for name, n in after.bytes.items() if name == RECORDS[1]
    ]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_a_mixer_keeps_nothing_of_a_step_beyond_its_records_and_nothing_of_the_model_after_remove(method):
    found = problems(method)
    assert not found, "\n".join(found)


class _KeepsTheMap(ManifoldMixup):
    """Manifold Mixup that keeps the map it mixed (a mutant)."""

    def mix(self, leaves, draw):
        self.seen = leaves[0].tensor
        return super().mix(leaves, draw)


class _RecordsTheMixedMap(ManifoldMixup):
    """Manifold Mixup that records its mixed map, graph and all, in ``.last.info`` (a mutant)."""

    def mix(self, leaves, draw):
        mixed = super().mix(leaves, draw)
        return Mixed(mixed.tensors, mixed.lam, {"mixed": mixed.tensors[leaves[0].path]})


class _KeepsEveryLam(ManifoldMixup):
    """Manifold Mixup that keeps every forward's lam (a mutant: a history)."""

    def mix(self, leaves, draw):
        self.history = [*getattr(self, "history", []), draw.lam.clone()]
        return super().mix(leaves, draw)


_LEAKED: list = []


class _LeaksATensorEachStep(ManifoldMixup):
    """Manifold Mixup that leaves a tensor of each step alive outside itself (a mutant: a leak only the
    process's live tensors show)."""

    def mix(self, leaves, draw):
        _LEAKED.append(torch.zeros(3))
        return super().mix(leaves, draw)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (_KeepsTheMap, "after remove(), activation is alive"),
        (_RecordsTheMixedMap, "after a step, a tensor with a grad_fn: ._path.last"),
        (_KeepsEveryLam, "keeps more with more steps"),
        (_LeaksATensorEachStep, f"{MORE} more live tensors after {MORE} more steps"),
    ],
)
def test_the_checks_fail_a_kept_map_a_kept_graph_and_a_history(kind, expected):
    def make(prefix: str):
        return kind("conv1", alpha=1.0, generator=torch.Generator().manual_seed(5))

    found = problems(Method(kind.__name__, make))
    assert any(line.startswith(expected) for line in found), found


def test_the_noise_hooks_keep_no_mask_and_nothing_of_the_model_after_remove():
    """NEFTune drops the call's attention mask when the model's forward ends (it kept it until the next
    call); NoiseFiT keeps its per-block scales; after remove() neither holds the model."""
    for hook in (NEFTune(alpha=5.0), NoiseFiT("model.layers.0")):
        model_ = tiny_llama().train()
        ids = torch.randint(0, 64, (2, 6))
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, 4:] = 0
        handle = hook.attach(model_)
        if isinstance(hook, NoiseFiT):
            loss = hook.loss(model_, {"input_ids": ids, "attention_mask": mask, "labels": ids})[0]
        else:
            out = model_(input_ids=ids, attention_mask=mask)
            loss = F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())
        loss.backward()
        found = kept(hook, model_.modules())
        assert not found.graph
        assert all(ident != id(mask) for _, ident in found.tensors), "the call's attention mask is kept"
        refs = [weakref.ref(m) for m in model_.modules()]
        handle.remove()
        del model_, loss
        gc.collect()
        assert all(ref() is None for ref in refs), type(hook).__name__
