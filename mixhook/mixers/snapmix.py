"""SnapMix: a box of the partner resized into a box of the sample, each label weighted by the share of its
image's class activation map the mix keeps (so the two weights need not sum to one).

Paper: Huang, Wang, Tao. "SnapMix: Semantically Proportional Mixing for Augmenting Fine-grained Data."
AAAI 2021. https://arxiv.org/abs/2012.04846. Authors' code: github.com/Shaoli-Huang/SnapMix
(``utils/mixmethod.py``: ``get_spm``, ``snapmix``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import Card
from ..engine.checks import check_region, map_size
from ..engine.contract import Draw, Mixed
from ..engine.regions import RegionMixer
from ..functional import gather_rows, sample_lam
from ..geometry import rand_region, region_lam
from ..layers import resolve_layer, trace_outputs
from ..layouts import channels_first, site_layout
from ..sites import Leaf, describe, parse_site
from ..transfer import to_device
from .cutmix import draw_region, pinned_regions

EPS = 1e-8  # the authors' guard in the label weights' denominators


def semantic_percent_map(cam: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The authors' semantic percent map: each ``(h, w)`` class activation map of ``cam`` (``(B, h, w)``)
    resized bilinearly to ``height x width`` (``align_corners=False``), less its minimum, over its sum."""
    spm = F.interpolate(cam[:, None], size=(height, width), mode="bilinear", align_corners=False)[:, 0]
    spm = spm - spm.amin((1, 2), keepdim=True)
    return spm / spm.sum((1, 2), keepdim=True)


