"""NoiseFiT: adaptive Gaussian noise on the outputs of the transformer blocks with the highest (or lowest)
signal-to-noise ratio, and a loss over one clean and two noisy forwards.

Paper: Khadangi, Sartipi, Tchappi, Bahmani, Fridgen. "Noise-Augmented Fine-Tuning for Mitigating
Hallucinations in Large Language Models." 2025. https://arxiv.org/abs/2504.03302. The code:
akhadangi/NoiseFiT, ``NoiseFiT.py`` (``adaptive_noise_injection``, ``NoiseFitTrainer.select_layers``,
``noise_hook`` and ``compute_loss``), which this module equals on the same draws (tests/lm/test_noisefit.py;
their noise's scale passes through a float32 tensor, so in float64 to float32's precision).

Three parts, each usable alone:

- :func:`adaptive_noise`: the noise of one hidden state, scaled per token and feature by robust statistics
  (the median and the median absolute deviation over the features, an exponential weight of each
  feature's distance from the median, and ``exp`` of the token's variance over the batch's mean variance,
  clamped at 5);
- :func:`choose_layers`: the blocks to noise, by the ratio of each block's mean absolute hidden state to the
  mean absolute change that noise makes to it (over ``passes`` draws), the ``k`` largest or smallest;
- :class:`NoiseFiT`: the hook that noises those blocks' outputs in the forwards it is asked to (``with
  nf.noisy(): ...``), and :meth:`NoiseFiT.loss`, the authors' training loss: ``hybrid_alpha * CE + (1 -
  hybrid_alpha) * KL(softmax(clean / T) || noisy)`` averaged over two noisy forwards, plus ``consistency *
  KL(noisy_2 || noisy_1)``, both over the positions whose label is not ``-100``.

What differs from the authors' code, where it matters: the noise is drawn from the hook's own generator on
the hidden state's device (theirs: the global generator), and the scale of each forward's noise is a
device tensor: their hook reads ``hidden_states.std().item()`` in every noisy forward of every noised block
(a host sync each: six per training step with three blocks, each waiting for the GPU to finish the forward
so far), where this one reads nothing on the host. Kept as theirs, on purpose: the hook's noise scale is
``noise_std ** 2 * std(h)`` (their ``noise_hook`` multiplies by ``noise_std`` twice) while the layer choice
measures ``noise_std * std(h)``; the loss's mask is the labels' positions unshifted (the logits at position
``t`` predict token ``t + 1`` but are weighed by whether label ``t`` is ``-100``); the clean logits that are
the soft targets are not detached. A block's output is found as mixhook finds a batch's leaves, so a
decoder layer that returns a tensor (transformers 5) or a tuple (transformers 4) is noised alike; theirs
indexes ``output[0]``, which on a tensor is the first sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import recompute
from ..engine.card import HookCard
from ..engine.checks import check_fraction, check_non_negative, check_positive
from ..functional import generator_on
from ..hooks import LayerHook
from ..layers import portable_names
from .protocol import LossState
from .tokens import IGNORE, next_token_losses, predicted_tokens, put_back, sequence_of

EPSILON = 1e-6  # the authors' EPSILON
SNR = ("largest", "lowest")
MEANS = ("batch", "step")


def adaptive_noise(
    h: torch.Tensor, base_std: float | torch.Tensor, generator: torch.Generator, beta: float = 0.1
) -> torch.Tensor:
    """``h`` (``(..., H)``: tokens by features) plus NoiseFiT's adaptive noise (the authors'
    ``adaptive_noise_injection`` without logits, gate 1): ``N(0, 1) * base_std * mad * weight * factor``
    with ``mad`` the median absolute deviation of each token's features (at least ``1e-6`` of its norm),
    ``weight = exp(-beta * |h - median| / (mad + 1e-6))`` and ``factor = min(exp(var / (mean(var) + 1e-6)),
    5)`` of each token's variance over the features. The normal draws come from ``generator`` (on ``h``'s
    device, or one there seeded by it)."""
    variance = h.var(dim=-1, keepdim=True)
    factor = torch.exp(variance / (variance.mean() + EPSILON)).clamp(max=5.0)
    median = h.median(dim=-1, keepdim=True).values
    mad = (h - median).abs().median(dim=-1, keepdim=True).values
    mad = mad.clamp(min=EPSILON * h.norm(dim=-1, keepdim=True))
    weight = torch.exp(-beta * torch.abs(h - median) / (mad + EPSILON))
    if generator.device != h.device:
        generator = generator_on(h.device, generator)
    noise = torch.empty_like(h).normal_(generator=generator)
    return h + noise * (base_std * mad * weight * factor)


def blocks_of(model: nn.Module) -> list[str]:
    """The names of ``model``'s transformer blocks, in order, as the model states them (mixhook's portable
    ``block:k`` names: a HuggingFace decoder's layers, also inside a PEFT model); refused in one line for a
    model that states none."""
    named = sorted(
        (int(spec.split(":")[1]), name)
        for name, specs in portable_names(model).items()
        for spec in specs
        if spec.startswith("block:") and spec.split(":")[1].isdigit()
    )
    if not named:
        raise ValueError(
            f"NoiseFiT: {type(model).__name__} states no transformer blocks (block:k); name the layers "
            "to noise: NoiseFiT([...])"
        )
    return [name for _, name in named]


@torch.no_grad()
def choose_layers(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    k: int = 3,
    snr: str = "largest",
    noise_std: float = 0.1,
    beta: float = 0.1,
    passes: int = 10,
    generator: torch.Generator | None = None,
) -> list[str]:
    """The ``k`` blocks of ``model`` to noise, by signal-to-noise ratio on ``batch`` (the authors'
    ``select_layers``): one forward in eval mode with ``output_hidden_states=True`` gives each block's hidden
    state ``h_i`` (the model's own: a HuggingFace decoder's last one is after its final norm, as theirs is);
    the signal is ``mean(|h_i|)``, the noise the mean of ``mean(|adaptive_noise(h_i) - h_i|)`` over ``passes``
    draws with ``base_std = noise_std * std(h_i)``; the blocks with the ``snr="largest"`` (or ``"lowest"``)
    ratios, largest first, as names of the model's modules. The model's mode is restored after."""
    if snr not in SNR:
        raise ValueError(f"choose_layers: snr must be one of {', '.join(SNR)}, got {snr!r}")
    names = blocks_of(model)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(names):
        raise ValueError(f"choose_layers: k must be an integer in [1, {len(names)}] (the blocks), got {k!r}")
    generator = torch.Generator().manual_seed(torch.initial_seed()) if generator is None else generator
    was_training = model.training
    model.eval()
    try:
        inputs = {key: batch[key] for key in ("input_ids", "attention_mask") if key in batch}
        hidden = model(**inputs, output_hidden_states=True).hidden_states[1:]
    finally:
        model.train(was_training)
    if len(hidden) != len(names):
        raise ValueError(
            f"choose_layers: {type(model).__name__} returned {len(hidden)} hidden states after its "
            f"embeddings for its {len(names)} blocks"
        )
    signal = torch.stack([h.abs().mean() for h in hidden])
    noise = torch.zeros(passes, len(hidden), device=signal.device, dtype=signal.dtype)
    for p in range(passes):
        for i, h in enumerate(hidden):
            noise[p, i] = (adaptive_noise(h, noise_std * h.std(), generator, beta) - h).abs().mean()
    ratio = signal / (noise.mean(0) + EPSILON)
    chosen = torch.topk(ratio, k, largest=snr == "largest").indices.tolist()
    return [names[i] for i in chosen]


class NoiseFiT(LayerHook):
    """NoiseFiT (Khadangi et al. 2025): adaptive Gaussian noise on chosen blocks' outputs, in the noisy
    forwards of a loss over one clean and two noisy forwards (see :mod:`mixhook.lm.noisefit`).

    ``layer`` names the blocks (:func:`choose_layers` picks them by signal-to-noise ratio, as the authors
    do at the start of training). Attached, the hook adds noise only inside ``with nf.noisy():`` and only
    to forwards that train (train mode, gradients on); :meth:`loss` runs the three forwards::

        nf = NoiseFiT(choose_layers(model, batch))
        with nf.attach(model):
            loss, outputs = nf.loss(model, batch)  # batch: input_ids, attention_mask, labels
            loss.backward()

    The noise's scale is ``noise_std ** 2 * std(h)`` per forward and block (the authors' hook; no host
    read), its draws from the hook's generator (``state_dict()`` holds it; an activation-checkpoint
    recomputation adds the same noise again). ``.last``: a :class:`~mixhook.lm.protocol.LossState` after
    each training :meth:`loss`: ``draws``, each noised block's scale in its last noisy forward, by name;
    ``terms``, the cross-entropy (``"ce"``), the soft-target KL (``"soft"``) and the consistency KL
    (``"consistency"``), detached; ``tokens``, the batch's labelled tokens.

    Its means are the authors' by default: each batch's own (``mean="batch"``; under gradient
    accumulation the Trainer then averages the micro-batches' losses, so a short micro-batch's tokens weigh
    more). ``mean="step"`` asks its Trainer mixin for the step's token means instead (``counts``: each
    micro-batch's :meth:`counts` added over the step's micro-batches and processes, as SFTMix's and the
    Trainer's own causal LM loss count ``num_items_in_batch``); the cross-entropy is then the next-token
    loss of the clean logits summed over the labelled tokens (a causal model's: the model's own ``loss``
    is a mean and cannot be re-divided).

    Args:
        layer: the blocks to noise (names or specs, one or a list).
        noise_std: the authors' ``noise_std`` (0.1).
        beta: the weight's sensitivity (``DEFAULT_BETA``, 0.1).
        temperature: of the soft targets (1.0).
        hybrid_alpha: the cross-entropy's share of the hybrid loss (0.5).
        consistency: the consistency term's weight (``lambda_consistency``, 0.1).
        mean: ``"batch"`` (the authors') or ``"step"`` (see above).
        generator: as :class:`~mixhook.ManifoldMixup`.
        batch_dim: where mixhook cannot find the batch dimension itself.
    """

    card = HookCard(
        signature="NoiseFiT(layer, noise_std=0.1)",
        hook=(
            "forward hooks on transformer blocks (chosen by signal-to-noise ratio: `choose_layers`), in two "
            "extra forwards (`nf.loss`)"
        ),
        formula=(
            "`h' = h + N(0,1)·noise_std²·std(h)·mad·weight·factor` per token and feature; loss `α·CE + "
            "(1-α)·KL(clean‖noisy) + λ·KL(noisy₂‖noisy₁)`, the authors' on the same draws"
        ),
        paper="Khadangi et al. 2025",
        commands=(
            "none yet: [Language models](language-models.md#noisefit-noise-on-the-blocks-with-the-highest-"
            "signal-to-noise-ratio)"
        ),
        members="noisy, loss, counts",
        example={"layer": ["model.layers.0", "model.layers.1"], "noise_std": 0.5},
        trainer=("NoiseFiTLoss",),
    )

    _TRANSIENT = ("_noisy",)

    def __init__(
        self,
        layer: str | Sequence[str],
        noise_std: float = 0.1,
        beta: float = 0.1,
        temperature: float = 1.0,
        hybrid_alpha: float = 0.5,
        consistency: float = 0.1,
        mean: str = "batch",
        generator: torch.Generator | None = None,
        batch_dim: int | dict | None = None,
    ):
        super().__init__(layer, batch_dim)
        if mean not in MEANS:
            raise ValueError(f"NoiseFiT: mean must be one of {', '.join(MEANS)}, got {mean!r}")
        self.mean = mean
        self.noise_std, self.beta = (
            check_non_negative("noise_std", noise_std),
            check_non_negative("beta", beta),
        )
        self.temperature = check_positive("temperature", temperature)
        self.hybrid_alpha = check_fraction("hybrid_alpha", hybrid_alpha)
        self.consistency = check_non_negative("consistency", consistency)
        self._draw_from(generator)
        self.last: LossState | None = None
        self._scales: dict[str, torch.Tensor] = {}

    def _fresh(self) -> None:
        super()._fresh()
        self._noisy = False

    def __repr__(self) -> str:
        return (
            f"NoiseFiT(layer={self._layer_spec!r}, noise_std={self.noise_std}, beta={self.beta}, "
            f"temperature={self.temperature}, hybrid_alpha={self.hybrid_alpha}, "
            f"consistency={self.consistency}, mean={self.mean!r})"
        )

    @contextlib.contextmanager
    def noisy(self) -> Iterator[None]:
        """The forwards inside get the noise (those that train)."""
        before, self._noisy = self._noisy, True
        try:
            yield
        finally:
            self._noisy = before

    def _register(self, model: nn.Module, modules: dict, handles: list[RemovableHandle]) -> None:
        for spec, module in modules.items():
            handles.append(module.register_forward_hook(recompute.hook(self._hook(spec), self._again(spec))))

    def _hook(self, spec: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output):
            if not (self._training and torch.is_grad_enabled()):
                return None
            if not self._noisy:
                self._note(spec, None)  # (a recomputation of this clean forward adds none either)
                return None
            self._seed_for_rank()
            generator = self.generator
            self._note(spec, lambda: recompute.generator_state(generator))
            return self._noised(spec, output, generator)

        return hook

    def _again(self, spec: str) -> Callable:
        def again(module: nn.Module, args: tuple, output):
            """In a recomputation (activation checkpointing): the forward's noise again."""
            if not self._training:
                return None
            state = self._replayed(spec)
            if state is None:
                return None  # (the recomputed forward was not a noisy one)
            return self._noised(spec, output, recompute.replay_generator(self.generator, state))

        return again

    def _noised(self, spec: str, output, generator: torch.Generator):
        leaf, h = sequence_of(
            output, self.sites[spec], self._dims[spec], f"NoiseFiT at {spec!r}",
            "NoiseFiT noises one (B, L, H) hidden state: name a transformer block",
        )  # fmt: skip
        scale = self.noise_std * self.noise_std * h.detach().std()  # (the authors' noise_std twice)
        noised = adaptive_noise(h, scale, generator, self.beta)
        self._scales[spec] = scale
        return put_back(output, leaf, noised)

    def counts(self, labels: torch.Tensor) -> torch.Tensor:
        """What divides the sums of the loss of a batch of ``labels``, ``(2,)`` on their device: the tokens
        the cross-entropy predicts (labelled, after position 0) and those the two KL terms weigh (labelled:
        the authors' mask, unshifted). Added over a step's micro-batches and processes, they make
        :meth:`loss`'s means the step's (``mean="step"``)."""
        return torch.stack([predicted_tokens(labels), (labels != IGNORE).sum()])

    def loss(
        self, model: nn.Module, inputs: Mapping[str, torch.Tensor], counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, object]:
        """The authors' ``compute_loss``: a clean forward (its ``loss``: the model's cross-entropy of
        ``inputs["labels"]``) and two noisy ones; the hybrid loss plus the consistency term. Returns the
        loss and the clean forward's outputs. ``counts`` (:meth:`counts`, added over a step's batches):
        each term's sum divided by them, the cross-entropy's from the clean logits; by default the
        authors' means of this batch."""
        if self._model is None:
            raise RuntimeError("NoiseFiT.loss(): attach the hook to the model first (nf.attach(model))")
        labels = inputs.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.ndim != 2 or labels.is_floating_point():
            raise ValueError(
                "NoiseFiT.loss(): the inputs need labels, (B, T) token ids with -100 where no loss (the "
                "clean forward's loss needs them)"
            )
        if counts is not None and (not isinstance(counts, torch.Tensor) or counts.shape != (2,)):
            raise ValueError(
                f"NoiseFiT.loss(): counts must be a (2,) tensor (NoiseFiT.counts), got {counts!r:.80}"
            )
        self._scales = {}
        outputs = model(**inputs)
        with self.noisy():
            noisy_1 = model(**inputs).logits
            noisy_2 = model(**inputs).logits
        logits, mask = outputs.logits, (labels != IGNORE).to(outputs.logits.dtype)
        weighed = mask.sum() if counts is None else counts[1].clamp(min=1)
        targets = F.softmax(logits / self.temperature, dim=-1)
        soft = 0.5 * sum(
            F.kl_div(F.log_softmax(n, dim=-1), targets, reduction="none").sum(-1) for n in (noisy_1, noisy_2)
        )
        soft = (soft * mask).sum() / weighed
        agree = F.kl_div(F.log_softmax(noisy_1, dim=-1), F.softmax(noisy_2, dim=-1), reduction="none").sum(-1)
        agree = (agree * mask).sum() / weighed
        if counts is None:
            ce = outputs.loss
        else:
            ce = next_token_losses(logits, labels).sum() / counts[0].clamp(min=1)
        hybrid = self.hybrid_alpha * ce + (1 - self.hybrid_alpha) * soft
        if model.training and torch.is_grad_enabled():
            terms = {"ce": ce.detach(), "soft": soft.detach(), "consistency": agree.detach()}
            self.last = LossState(terms, dict(self._scales), (labels != IGNORE).sum())
        return hybrid + self.consistency * agree, outputs
