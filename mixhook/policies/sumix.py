"""SUMix's loss: the labels of any two-sample mix re-weighted by how much of each class the mixed sample's
prediction holds beside the clean samples', and an uncertainty term, trained with the clean batch beside
the mix.

Paper: Qin, Jin, Zhu, Liao, El-Yacoubi, Gao. "SUMix: Mixup with Semantic and Uncertain Information." ECCV
2024. https://arxiv.org/abs/2407.07805. Authors' code: github.com/JinXins/SUMix
(``openmixup/models/heads/cls_mixup_head.py``: ``ClsUncertainMixupHead``, its ``forward_head`` and
``IN_loss``; ``openmixup/models/classifiers/mixup_classification.py``: the ``is_IN`` clean forward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .. import recompute
from ..engine.checks import check_non_negative
from ..engine.contract import MixState
from ..engine.mixer import Mixer
from ..engine.own_parameters import average_over_ranks, following
from ..engine.policies import Policy, refuse_global_partners, refuse_own_loss
from ..layers import resolve_layer
from ..transfer import to_device

UNCERTAINTIES = ("own", "logits")
REDUCTIONS = ("authors", "per_sample")


class SUMix(Policy):
    """SUMix's loss (Qin et al. 2024) for any mixer of two samples per row: ``mixer.use(SUMix("fc"))``.

    The mixer emits the clean batch beside its mix (``use()`` turns its ``clean`` on, and back when
    SUMix is no longer used; batch norm after the mix normalises the two halves apart: at the input, what
    the authors' two forwards do), and the loss reads both. With
    ``p`` the softmax of the clean logits and ``q`` of the mixed ones (without gradients), ``y`` the
    sample's label and ``y'`` its partner's:

    - the semantic distances ``a = B * l2(softmax(q - p_{y'=0}))`` and ``a' = B * l2(softmax(q -
      p[index]_{y=0}))`` (``p`` with the partner's class zeroed; the partner's with the sample's;
      ``l2`` normalises each row; ``B`` the batch);
    - the label weights ``lam_a ∝ lam * exp(-a)[y]`` and ``lam_b ∝ (1 - lam) * exp(-a')[y']``,
      normalised to sum to one;
    - the uncertainty ``u = l2(softmax(U(f)))`` of the classifier's input ``f`` by a Linear ``U`` of the
      policy's own, sized as the classifier (``uncertainty="own"``: the authors' ``is_norm=True``; or the
      logits themselves, ``"logits"``: their ``is_norm=False``), ``b = u_clean + u_mixed`` and ``b' =
      u_clean[index] + u_mixed``;

    ``loss = lam_a * l(y) + lam_b * l(y') + gamma * (lam * l(exp(-(b + a)), y) + (1 - lam) *
    l(exp(-(b' + a')), y'))``, ``l`` the criterion given to ``loss`` (of the mixed logits in the first two
    terms), the criterion taking ``exp(-(b + a))`` as logits, as the authors' does. With
    ``reduce="authors"`` (default) ``lam_a`` and ``lam_b`` enter by their batch means, as the authors'
    head multiplies its batch-mean cross-entropy by each sample's weight before the mean; ``"per_sample"``
    weighs each sample's loss by its own (the paper's formula). The clean rows' logits enter only through
    ``p`` (no criterion of their own); their gradients come from the uncertainty term. Equal to the
    authors' ``IN_loss`` on the same mix (loss and the gradients of the model and of ``U``, float64); the
    weights are computed as a sigmoid of their log-ratio, the same value where the authors' is finite and
    no NaN where both of its exponentials underflow (a large batch over few classes). A lam per sample
    (Manifold Mixup's ``mode="elem"``, TransMix's) weighs each sample by its own, where the authors' loop
    draws one per batch. Refused in one line: a mixer whose loss has terms of its own, a target or weights
    policy beside it (its loss does not use theirs), a partner batch, and a classifier inside a reentrant
    activation checkpoint (inside a non-reentrant one, the uncertainty's graph keeps what it saves).

    ``U`` is made when its mixer is attached (``Linear(D, C)``, the authors' ``normal(0, 0.01)`` weights
    and zero bias, from the mixer's seed), on the classifier's device and dtype (following it where the
    model is cast later); ``mixer.parameters()`` yields it for the optimizer, its gradients averaged over
    the ranks under ``torch.distributed`` while ``mixer.average_over_ranks`` (the authors' head is inside
    their DDP model), and the mixer's
    ``state_dict()`` keeps it. ``targets()`` is refused (the loss is no criterion of mixed targets).

    Args:
        classifier: the model's classifier, a Linear (``"fc"``, timm's ``"head"``): ``U`` reads its input.
        gamma: the uncertainty term's weight, >= 0 (the authors' ``gama``: 0.5 on CIFAR, 1.0 on Tiny).
        uncertainty: ``"own"`` (the authors' CIFAR configs) or ``"logits"`` (their ImageNet config).
        reduce: ``"authors"`` or ``"per_sample"`` (a per-sample criterion, ``reduction="none"``).
    """

    knob = "loss"
    needs_classes = True
    changes_loss = True
    takes_clean = True
    batch_norm_apart = True  # (the authors' clean forward and mixed forward: two calls of the backbone)
    why_classes = "weighs each label by the predictions' probability of its class"

    def __init__(
        self, classifier: str, gamma: float = 0.5, uncertainty: str = "own", reduce: str = "authors"
    ):
        if not isinstance(classifier, str) or not classifier:
            raise ValueError(
                f"classifier must be the name of the model's Linear classifier, got {classifier!r}"
            )
        if uncertainty not in UNCERTAINTIES:
            raise ValueError(f"uncertainty must be one of {', '.join(UNCERTAINTIES)}, got {uncertainty!r}")
        if reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {', '.join(REDUCTIONS)}, got {reduce!r}")
        self.classifier, self.gamma = classifier, check_non_negative("gamma", gamma)
        self.uncertainty, self.reduce = uncertainty, reduce
        self.layer: nn.Linear | None = None  # U (uncertainty="own"), made at register
        self._like: nn.Linear | None = None  # the classifier U follows
        self._pending: Mapping | None = None  # a state loaded before register
        self._averaging = False

    def __repr__(self) -> str:
        return (
            f"SUMix(classifier={self.classifier!r}, gamma={self.gamma}, uncertainty={self.uncertainty!r}, "
            f"reduce={self.reduce!r})"
        )

    def __getstate__(self) -> dict:  # (a copy of the mixer, EMA or pickling: the model's classifier stays,
        # and the copy's layer averages its gradients over the ranks once attached, as its own)
        return {**self.__dict__, "_like": None, "_averaging": False}

    # ------------------------------------------------------------------------------------- attaching
    def check_mixer(self, mixer: Mixer) -> None:
        refuse_own_loss(self, mixer)
        own = [n for n in ("clean_loss", "mixed_loss") if getattr(type(mixer), n) is not getattr(Mixer, n)]
        if own:  # (its terms would be dropped: SUMix's loss replaces the whole loss)
            raise TypeError(
                f"SUMix's loss replaces the whole loss, and {type(mixer).__name__}'s has terms of its own "
                f"({own[0]}); use SUMix with a mixer whose loss is the mixed criterion (CutMix, "
                "ManifoldMixup, ...)"
            )
        if type(mixer).parameters is not Mixer.parameters:
            raise TypeError(
                f"SUMix trains an uncertainty layer of its own, and {type(mixer).__name__} trains parameters "
                "of its own beside the model: the two are not combined; use a mixer without parameters"
            )
        refuse_global_partners(self, mixer, "reads each partner's clean prediction, which another rank holds")

    def register(self, mixer: Mixer, model: nn.Module, handles: list) -> None:
        if not mixer.clean:
            raise ValueError(
                f"SUMix reads the clean rows beside the mix, and {type(mixer).__name__}.clean is False; "
                "leave it True (use() set it)"
            )
        batch = next((p for p in mixer.policies if p.needs_partner_batch), None)
        if batch is not None:
            raise ValueError(
                f"SUMix reads each partner's clean prediction among the batch's, and {type(batch).__name__} "
                "draws the partners from a second batch; use SUMix with the batch's own partners"
            )
        other = next((p for p in mixer.policies if p.knob in ("target", "weights")), None)
        if other is not None:  # (its loss replaces the mixed criterion they change: they would do nothing)
            raise ValueError(
                f"SUMix weighs the labels itself, and {type(other).__name__} changes the mixed loss's "
                f"{other.knob}, which SUMix's loss does not use; use one of the two"
            )
        _, classifier = resolve_layer(model, self.classifier, "classifier")
        if not isinstance(classifier, nn.Linear):
            raise TypeError(
                f"SUMix: classifier={self.classifier!r} is a {type(classifier).__name__}, not the Linear "
                "that gives the logits ('fc', timm's 'head')"
            )
        if self._like is not None and self._like is not classifier:
            raise ValueError(
                "SUMix is attached through another mixer to another classifier, and its uncertainty layer "
                "is one: give each model's mixer its own SUMix"
            )
        self._like = classifier
        if self.uncertainty == "own":
            shape = (classifier.in_features, classifier.out_features)
            if self.layer is None or (self.layer.in_features, self.layer.out_features) != shape:
                self.layer = _made(*shape, mixer.generator.initial_seed())
            following(
                self.layer, self._like
            )  # (before a state loaded earlier: its values at the classifier's dtype)
            if self._pending is not None:
                self.layer.load_state_dict(self._pending)
                self._pending = None
            if not self._averaging:  # (while the mixer's average_over_ranks says so)
                self._averaging = average_over_ranks(
                    self.layer.parameters(), lambda: mixer.average_over_ranks
                )
        handles.append(classifier.register_forward_hook(self._reader(mixer, model)))

    def reset(self) -> None:
        self._like = None  # (the model's classifier: not kept after remove())

    def parameters(self):
        """U's parameters (``uncertainty="own"``), for the optimizer that steps the model; refused before
        its mixer is attached (U is made then, sized as the classifier)."""
        if self.uncertainty == "logits":
            return iter(())
        if self.layer is None:
            raise RuntimeError(
                "SUMix: the uncertainty layer is made when its mixer is attached (sized as the classifier); "
                "attach first, then give mix.parameters() to the optimizer"
            )
        return self.layer.parameters()

    def state_dict(self) -> dict:
        if self.layer is not None:
            return {"uncertainty": self.layer.state_dict()}
        return {} if self._pending is None else {"uncertainty": self._pending}

    def load_state_dict(self, state: Mapping) -> None:
        if "uncertainty" not in state:
            return
        if self.uncertainty == "logits":
            raise ValueError(
                "SUMix.load_state_dict(): the state holds an uncertainty layer, and this SUMix reads the "
                "logits (uncertainty='logits'); use uncertainty='own' as it was saved"
            )
        if self.layer is None:
            self._pending = state["uncertainty"]  # (U is made at register: loaded there)
        else:
            self.layer.load_state_dict(state["uncertainty"])

    # ----------------------------------------------------------------------------- the forward
    def _reader(self, mixer: Mixer, model: nn.Module):
        """The forward hook on the classifier that, in a training forward after the mix, computes the
        uncertainty of its ``2B`` rows (the clean ones, then the mixed) with gradients, for the loss (the
        mix's ``loss_inputs``: carried by the forward's output, never kept by the mixer). Inside a
        non-reentrant activation checkpoint, what its graph saves is kept as it is (identity saved-tensor
        hooks), so a recomputation of the classifier has nothing of it to redo."""

        def act(module: nn.Module, args: tuple, output) -> None:
            if not model.training:
                return
            draw, last = mixer.current, mixer.last
            if draw is None or not draw.done or last is None or not last.clean:  # (no mix yet, or none)
                return
            inputs = dict(last.loss_inputs or {})
            if "uncertainty" in inputs:  # (a second call of the classifier in the forward)
                return
            with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
                inputs["uncertainty"] = self._uncertainty(args, output)
            mixer.last = dataclasses.replace(last, loss_inputs=inputs)

        return recompute.hook(act)

    def _uncertainty(self, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if self.uncertainty == "logits":
            return output
        return _l2(F.softmax(following(self.layer, self._like)(args[0]), dim=-1))

    # ----------------------------------------------------------------------------------- the loss
    def clean_loss(self, criterion, clean, mixed, target, partner, last: MixState) -> torch.Tensor:
        n = target.shape[0]
        u = (last.loss_inputs or {}).get("uncertainty")
        if not isinstance(u, torch.Tensor) or u.shape[0] != 2 * n:
            raise RuntimeError(
                f"loss(): SUMix reads the input of classifier={self.classifier!r} on the clean and the mixed "
                "rows, and that layer did not run after the mix in this forward; name the model's classifier"
            )
        if clean.ndim != 2:
            raise ValueError(f"loss(): SUMix takes logits (B, C), got {tuple(clean.shape)}")
        if torch.is_grad_enabled() and mixed.requires_grad and not u.requires_grad:
            raise RuntimeError(
                f"loss(): SUMix's uncertainty was computed without gradients while the logits have them: "
                f"classifier={self.classifier!r} runs inside a reentrant activation checkpoint, whose "
                "forward runs without them; checkpoint with use_reentrant=False, or leave the classifier out"
            )
        work = torch.promote_types(clean.dtype, torch.float32)  # (the semantic weights in float32 at least)
        index = to_device(last.index, clean.device)
        lam = to_device(last.lam, clean.device, work)
        lam = lam.view(-1, 1) if lam.ndim else lam
        p = F.softmax(clean.detach().to(work), dim=1)
        q = F.softmax(mixed.detach().to(work), dim=1)
        own = p.scatter(1, partner.view(-1, 1), 0.0)  # (the sample's prediction, its partner's class zeroed)
        theirs = p[index].scatter(1, target.view(-1, 1), 0.0)
        a, a_partner = (_l2(F.softmax(q - s, dim=1)) * n for s in (own, theirs))
        # lam_a = lam e^-a[y] / (lam e^-a[y] + (1 - lam) e^-a'[y']), as a sigmoid of the log-ratio: the same
        # value where the authors' is finite, and no 0/0 where both exponentials underflow (a large batch)
        ratio = torch.log(lam) - torch.log1p(-lam) - a.gather(1, target.view(-1, 1))
        lam_a = torch.sigmoid(ratio + a_partner.gather(1, partner.view(-1, 1))).flatten()
        u_clean, u_mixed = u[:n].to(work), u[n:].to(work)  # (the exponent in float32 at least)
        f_a = torch.exp(-(u_clean + u_mixed + a))
        f_b = torch.exp(-(u_clean[index] + u_mixed + a_partner))
        loss_a, loss_b = criterion(mixed, target), criterion(mixed, partner)
        term_a, term_b = criterion(f_a, target), criterion(f_b, partner)
        per_sample = self.reduce == "per_sample" or lam.ndim
        if per_sample and (loss_a.ndim == 0 or term_a.ndim == 0):
            why = "reduce='per_sample'" if self.reduce == "per_sample" else "lam has one value per sample"
            raise ValueError(
                f"loss(): SUMix with {why} weighs each sample's loss by its own weight, so the criterion "
                f"must return one loss per sample (reduction='none'), but it returned shape "
                f"{tuple(loss_a.shape)}"
            )
        if self.reduce == "authors":
            w_a = lam_a.mean()
        else:
            w_a = lam_a
        w_a = w_a.to(loss_a.dtype)
        lam = lam.flatten().to(term_a.dtype) if lam.ndim else lam.to(term_a.dtype)
        return w_a * loss_a + (1 - w_a) * loss_b + self.gamma * (lam * term_a + (1 - lam) * term_b)


def _kept(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor as it is (neither packed by an activation checkpoint nor recomputed)."""
    return t


def _l2(x: torch.Tensor) -> torch.Tensor:
    """Each row over its L2 norm (the authors' ``l2_norm``)."""
    return x / x.square().sum(1, keepdim=True).sqrt()


def _made(features: int, classes: int, seed: int) -> nn.Linear:
    """The authors' uncertainty layer: ``Linear(features, classes)``, weights ``normal(0, 0.01)`` and a zero
    bias (their head's ``init_weights``), drawn from a generator seeded with the mixer's."""
    layer = nn.Linear(features, classes)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.empty(classes, features).normal_(0, 0.01, generator=g))
        layer.bias.zero_()
    return layer
