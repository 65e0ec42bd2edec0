"""SMMix for ViTs: each image's least attended window of patches replaced by its partner's most attended one,
chosen by the model's own attention on the unmixed batch, and trained with a token head and a consistency
term beside the mixed loss.

Paper: Chen, Lin, Lin, Zhang, Chao, Ji. "SMMix: Self-Motivated Image Mixing for Vision Transformers."
ICCV 2023. https://arxiv.org/abs/2212.12977. Authors' code: github.com/ChenMnZ/SMMix (``smmix.py``,
``SMMix.smmix``; ``engine.py``, ``train_one_epoch``; ``deit.py``, ``VisionTransformer.forward``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import Card
from ..engine.checks import check_fraction, check_non_negative, check_spatial
from ..engine.contract import Deferred, Draw, Mixed, MixState
from ..engine.own_parameters import average_over_ranks, following
from ..engine.regions import RegionMixer
from ..layers import resolve_layer
from ..sites import Leaf
from ..transfer import to_device
from .transmix import ReadsAttention, attention_grid, check_attention, check_class_token

SCORES = ("patches", "class")
HEADS = ("own", "shared")


class SMMix(ReadsAttention, RegionMixer):
    """SMMix (Chen et al. 2023): on a ViT (at the input, or on a block's tokens with ``tokens``), each
    image's least attended ``s x s`` window of patches is replaced by its partner's most attended window
    (taken from wherever it is), the attention read from the model itself on the unmixed batch; the loss
    adds two terms of the method's own to the mixed loss.

    On each training forward that mixes: the model runs once more on the unmixed batch, in eval mode and
    without gradients (the *motivating* forward; :meth:`~mixhook.engine.mixer.Mixer.unmixed_forward`),
    which gives its logits ``p`` and each patch's score from the ``attention`` layer (the authors: the last
    block's): the attention every patch pays it, averaged over heads and query patches (``score="patches"``,
    the authors' ``attn[:, :, 1:, 1:].mean((1, 2))``; ``"class"``: the class token's attention to it, as
    OpenMixup's port reads it). The window side ``s`` is drawn uniformly from ``int(side * min_side)`` to
    ``int(side * max_side)`` (``side``: the patch grid's shorter side; the authors: 0.25 and 0.75 of 14);
    sample ``i``'s window of the least summed score takes, patch for patch, the window of the most summed
    score of its partner ``index[i]``; ``lam = 1 - s^2 / N`` (the patches kept). The loss:

        ``lam * l(y) + (1 - lam) * l(y[index])``
        ``+ fine * (l(head(t_i), y) + l(head(s_i), y[index])) / 2``
        ``+ consistency * KL(softmax(lam * p + (1 - lam) * p[index]) || softmax(logits))``

    ``l`` the criterion given to ``loss`` (the authors': soft-target cross-entropy with smoothing 0.1),
    ``t_i`` and ``s_i`` the mean of ``features``' patch tokens (the final norm's output) over the kept and
    over the pasted patches, ``head`` a Linear of its own (``token_head="own"``: the authors', sized as
    ``classifier``, trained with the model: :meth:`parameters`) or ``classifier`` itself (``"shared"``: the
    authors found no difference). Equal to the authors' lines on the same window side and partners (they
    pair each image with the batch flipped; here ``index`` is drawn, or pinned). Their runs switch with
    plain mixup on half the batches: ``OneOf`` with ``ManifoldMixup("input")``.

    ``.last.info``: ``"side"`` (``s``), ``"target"`` and ``"source"`` (each sample's window's top-left
    patch, ``(B, 2)``: where it was replaced, and where in the partner it came from) and ``"scores"``
    (``(B, N)``). ``targets()`` is refused (the loss is no criterion of mixed targets).

    Args:
        layer: ``"input"`` (the paper: the window moved in pixels, whole patches) or a block with ``tokens``.
        attention: the attention module whose weights score the patches (the paper: the last block's).
        features: the module whose ``(B, T, D)`` output the head reads (the paper: the final norm, timm's
            ``"norm"``); it must run after the mix.
        classifier: the model's classifier, a Linear (timm's ``"head"``): the token head's size, or itself.
        min_side, max_side: the window side's range as fractions of the grid's side, in (0, 1], min <= max.
        score: ``"patches"`` (the authors') or ``"class"`` (OpenMixup's port).
        token_head: ``"own"`` (the authors') or ``"shared"``.
        fine, consistency: the two terms' weights, >= 0 (the authors: 1 and 1).
        prob, generator, batch_dim, padding, tokens, prefix, layout: as :class:`~mixhook.CutMix`.

    ``pin`` also takes ``side`` (``s``).
    """

    card = Card(
        paper="Chen et al. 2023",
        mixes="the partner's most attended window over the least attended one",
        where="ViT input or tokens; needs attention (+ an unmixed forward)",
        family="attention",
        traits=("tokens", "attention"),
        signature='SMMix(layer, attention, features, classifier, score="patches", token_head="own")',
        hook="forward, ViT inputs or tokens, + forward hooks on the attention and features layers",
        commands="`mixup=smmix experiment=vit_digits` (the app's ViT recipe)",
        details=(
            "An unmixed eval forward scores each patch by the attention paid to it (the authors': patches' "
            "attention, heads and queries averaged) and gives the logits `p`; each image's least scored "
            "`s×s` window ← its partner's most scored one, `s` ~ U{¼..¾ of the grid side}, lam = kept "
            "patches; loss + `fine`·½(l(head(kept tokens' mean), y) + l(head(pasted tokens' mean), "
            "y[index])) + `consistency`·KL(softmax(lam·p + (1-lam)·p[index]) ‖ softmax(logits)), the head a "
            "Linear of its own (or the classifier); equal to the authors' lines; targets() refused"
        ),
        app=("experiment=vit_digits",),  # (timm's ViT-Tiny on digits with AdamW: the app's ViT recipe)
        shown_on="vit",
        example={"layer": "input", "attention": "blocks.1.attn", "features": "norm", "classifier": "head"},
        drawn={
            "attention": "encoder.layers.encoder_layer_1.self_attention",
            "features": "encoder.ln",
            "classifier": "heads.head",
            "hidden": {"tokens": "auto"},
        },
    )

    pin_keys = ("side",)
    region_dims = (2,)

    dense_targets = (
        "moves its partner's window to another position: it has no per-position labels for a dense target"
    )

    def __init__(
        self,
        layer: str | Sequence[str],
        attention: str,
        features: str,
        classifier: str,
        min_side: float = 0.25,
        max_side: float = 0.75,
        score: str = "patches",
        token_head: str = "own",
        fine: float = 1.0,
        consistency: float = 1.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        tokens: Sequence[int] | str | None = None,
        prefix: str = "blend",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, 1.0, prob, generator, batch_dim, padding, layout, tokens, prefix)
        for name, value in (("attention", attention), ("features", features), ("classifier", classifier)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be the name of a module, got {value!r}")
        self.min_side, self.max_side = (
            check_fraction("min_side", min_side),
            check_fraction("max_side", max_side),
        )
        if not 0 < self.min_side <= self.max_side:
            raise ValueError(f"min_side and max_side must satisfy 0 < min_side <= max_side <= 1, got "
                             f"{min_side!r} and {max_side!r}")  # fmt: skip
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        if token_head not in HEADS:
            raise ValueError(f"token_head must be one of {', '.join(HEADS)}, got {token_head!r}")
        self._check_patch_sites("it moves windows of a ViT's patches")
        self.attention, self.features, self.classifier = attention, features, classifier
        self.score, self.token_head = score, token_head
        self.fine, self.consistency = (
            check_non_negative("fine", fine),
            check_non_negative("consistency", consistency),
        )
        self.head: nn.Linear | None = None  # the token head (token_head="own": made at attach)
        self._averaging = False
        self._pending: Mapping | None = None  # a state loaded before attach
        self._classifier: nn.Linear | None = None

    def __repr__(self) -> str:
        return (
            f"SMMix(layer={self._layer_spec!r}, attention={self.attention!r}, features={self.features!r}, "
            f"classifier={self.classifier!r}, score={self.score!r}, token_head={self.token_head!r})"
        )

    # ------------------------------------------------------------------------------------- attaching

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        if self._clean:
            raise ValueError(
                "SMMix trains on its mix alone (the authors' loss): clean=True would put the clean batch "
                "beside it, whose rows its token head's and consistency terms do not read; leave clean=False"
            )
        _, attention = resolve_layer(model, self.attention, "attention")
        check_attention("SMMix", self.attention, attention)
        _, features = resolve_layer(model, self.features, "features")
        _, classifier = resolve_layer(model, self.classifier, "classifier")
        if not isinstance(classifier, nn.Linear):
            raise TypeError(
                f"SMMix: classifier={self.classifier!r} is a {type(classifier).__name__}, not the Linear "
                "that gives the logits (timm's 'head', torchvision's 'heads.head')"
            )
        self._classifier = classifier
        super()._register(model, modules, handles)
        handles.append(attention.register_forward_hook(recompute.hook(self._recorder), with_kwargs=True))
        handles.append(features.register_forward_hook(recompute.hook(self._features_hook(model))))

    def attach(self, model: nn.Module):
        """As every mixer's, and then (``token_head="own"``) the token head is made, sized as
        ``classifier`` (the authors' initialisation, from the mixer's seed), on its device and dtype."""
        handle = super().attach(model)
        try:
            if self.token_head == "own":
                c = self._classifier
                if self.head is None or (self.head.in_features, self.head.out_features) != (
                    c.in_features,
                    c.out_features,
                ):
                    self.head = self._make_head(c.in_features, c.out_features)
                following(self.head, c)
                if self._pending is not None:
                    self.head.load_state_dict(self._pending)
                    self._pending = None
                self._average_over_ranks()
        except BaseException:
            handle.remove()
            raise
        return handle

    def _make_head(self, features: int, classes: int) -> nn.Linear:
        """The authors' token head: ``Linear(features, classes)``, weights ``trunc_normal(std=0.02)`` and a
        zero bias, drawn from a generator seeded with the mixer's (the same head in every workflow)."""
        head = nn.Linear(features, classes)
        g = torch.Generator().manual_seed(self.generator.initial_seed())
        with torch.no_grad():
            head.weight.copy_(
                torch.nn.init.trunc_normal_(torch.empty(classes, features), std=0.02, generator=g)
            )
            head.bias.zero_()
        return head

    def _average_over_ranks(self) -> None:
        """Under ``torch.distributed`` (several ranks): the token head's gradients averaged over the ranks,
        as DDP averages the model's (the authors' head is inside their DDP model), while
        :attr:`average_over_ranks`."""
        if not self._averaging:
            self._averaging = average_over_ranks(self.head.parameters(), lambda: self.average_over_ranks)

    def _reset(self) -> None:
        super()._reset()
        self._classifier, self._recording = None, None

    def parameters(self, recurse: bool = True):
        """The token head's parameters (``token_head="own"``), for the optimizer that steps the model;
        refused before ``attach`` (its size is read from ``classifier`` then)."""
        if self.token_head == "shared":
            return iter(())
        if self.head is None:
            raise RuntimeError(
                "SMMix: the token head is made at attach() (sized as the classifier); attach first"
            )
        return self.head.parameters(recurse)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.head is not None:
            state["token_head"] = self.head.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        super().load_state_dict(state)
        if "token_head" in state:
            if self.head is None:
                self._pending = state["token_head"]  # (the head is made at attach: loaded there)
            else:
                self.head.load_state_dict(state["token_head"])

    # ----------------------------------------------------------------------------- the forward

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        check_spatial("SMMix", spec, leaves)

    def before_forward(self, model, args, kwargs, spec: str, pinned: Mapping, targets, generator) -> Mapping:
        """The motivating forward: the model on the unmixed batch, in eval mode without gradients; its
        logits and each patch's score (a recomputation and ``pin_last`` reuse them)."""
        if "motivation" in pinned:
            return {}
        output, weights = self._unmixed_attention(model, args, kwargs)  # weights: (B, T, T), heads averaged
        logits = _logits(output)
        if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
            raise TypeError(
                f"SMMix needs the model's (B, classes) logits from its motivating forward, got "
                f"{type(output).__name__}"
            )
        _, _, prefix = attention_grid(self, model, weights.shape[1])
        if self.score == "patches":  # (the attention paid to each patch, averaged over the query patches)
            scores = weights[:, prefix:, prefix:].mean(1)
        else:  # (the class token's)
            check_class_token(self, model, prefix, "score='class' reads the class token's attention")
            scores = weights[:, 0, prefix:]
        return {"motivation": logits.detach(), "scores": scores}

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        n, (height, width) = h.shape[0], h.shape[2:]
        rows, cols, step = self._grid(draw.layer, height, width)
        scores = draw.pinned["scores"]
        if scores.shape[1] != rows * cols:
            raise ValueError(
                f"SMMix: attention={self.attention!r} scores {scores.shape[1]} patches, the mixed map has "
                f"{rows}x{cols}; mix the patches that layer attends over"
            )
        side = self._side(rows, cols, draw)
        target, source = windows(scores.reshape(n, 1, rows, cols), side)
        partners = to_device(draw.index, h.device)
        source = source[partners]  # (each sample's window comes from its partner's most scored one)
        mixed, pasted = move_windows(h, partners, target, source, side, step)
        lam = 1 - side * side / (rows * cols)
        motivation = draw.pinned["motivation"]
        wanted = lam * motivation + (1 - lam) * motivation[partners]
        info = {"side": side, "target": target, "source": source, "scores": scores.to(torch.float64)}
        inputs = {"pasted": pasted, "motivation": wanted}
        weights = Deferred(own_positions, target, side, step, (height, width))  # (made if read: the gallery)
        return Mixed({path: mixed}, lam=lam, info=info, weights=weights, loss_inputs=inputs)

    def _grid(self, spec: str, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid of the mixed map and the positions a square patch spans (:meth:`_patch_grid`)."""
        rows, cols, step, across = self._patch_grid(spec, height, width)
        if step != across:
            raise ValueError(
                f"SMMix at 'input': the {height}x{width} input is not a grid of square patches on the "
                f"model's {rows}x{cols} patch grid"
            )
        return rows, cols, step

    def _side(self, rows: int, cols: int, draw: Draw) -> int:
        """The window side: pinned, or drawn uniformly from ``int(side * min_side)`` to
        ``int(side * max_side)`` (at least 1), ``side`` the grid's shorter side."""
        short = min(rows, cols)
        low, high = max(1, int(short * self.min_side)), max(1, int(short * self.max_side))
        pinned = draw.pinned.get("side")
        if pinned is not None:
            side = int(pinned)
            if not 1 <= side <= short:
                raise ValueError(
                    f"pinned side {pinned!r} does not fit the {rows}x{cols} patch grid (1..{short})"
                )
            return side
        g = draw.generator
        return low + int(torch.randint(high - low + 1, (), generator=g, device=g.device))

    def _features_hook(self, model: nn.Module):
        def hook(module: nn.Module, args: tuple, output) -> None:
            if not model.training or self.in_gradient_pass or self._recording is not None:
                return
            draw, last = self.current, self.last
            if draw is None or not draw.done or last is None or last.loss_inputs is None:
                return
            if "tokens" not in last.loss_inputs:  # (the first call after the mix: the model's final norm)
                self.last = dataclasses.replace(last, loss_inputs={**last.loss_inputs, "tokens": output})

        return hook

    # ----------------------------------------------------------------------------------- the loss

    def mixed_loss(self, criterion, logits, target, last: MixState, own_terms: bool = True) -> torch.Tensor:
        loss = super().mixed_loss(criterion, logits, target, last, own_terms)
        if not own_terms:
            return loss
        inputs = last.loss_inputs
        tokens = inputs.get("tokens")
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 3:
            what = "did not run" if tokens is None else "gave no (B, T, D) tokens"
            raise RuntimeError(
                f"loss(): SMMix reads the (B, T, D) tokens of features={self.features!r} after the mix, and "
                f"that layer {what}; name the model's final norm"
            )
        pasted = inputs["pasted"].to(tokens.dtype)  # (B, N): 1 where the partner's window went
        patches = tokens[:, tokens.shape[1] - pasted.shape[1] :]
        kept = 1 - pasted
        head = self._classifier if self.head is None else following(self.head, self._classifier)
        own = head((patches * kept[..., None]).sum(1) / kept.sum(1, keepdim=True))
        theirs = head((patches * pasted[..., None]).sum(1) / pasted.sum(1, keepdim=True))
        partners = target[to_device(last.index, target.device)]
        fine = (criterion(own, target) + criterion(theirs, partners)) / 2
        dtype = torch.promote_types(logits.dtype, torch.float32)  # (a bfloat16 forward's KL in float32)
        wanted = F.log_softmax(inputs["motivation"].to(dtype), dim=1)
        consistency = (wanted.exp() * (wanted - F.log_softmax(logits.to(dtype), dim=1))).sum(1)
        consistency = consistency.mean() if loss.ndim == 0 else consistency
        return loss + self.fine * fine + self.consistency * consistency.to(loss.dtype)

    def targets(self, *args, **kwargs):
        """Refused: SMMix's loss is no criterion of mixed targets (its token head's and consistency terms);
        train with :meth:`loss`."""
        raise ValueError(f"targets(): SMMix {self.targets_refused()}; train with its loss()")

    def targets_refused(self) -> str:
        return (
            "trains with a token head's and a consistency term beside the mixed loss, which mixed targets "
            "cannot carry"
        )


def _logits(output):
    """The logits of a model's output: the tensor itself, or its ``"logits"`` (a dict, HuggingFace's
    ``ModelOutput``); else ``None``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("logits")
    return getattr(output, "logits", None)


def windows(scores: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's ``side x side`` window of the least and of the most summed ``scores`` ``(B, 1, R, C)``
    (the first in row-major order on a tie, as ``argmin``/``argmax`` give), as ``(B, 2)`` top-left
    ``(row, column)`` positions; on the scores' device."""
    sums = F.unfold(scores, side, stride=1).sum(1)  # (B, windows): each window's total, row-major
    across = scores.shape[-1] - side + 1
    low, high = sums.argmin(1), sums.argmax(1)
    return torch.stack([low // across, low % across], 1), torch.stack([high // across, high % across], 1)


def own_positions(target: torch.Tensor, side: int, step: int, shape: Sequence[int]) -> torch.Tensor:
    """``(B, H, W)`` bool: each sample's own content, False on its window of ``side x side`` patches (of
    ``step`` positions a side) at ``target``."""
    height, width = shape
    r = torch.arange(height, device=target.device).view(1, -1, 1) // step
    q = torch.arange(width, device=target.device).view(1, 1, -1) // step
    ty, tx = target[:, 0].view(-1, 1, 1), target[:, 1].view(-1, 1, 1)
    return ~((r >= ty) & (r < ty + side) & (q >= tx) & (q < tx + side))


def move_windows(h, index, target, source, side: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``h`` ``(B, C, H, W)`` with each sample's ``side x side`` window of patches (``step`` positions a
    side) at ``target[i]`` replaced by sample ``index[i]``'s window at ``source[i]``, patch for patch, and the
    ``(B, N)`` mask of the replaced patches; gradients flow to both (a gather of patches)."""
    n, c, height, width = h.shape
    rows, cols = height // step, width // step
    patches = h.reshape(n, c, rows, step, cols, step).permute(0, 2, 4, 1, 3, 5).reshape(n * rows * cols, -1)
    r = torch.arange(rows, device=h.device).view(1, rows, 1)
    q = torch.arange(cols, device=h.device).view(1, 1, cols)
    ty, tx = target[:, 0].view(n, 1, 1), target[:, 1].view(n, 1, 1)
    inside = (r >= ty) & (r < ty + side) & (q >= tx) & (q < tx + side)  # (B, rows, cols)
    sy, sx = source[:, 0].view(n, 1, 1), source[:, 1].view(n, 1, 1)
    own = torch.arange(n, device=h.device).view(n, 1, 1) * (rows * cols) + r * cols + q
    theirs = index.view(n, 1, 1) * (rows * cols) + (r - ty + sy) * cols + (q - tx + sx)
    chosen = torch.where(inside, theirs, own).reshape(-1)
    moved = patches[chosen].reshape(n, rows, cols, c, step, step).permute(0, 3, 1, 4, 2, 5)
    return moved.reshape(n, c, height, width), inside.reshape(n, -1)
