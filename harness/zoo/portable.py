"""Portable layer specs over the zoo: what ``stage:k``, ``block:k`` and ``depth:f`` resolve to on each model,
checked against a real forward (and, for a timm plain transformer, against timm's own
``forward_intermediates``), and the Manifold Mixup oracle run at a portable spec against the hand edit at
the real name it resolved to.

``python -m tools.zoo --portable`` runs every model; the suite runs a sample (tests/e2e/test_zoo.py).
"""

from __future__ import annotations

import math
import re

import torch

from mixhook import ManifoldMixup
from mixhook.layers import UnknownLayerError, describe, resolve_layers

from .catalogue import ZooModel
from .oracles import LAM, PERM, ZooRun, _batched, _compare, _mixed_loss, close, leaves


def _one(run: ZooRun, spec: str) -> str:
    found = list(resolve_layers(run.work, [spec]))
    assert len(found) == 1, f"{spec} resolved to {found}"
    return found[0]


def _fits(side: int, size: int, reduction: int) -> bool:
    """A map side at ``reduction`` of an input side: ``size / reduction`` rounded either way, less where
    unpadded convolutions shrink it (Inception) or one more where a model pads to its patch size
    (MobileViT), but neither the next nor the previous reduction's."""
    return math.floor(size / (2 * reduction)) <= side <= math.ceil(size / reduction) + 1 and side > 0


def _has_stage_shape(t: torch.Tensor, entry: ZooModel, reduction: int, channels: int) -> bool:
    """``(B, C, h, w)``, ``(B, h, w, C)`` or tokens ``(B, h*w, C)`` at the stated reduction and channels."""
    (height, width), shape = entry.size, tuple(t.shape[1:])
    if len(shape) == 3:
        for (h, w), c in ((shape[1:], shape[0]), (shape[:2], shape[2])):
            if channels in (None, c) and _fits(h, height, reduction) and _fits(w, width, reduction):
                return True
    if len(shape) == 2 and channels in (None, shape[1]):  # tokens
        low = math.floor(height / (2 * reduction)) * math.floor(width / (2 * reduction))
        return low <= shape[0] <= math.ceil(height / reduction) * math.ceil(width / reduction)
    return False


def check(entry: ZooModel) -> tuple[str, list[str]]:
    """``(what the model states, problems)``; no problem means every spec resolved as checked."""
    run = ZooRun(entry)
    structure = describe(run.work)
    if structure is None:
        return "refused (states nothing)", _refused(run)
    problems = _stages(run, entry, structure) + _blocks(run, structure, "")
    scopes = re.findall(r"(\S+)\.block:k", structure.no_blocks)  # an encoder-decoder: each named apart
    for scope in scopes:
        inner = describe(run.work.get_submodule(scope))
        problems += _blocks(run, inner.prefixed(f"{scope}."), f"{scope}.")
    what = f"{structure.source}: {len(structure.stages)} stages, {len(structure.blocks)} blocks"
    if scopes:
        what += f" ({', '.join(f'{s}.block:k' for s in scopes)})"
    elif not structure.blocks:
        what += f" (refused: {structure.no_blocks})"
    return what, problems


def _refused(run: ZooRun) -> list[str]:
    try:
        resolve_layers(run.work, ["block:0"])
    except UnknownLayerError as err:
        if "\n" in str(err) or "register_layers" not in str(err):
            return [f"the refusal is not one line naming register_layers: {err}"]
        return []
    return ["block:0 resolved on a model that states nothing"]


def _stages(run: ZooRun, entry: ZooModel, structure) -> list[str]:
    problems, n = [], len(structure.stages)
    for k, stage in enumerate(structure.stages):
        for spec in (f"stage:{k}", f"stage:{k - n}"):
            if _one(run, spec) != stage.name:
                problems.append(f"{spec} resolved to {_one(run, spec)}, not {stage.name}")
        if stage.name not in run.outputs:
            problems.append(f"stage:{k} ({stage.name}) did not run")
            continue
        t = next((t for _, t in leaves(run.outputs[stage.name]) if _batched(t)), None)
        stated = stage.reduction is not None and entry.kind == "image"
        if stated and (t is None or not _has_stage_shape(t, entry, stage.reduction, stage.channels)):
            problems.append(
                f"stage:{k} ({stage.name}) returns {None if t is None else tuple(t.shape)}, not reduction "
                f"{stage.reduction}" + (f" with {stage.channels} channels" if stage.channels else "")
            )
    order = list(run.outputs)  # first-call order of every module
    ran = [s.name for s in structure.stages if s.name in run.outputs]
    if ran != sorted(ran, key=order.index):
        problems.append(f"the stages do not run in order: {ran}")
    return problems


def _blocks(run: ZooRun, structure, scope: str) -> list[str]:
    problems, blocks = [], list(structure.blocks)
    for k, block in enumerate(blocks):
        if _one(run, f"{scope}block:{k}") != block or _one(run, f"{scope}block:{k - len(blocks)}") != block:
            problems.append(f"{scope}block:{k} did not resolve to {block}")
    if not blocks:
        return problems
    if _one(run, f"{scope}depth:0") != blocks[0] or _one(run, f"{scope}depth:1") != blocks[-1]:
        problems.append(f"{scope}depth:0 and {scope}depth:1 are not the first and last blocks")
    missing = [b for b in blocks if b not in run.outputs]
    if missing:
        problems.append(f"blocks that did not run: {missing[:3]}")
    order = list(run.outputs)
    ran = [b for b in blocks if b in run.outputs]
    if ran != sorted(ran, key=order.index):
        problems.append(f"the {scope or ''}blocks do not run in the order listed")
    return problems + _timm_intermediates(run, structure) + _oracle_at(run, f"{scope}depth:0.5")


def _timm_intermediates(run: ZooRun, structure) -> list[str]:
    """A timm plain transformer: each block's patch tokens equal ``forward_intermediates``' feature."""
    model = run.work
    if structure.stages or not hasattr(model, "forward_intermediates") or not hasattr(model, "patch_embed"):
        return []
    if not hasattr(model, "num_prefix_tokens") or not hasattr(model.patch_embed, "grid_size"):
        return []
    rows, cols = (int(v) for v in model.patch_embed.grid_size)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            feats = model.forward_intermediates(*run.batch.args, intermediates_only=True)
    finally:
        model.train(was)
    problems = []
    for k, block in enumerate(structure.blocks):
        t = run.outputs[block]
        prefix = t.shape[1] - rows * cols  # (CaiT adds its class token after these blocks)
        tokens = t[:, prefix:].reshape(t.shape[0], rows, cols, -1).permute(0, 3, 1, 2)
        if tokens.shape != feats[k].shape or not close(tokens, feats[k]):
            problems.append(f"block:{k}'s patch tokens are not timm's forward_intermediates feature {k}")
    return problems


def _oracle_at(run: ZooRun, spec: str) -> list[str]:
    """Manifold Mixup at the portable spec against the hand edit at the real name it resolved to."""
    real = _one(run, spec)
    labels = run.batch.labels
    try:
        hand = run.hand(real, lambda t: LAM * t + (1 - LAM) * t[PERM], _mixed_loss(LAM, labels))
        got = run.mixhook(ManifoldMixup(spec), lam=LAM, index=PERM)
        _compare(got, hand, f"{spec} ({real}) against the hand edit")
    except (TypeError, ValueError) as err:
        if "\n" in str(err):
            return [f"{spec}: a refusal of more than one line: {err}"]
    except AssertionError as err:
        return [f"{spec}: {err}"]
    return []
