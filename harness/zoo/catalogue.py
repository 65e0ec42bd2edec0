"""The zoo's models: real timm, torchvision and HuggingFace models built small from their configs (no weights
are downloaded), each with the inputs and loss of its task.

Images are 64 x 96 where the model takes that size (a non-square input tells a map's height from its width:
:func:`harness.zoo.oracles.spatial_axes`), else square. Every entry builds in float64, in train mode, with
dropout and stochastic depth off and every parameter that its library initialises to (nearly) zero given
random values (timm and torchvision zero-initialise residual-branch norms, layer scales and heads, which
would make a mix that reaches them look exact by accident).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

B = 4  # the batch: PERM is a 4-cycle
CLASSES = 5
VOCAB = 64
SOURCE, TARGET = 7, 5  # sequence lengths (source and target of an encoder-decoder)


@dataclass(frozen=True)
class Batch:
    """A model call: its arguments, its labels, and which sequence is padded per sample (``""``: none)."""

    args: tuple
    kwargs: dict
    labels: torch.Tensor
    padded: str = ""


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo.

    ``kind``: ``image`` (``(B, 3, H, W)``), ``video`` (``(B, 3, T, H, W)``), ``text`` (an encoder with a
    classification head), ``causal`` (a causal LM), ``seq2seq`` (an encoder-decoder LM) or ``audio``
    (``input_values``). ``grid``: for a plain ViT, ``(rows, columns, leading tokens)`` of its token
    sequence, read from the library's own attributes (for the token-grid oracle)."""

    name: str
    family: str
    build: Callable[[], nn.Module]
    kind: str = "image"
    size: tuple[int, int] = (64, 96)
    grid: Callable[[nn.Module], tuple[int, int, int]] | None = None
    notes: str = ""
    quick: bool = False  # in the quick tier's sample
    tags: tuple = field(default_factory=tuple)

    def batch(self, padded: str = "", seed: int = 0) -> Batch:
        """The inputs of one call (float64), with ``padded`` (``"source"``, ``"target"`` or ``""``) padded
        per sample: right padding of different lengths."""
        g = torch.Generator().manual_seed(seed)
        if self.kind == "image":
            x = torch.randn(B, 3, *self.size, generator=g, dtype=torch.float64)
            return Batch((x,), {}, torch.randint(0, CLASSES, (B,), generator=g))
        if self.kind == "video":
            x = torch.randn(B, 3, 4, *self.size, generator=g, dtype=torch.float64)
            return Batch((x,), {}, torch.randint(0, CLASSES, (B,), generator=g))
        if self.kind == "audio":
            x = torch.randn(B, 800, generator=g, dtype=torch.float64)
            return Batch((), {"input_values": x}, torch.randint(0, CLASSES, (B,), generator=g))
        ids = torch.randint(3, VOCAB, (B, SOURCE), generator=g)
        mask = _mask(B, SOURCE, padded == "source")
        if self.kind == "text":
            labels = torch.randint(0, CLASSES, (B,), generator=g)
            return Batch((), {"input_ids": ids, "attention_mask": mask}, labels, padded)
        if self.kind == "causal":
            labels = torch.randint(3, VOCAB, (B, SOURCE), generator=g)
            return Batch((), {"input_ids": ids, "attention_mask": mask}, labels, padded)
        dec = torch.randint(3, VOCAB, (B, TARGET), generator=g)
        labels = torch.randint(3, VOCAB, (B, TARGET), generator=g)
        kwargs = {
            "input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec,
            "decoder_attention_mask": _mask(B, TARGET, padded == "target"),
        }  # fmt: skip
        return Batch((), kwargs, labels, padded)


def _mask(batch: int, length: int, padded: bool) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        for i, keep in enumerate((length - 3, length, length - 1, 2)[:batch]):
            mask[i, keep:] = 0
    return mask