def snap_weights(
    spm: torch.Tensor,
    index: torch.Tensor,
    labels: torch.Tensor,
    box: tuple[int, int, int, int],
    partner_box: tuple[int, int, int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two label weights of each sample (the authors' ``lam_a``, ``lam_b``): the share of its own map
    outside ``box`` and the share of its partner's map inside ``partner_box``; a partner of the same
    label adds the two into both; where a map is constant (0/0) the area's weights instead."""
    y1, y2, x1, x2 = box
    p1, p2, q1, q2 = partner_box
    partner = spm[index]
    own = 1 - spm[:, y1:y2, x1:x2].sum((1, 2)) / (spm.sum((1, 2)) + EPS)
    taken = partner[:, p1:p2, q1:q2].sum((1, 2)) / (partner.sum((1, 2)) + EPS)
    same = labels == labels[index]
    own, taken = torch.where(same, own + taken, own), torch.where(same, taken + own, taken)
    area = region_lam(box, spm.shape[1:])
    return torch.nan_to_num(own, nan=area), torch.nan_to_num(taken, nan=1 - area)


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter whole: FSDP2 keeps a sharded module's parameters as shards (``DTensor``) outside its
    forward; ``full_tensor()`` gathers them (every rank calls it, each mixing: SnapMix at prob < 1 under FSDP
    is refused at its unmixed forward)."""
    return t.full_tensor() if t is not None and hasattr(t, "full_tensor") else t


class SnapMix(RegionMixer):
    """SnapMix (Huang et al. 2021) at the input (the paper) or at any layer whose output is a
    ``(B, C, H, W)`` map.

    On each training forward, with probability ``prob``: one layer is drawn from ``layer``, ``lam`` and
    ``lam1 ~ Beta(alpha, alpha)``, a permutation ``index`` and two CutMix boxes, ``box`` of area about
    ``1 - lam`` and ``box1`` of area about ``1 - lam1`` (:func:`~mixhook.geometry.rand_box`, the paper's
    rounding); the partner's ``box1`` region is resized (bilinear, ``align_corners=True``) into each
    sample's ``box``. The labels are weighted by the **semantic percent map** of each unmixed image: its
    class activation map for its own label (the last feature map, ReLU'd, times the classifier's weights
    of that class, plus its bias; resized to the mixed map, less its minimum, over its sum):

        ``lam_a = 1 - SPM_i(box)``,   ``lam_b = SPM_index[i](box1)``

    (a partner of the same label: both ``lam_a + lam_b``; a constant map: the area's weights). So the two
    weights need not sum to one: ``.last.lam`` is ``lam_a`` and ``.last.partner_lam`` ``lam_b``, one per
    sample, and ``loss`` is ``lam_a * criterion(y) + lam_b * criterion(y[index])`` (a per-sample
    criterion, ``reduction="none"``, as the authors train), ``targets`` alike. No mix (both weights 1, 0)
    when either box is empty, as theirs. ``.last.info``: ``"box"``, ``"partner_box"``, ``"area_lam"``.

    **The class activation maps need the unmixed batch's own forward**: one more forward without
    gradients at the start of each training forward that mixes (the authors' ``get_spm``), reading
    ``features``' output; no backward. Batch-norm layers normalise by the batch, as theirs, but their
    running statistics are left untouched (theirs are updated twice a step), and dropout is off (theirs
    runs in training mode; their networks have none before the last map). It needs the labels:
    ``mixer.use_targets(y)`` before each forward (the app's loop does). The map is kept with the draw, so
    activation checkpointing's recomputation and ``pin_last`` reuse it; ``pin(cam=...)`` supplies
    ``(B, h, w)`` maps of your own (no pass then). Reading the ``B`` label weights is one device-to-host
    copy per step.

    Equal to the authors' ``snapmix`` and ``get_spm`` on the same draws and the same network (tested).

    Args:
        layer: where the boxes are cut: ``"input"`` (the paper) or a ``(B, C, H, W)`` layer.
        features: the module whose output is the last ``(B, D, h, w)`` feature map the classifier's
            pooled features come from (``"layer4"`` in a torchvision or timm ResNet); a ``(B, h, w, D)``
            map where the model states that layout (a Swin's last stage, ``"layers.3"`` in timm), read as
            a region method reads a map's (:mod:`mixhook.layouts`).
        classifier: the ``nn.Linear`` over those ``D`` pooled features (``"fc"``).
        alpha: the Beta concentration of both boxes' sizes, > 0 (the authors' ``beta``: 5 in most of
            their experiments).
        prob: the probability that a batch is mixed, in [0, 1] (theirs: 1).
        generator, batch_dim, padding, layout: as :class:`~mixhook.CutMix`.

    ``pin`` also takes ``box`` and ``partner_box`` (``(y1, y2, x1, x2)`` each) and ``cam``.
    """

    card = Card(
        paper="Huang et al. 2021",
        mixes="a resized box; labels weighed by class activation maps",
        where="input, any map (+ an unmixed forward)",
        family="saliency",
        signature="SnapMix(layer, features, classifier, alpha=5.0)",
        hook="forward, `(B,C,H,W)` outputs (+ one forward without gradients per step, on the unmixed batch)",
        commands="`mixup=snapmix`",
        details=(
            "The partner's box (area ≈ `1-lam1`) resized (bilinear) into the sample's box (area ≈ `1-lam`), "
            "lam, lam1 ~ Beta(alpha, alpha); labels weighted by each unmixed image's semantic percent map "
            "`SPM` (its class activation map for its own label from `features`' last map and the `nn.Linear` "
            "`classifier`, less its minimum, over its sum): `lam_a = 1 - SPM_i(box)`, `lam_b = SPM_j(box1)`, "
            "which need not sum to one (`.last.partner_lam`; loss `lam_a·CE(y) + lam_b·CE(y[index])`); equal "
            "to the authors' `snapmix`/`get_spm` on the same draws"
        ),
        example={"layer": "input", "features": "conv2", "classifier": "fc"},
        drawn={"features": "features", "classifier": "head.3"},
    )

    pin_keys = ("box", "partner_box", "cam")

    dense_targets = (
        "weighs each image's labels by its class activation map: it has no per-position labels for a "
        "dense target"
    )

    def __init__(
        self,
        layer: str | Sequence[str],
        features: str,
        classifier: str,
        alpha: float = 5.0,
        prob: float = 1.0,
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
        padding: str = "union",
        layout: str | dict | None = None,
    ):
        super().__init__(layer, alpha, prob, generator, batch_dim, padding, layout)
        for name, value in (("features", features), ("classifier", classifier)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"SnapMix: {name} must name a module of the model, got {value!r}")
        self.features, self.classifier = features, classifier
        self._recording: list | None = None  # while the map pass runs: what `features` output

    def __repr__(self) -> str:
        return (
            f"SnapMix(layer={self._layer_spec!r}, features={self.features!r}, "
            f"classifier={self.classifier!r}, alpha={self.alpha}, prob={self.prob})"
        )

    def use(self, *policies):
        if policies:
            raise ValueError(
                "SnapMix weighs its labels by class activation maps of its own: it takes no policies"
            )
        return super().use()

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        features, feature_module = resolve_layer(model, self.features, "features")
        _, linear = resolve_layer(model, self.classifier, "classifier")
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"SnapMix: classifier={self.classifier!r} is a {type(linear).__name__}; SnapMix needs the "
                "nn.Linear classifier over pooled features (e.g. 'fc') and the map they are pooled from "
                "(features=..., e.g. 'layer4')"
            )
        super()._register(model, modules, handles)
        self._linear = linear
        self._features_layout = site_layout(model, parse_site(features), None)
        self._features_site = features  # (the real name features= resolved to)

        def record(module: nn.Module, args: tuple, output) -> None:
            if self._recording is not None:
                self._recording.append(output)

        handles.append(feature_module.register_forward_hook(recompute.hook(record)))

    def _reset(self) -> None:
        super()._reset()
        self._linear = None  # (the model's classifier: nothing of the model stays after remove())

    def sample_lam(self, n: int, generator: torch.Generator) -> torch.Tensor:
        return sample_lam(self.alpha, generator)

    def check_leaves(self, spec: str, leaves: list[Leaf]) -> None:
        h = check_region("SnapMix", spec, leaves)
        if min(h.shape[2:]) < 2:
            raise ValueError(
                f"SnapMix at {spec!r}: its {map_size(h)} map is too small to ever paste a box; choose an "
                "earlier layer"
            )

    def before_forward(self, model, args, kwargs, spec: str, pinned: Mapping, targets, generator) -> Mapping:
        if targets is None:
            raise RuntimeError(
                "SnapMix weighs the labels by each image's class activation map for its own label: call "
                "use_targets(y) before each training forward (the app's loop does)"
            )
        if "cam" in pinned:
            return {"labels": targets}
        self._recording = []
        try:
            self.unmixed_forward(model, args, kwargs)
            recorded = self._recording
        finally:
            self._recording = None
        if not recorded:
            raise RuntimeError(f"SnapMix: features={self.features!r} did not run in the model's forward")
        fms = self._features_map(recorded[-1])
        linear = self._linear
        labels = to_device(targets, fms.device)
        if labels.dtype.is_floating_point or labels.shape != fms.shape[:1]:
            raise ValueError(
                f"SnapMix needs one class index per sample from use_targets(), got {labels.dtype} "
                f"{tuple(labels.shape)} for a batch of {fms.shape[0]}"
            )
        with torch.no_grad():
            weight, bias = _full(linear.weight), _full(linear.bias)  # (FSDP: gathered, as every rank does)
            weight = weight[labels]  # (B, D): each sample's own class
            bias = 0 if bias is None else bias[labels][:, None, None]
            cam = torch.einsum("bdhw,bd->bhw", F.relu(fms), weight) + bias
        return {"cam": cam, "labels": targets}

    def _features_map(self, fms) -> torch.Tensor:
        """``features``' output as the ``(B, D, h, w)`` map the classifier's ``D`` pooled features come
        from: a channels-last ``(B, h, w, D)`` map (a Swin stage's) as its channels-first view, its layout
        read as a region method reads a map's (:mod:`mixhook.layouts`: stated by the model, else PyTorch's
        convention, refused where the model works on both); a one-line ``TypeError`` for anything else."""
        d = self._linear.in_features
        if isinstance(fms, torch.Tensor) and fms.ndim == 4:
            fms = channels_first(fms, self._features_layout.of("SnapMix's features", self.features))
            if fms.shape[1] == d:
                return fms
        raise TypeError(
            f"SnapMix: features={self.features!r} outputs {describe(fms)}, but SnapMix needs the "
            f"(B, D, h, w) map (or, where the model states it, (B, h, w, D)) whose pooled D = {d} "
            f"features classifier {self.classifier!r} takes"
        )

    def check_output(self, spec: str, value, batch: int | None = None, model_input=None) -> None:
        """:meth:`~mixhook.engine.mixer.Mixer.check_output`, and, given the model's input, that
        ``features`` outputs the map the classifier pools (one more forward in eval mode: the app's
        check before training)."""
        super().check_output(spec, value, batch, model_input)
        if model_input is not None and self._model is not None:
            outputs = trace_outputs(self._model, [self._features_site], model_input)
            if self._features_site in outputs:
                self._features_map(outputs[self._features_site])

    def mix(self, leaves: list[Leaf], draw: Draw) -> Mixed:
        h, path = leaves[0].tensor, leaves[0].path
        if draw.lam.ndim:
            raise ValueError("SnapMix cuts one box per batch: pin one lam")
        height, width = h.shape[2:]
        box = draw_region(draw, (height, width))
        partner_box = draw.pinned.get("partner_box")
        if partner_box is None:
            lam1 = float(sample_lam(self.alpha, draw.generator))
            partner_box = rand_region((height, width), lam1, draw.generator)
        else:
            pinned = pinned_regions("SnapMix", partner_box, 1, (height, width), draw.layer)
            partner_box = tuple(pinned[0].tolist())
        area = region_lam(box, (height, width))
        info = {"box": box, "partner_box": partner_box, "area_lam": torch.tensor(area, dtype=torch.float64)}
        y1, y2, x1, x2 = box
        p1, p2, q1, q2 = partner_box
        if (y2 - y1) * (x2 - x1) == 0 or (p2 - p1) * (q2 - q1) == 0:  # as the authors: no mix
            one = torch.ones(h.shape[0], dtype=torch.float64)
            return Mixed({path: h}, lam=one, info=info, partner_lam=torch.zeros_like(one))
        index = to_device(draw.index, h.device)
        cam = draw.pinned.get("cam")
        if cam is None:
            raise RuntimeError("SnapMix: no class activation map for this mix (pin cam=..., or attach it)")
        cam = torch.as_tensor(cam).detach()
        if cam.ndim != 3 or cam.shape[0] != h.shape[0]:
            raise ValueError(
                f"SnapMix: cam of shape {tuple(cam.shape)} does not fit the batch of {h.shape[0]}; it must "
                f"be ({h.shape[0]}, h, w)"
            )
        content = gather_rows(h, index)[:, :, p1:p2, q1:q2]
        content = F.interpolate(content, size=(y2 - y1, x2 - x1), mode="bilinear", align_corners=True)
        mixed = h.clone()
        mixed[:, :, y1:y2, x1:x2] = content
        spm = semantic_percent_map(to_device(cam, h.device, torch.float64), height, width)
        labels = to_device(torch.as_tensor(draw.pinned["labels"]), h.device)
        own, taken = snap_weights(spm, index, labels, box, partner_box)
        return Mixed({path: mixed}, lam=own.cpu(), info=info, partner_lam=taken.cpu())