def logits_of(output) -> torch.Tensor:
    """The logits of a model's output (a tensor, a HuggingFace ``ModelOutput``, a tuple)."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return output[0]


def criterion(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``(B, C)`` logits, or of ``(B, T, V)`` logits per position."""
    if logits.ndim == 3:
        return F.cross_entropy(logits.transpose(1, 2), labels)
    return F.cross_entropy(logits, labels)


def prepare(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` in float64 and train mode, its dropout and stochastic depth off, and every parameter or
    buffer its library initialised to (nearly) zero given random values."""
    model = model.double().train()
    g = torch.Generator().manual_seed(seed)
    config = getattr(model, "config", None)
    if config is not None:  # HuggingFace: SpecAugment's masks and LayerDrop draw in train mode
        for key in ("mask_time_prob", "mask_feature_prob", "layerdrop"):
            if hasattr(config, key):
                setattr(config, key, 0.0)
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr, value in vars(module).items():  # functional dropout by a float attribute (timm, HF)
            if isinstance(value, float) and ("drop" in attr or attr == "p_drop"):
                setattr(module, attr, 0.0)
        if type(module).__name__ == "StochasticDepth":
            module.p = 0.0
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and float(p.abs().max()) < 1e-3:
                if p.ndim == 1:
                    p.copy_(torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5)
                else:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(p.shape[-1]))
    return model


# ----------------------------------------------------------------------------------------------- timm


def _timm(name: str, size=(64, 96), **kwargs) -> Callable[[], nn.Module]:
    def build():
        import timm

        options = dict(pretrained=False, num_classes=CLASSES, **kwargs)
        try:
            return timm.create_model(name, img_size=size, **options)
        except TypeError:
            return timm.create_model(name, **options)

    return build


def _timm_grid(model: nn.Module) -> tuple[int, int, int]:
    rows, cols = model.patch_embed.grid_size
    return int(rows), int(cols), int(model.num_prefix_tokens)


def _t(name, size=(64, 96), notes="", quick=False, grid=None, **kwargs) -> ZooModel:
    return ZooModel(f"timm/{name}", "timm", _timm(name, size, **kwargs), "image", size, grid, notes, quick)


_VIT = dict(depth=3, embed_dim=48, num_heads=2)
TIMM = [
    _t("resnet18"),
    _t("resnet26d"),
    _t("resnext26ts"),
    _t("seresnext26d_32x4d"),
    _t("dla34"),
    _t("densenet121"),
    _t("regnetx_002"),
    _t("mobilenetv3_small_050"),
    _t("mobilenetv4_conv_small_050"),
    _t("efficientnet_b0"),
    _t("ghostnet_050"),
    _t("hrnet_w18_small"),
    _t("inception_v3", size=(96, 96)),
    _t("repvit_m1"),
    _t("rexnet_100"),
    _t("cspresnet50"),
    _t("convnext_atto"),
    _t("convnextv2_atto"),
    _t("inception_next_atto"),
    _t("edgenext_xx_small"),
    _t("starnet_s050"),
    _t("poolformer_s12"),
    _t("poolformerv2_s12"),
    _t("convformer_s18"),
    _t("mambaout_femto", (32, 48), quick=True),
    _t("vit_tiny_patch16_224", grid=_timm_grid, **_VIT),
    _t("deit_tiny_distilled_patch16_224", grid=_timm_grid, **_VIT),
    _t("vit_small_patch16_224", grid=_timm_grid, reg_tokens=4, no_embed_class=True, **_VIT),
    _t("eva02_tiny_patch14_224", grid=_timm_grid, depth=2),
    _t("beit_base_patch16_224", depth=2, embed_dim=48, num_heads=2),
    _t("cait_xxs24_224", depth=2),
    _t("volo_d1_224"),
    _t("mixer_s16_224"),
    _t("resmlp_12_224"),
    _t("swin_tiny_patch4_window7_224", depths=(1, 1), num_heads=(1, 2), embed_dim=24, window_size=4),
    _t("swinv2_cr_tiny_ns_224", depths=(1, 1), num_heads=(1, 2), embed_dim=24),
    _t("maxvit_pico_rw_256", quick=True),
    _t("coatnet_pico_rw_224"),
    _t("gcvit_xxtiny"),
    _t("davit_tiny", depths=(1, 1, 1, 1)),
    _t("focalnet_tiny_srf"),
    _t("sequencer2d_s"),
    _t("nest_tiny", size=(64, 64)),
    _t("pvt_v2_b0"),
    _t("twins_svt_small", depths=(1, 1, 1, 1)),
    _t("tiny_vit_5m_224"),
    _t("levit_128s"),
    _t("efficientformer_l1", size=(224, 224)),
    _t("efficientformerv2_s0"),
    _t("efficientvit_b0"),
    _t("efficientvit_m0"),
    _t("fastvit_t8"),
    _t("mobilevit_xxs"),
    _t("mobilevitv2_050"),
    _t("hiera_tiny_224", size=(64, 64)),
    _t("crossvit_tiny_240", size=(240, 240)),
    _t("xcit_nano_12_p16_224", depth=2),
]


# ----------------------------------------------------------------------------------------- torchvision


def _tv(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build():
        import torchvision

        return torchvision.models.get_model(name, weights=None, num_classes=CLASSES, **kwargs)

    return build


def _tv_wide_resnet():
    """wide_resnet50_2's blocks (Bottleneck, twice as wide inside), one per stage."""
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=CLASSES, width_per_group=128)


def _tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(8, 16, 1), CNBlockConfig(16, None, 1)], num_classes=CLASSES)


def _tv_swin(v2: bool = False):
    def build():
        from torchvision.models import swin_transformer as swin

        extra = {}
        if v2:
            extra = dict(block=swin.SwinTransformerBlockV2, downsample_layer=swin.PatchMergingV2)
        return swin.SwinTransformer(
            patch_size=[4, 4], embed_dim=24, depths=[1, 1], num_heads=[1, 2], window_size=[4, 4],
            num_classes=CLASSES, stochastic_depth_prob=0.0, **extra,
        )  # fmt: skip

    return build


def _tv_maxvit():
    from torchvision.models.maxvit import MaxVit

    return MaxVit(
        input_size=(64, 64), stem_channels=8, partition_size=2, block_channels=[24, 48], block_layers=[1, 1],
        head_dim=8, stochastic_depth_prob=0.0, num_classes=CLASSES,
    )  # fmt: skip


def _tv_vit():
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=CLASSES,
    )  # fmt: skip


def _tv_grid(model: nn.Module) -> tuple[int, int, int]:
    side = model.image_size // model.patch_size
    return side, side, 1


def _v(name, build, kind="image", size=(64, 96), grid=None, quick=False) -> ZooModel:
    return ZooModel(f"torchvision/{name}", "torchvision", build, kind, size, grid, quick=quick)


TORCHVISION = [
    _v("resnet18", _tv("resnet18")),
    _v("wide_resnet", _tv_wide_resnet),
    _v("mobilenet_v3_small", _tv("mobilenet_v3_small")),
    _v("efficientnet_b0", _tv("efficientnet_b0")),
    _v("regnet_y_400mf", _tv("regnet_y_400mf")),
    _v("shufflenet_v2_x0_5", _tv("shufflenet_v2_x0_5")),
    _v("squeezenet1_1", _tv("squeezenet1_1")),
    _v("mnasnet0_5", _tv("mnasnet0_5")),
    _v("densenet121", _tv("densenet121")),
    _v("googlenet", _tv("googlenet", aux_logits=False, init_weights=True)),
    _v("inception_v3", _tv("inception_v3", aux_logits=False, init_weights=True), size=(96, 96)),
    _v("convnext", _tv_convnext),
    _v("swin", _tv_swin(), size=(64, 64)),
    _v("swin_v2", _tv_swin(v2=True), size=(64, 64)),
    _v("maxvit", _tv_maxvit, size=(64, 64)),
    _v("vit", _tv_vit, size=(64, 64), grid=_tv_grid),
    _v("r3d_18", _tv("r3d_18"), "video", (32, 48)),
    _v("r2plus1d_18", _tv("r2plus1d_18"), "video", (32, 48)),
]


# ----------------------------------------------------------------------------------------- HuggingFace


def _hf(config_cls: str, model_cls: str, **config) -> Callable[[], nn.Module]:
    def build():
        import transformers

        torch.manual_seed(0)
        options = dict(attn_implementation=config.pop("attn_implementation", "eager"), **config)
        made = getattr(transformers, config_cls)(**options)
        return getattr(transformers, model_cls)(made)

    return build


_TEXT = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=32, num_labels=CLASSES, max_position_embeddings=32)  # fmt: skip
_SEQ2SEQ = dict(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                pad_token_id=1, decoder_start_token_id=2)  # fmt: skip
_VISION = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=2,
               num_attention_heads=2, intermediate_size=32, num_labels=CLASSES)  # fmt: skip


def _h(name, build, kind, size=(64, 96), quick=False) -> ZooModel:
    return ZooModel(f"huggingface/{name}", "huggingface", build, kind, size, quick=quick)


# fmt: off
HUGGINGFACE = [
    _h("bert", _hf("BertConfig", "BertForSequenceClassification", **_TEXT), "text", quick=True),
    _h("bert-sdpa", _hf("BertConfig", "BertForSequenceClassification", attn_implementation="sdpa", **_TEXT),
       "text"),
    _h("roberta", _hf("RobertaConfig", "RobertaForSequenceClassification", pad_token_id=1, **_TEXT), "text"),
    _h("electra", _hf("ElectraConfig", "ElectraForSequenceClassification", embedding_size=16, **_TEXT),
       "text"),
    _h("albert", _hf("AlbertConfig", "AlbertForSequenceClassification", embedding_size=8, **_TEXT), "text"),
    _h("deberta-v2", _hf("DebertaV2Config", "DebertaV2ForSequenceClassification", **_TEXT), "text"),
    _h("distilbert", _hf("DistilBertConfig", "DistilBertForSequenceClassification", vocab_size=VOCAB, dim=16,
                         n_layers=2, n_heads=2, hidden_dim=32, num_labels=CLASSES,
                         max_position_embeddings=32), "text"),
    _h("gpt2", _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2,
                   n_positions=32), "causal"),
    _h("llama", _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    max_position_embeddings=32), "causal"),
    _h("t5", _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32,
                 num_layers=2, num_decoder_layers=2, num_heads=2, decoder_start_token_id=0, pad_token_id=0),
       "seq2seq", quick=True),
    _h("bart", _hf("BartConfig", "BartForConditionalGeneration", **_SEQ2SEQ), "seq2seq", quick=True),
    _h("mbart", _hf("MBartConfig", "MBartForConditionalGeneration", **_SEQ2SEQ), "seq2seq"),
    _h("marian", _hf("MarianConfig", "MarianMTModel", **_SEQ2SEQ), "seq2seq"),
    _h("pegasus", _hf("PegasusConfig", "PegasusForConditionalGeneration", **_SEQ2SEQ), "seq2seq"),
    _h("vit", _hf("ViTConfig", "ViTForImageClassification", **_VISION), "image", (32, 32)),
    _h("deit", _hf("DeiTConfig", "DeiTForImageClassification", **_VISION), "image", (32, 32)),
    _h("convnext", _hf("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[8, 16],
                       depths=[1, 1], num_stages=2, num_labels=CLASSES), "image"),
    _h("swin", _hf("SwinConfig", "SwinForImageClassification", image_size=64, patch_size=4, embed_dim=16,
                   depths=[1, 1], num_heads=[1, 2], window_size=4, num_labels=CLASSES), "image", (64, 64)),
    _h("wav2vec2", _hf("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", hidden_size=16,
                       num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                       conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
                       num_conv_pos_embedding_groups=2, num_labels=CLASSES, classifier_proj_size=8), "audio"),
]
# fmt: on

ZOO: list[ZooModel] = [*TIMM, *TORCHVISION, *HUGGINGFACE]
BY_NAME = {m.name: m for m in ZOO}
