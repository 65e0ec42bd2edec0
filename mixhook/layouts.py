"""Layouts: which axes of a map are its channels, and which its positions (length; height and width; depth).

A region method (CutMix, FMix, PatchUp, GridMix, TokenMix, SmoothMix, ResizeMix, the saliency methods:
every :class:`~mixhook.Mixer` with ``layout_aware``) cuts a map's height and width and keeps its channels
whole. PyTorch's convolutions give ``(B, C, H, W)`` maps ("NCHW"), but Swin Transformers (torchvision's
``features``, timm's stages) keep theirs as ``(B, H, W, C)`` ("NHWC"), and ConvNeXt blocks permute to
``(B, H, W, C)`` around their LayerNorm and MLP. A box cut from an NHWC map as if it were NCHW runs over W
and C: a silently wrong mix. So a map's layout is found, never guessed (:func:`site_layout`):

1. **declared**: the mixer's ``layout="NHWC"`` (or ``"NCHW"``; a dict per layer spec), refused in one line
   where it contradicts what the model states;
2. **stated by the module** whose output it is: convolutions, batch norm, pooling and the other 2-D
   modules of ``torch.nn`` give NCHW; ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.Linear`` act on the last
   dimension, so a 4-D output of theirs is NHWC; torchvision's ``Permute`` says it with its ``dims``;
   torchvision's Swin blocks and patch merging (NHWC), ``CNBlock`` and ``LayerNorm2d`` (NCHW), timm's
   ``LayerNorm``/``RmsNorm``/``SimpleNorm``/``LayerScale`` (NHWC) and their ``2d`` variants (NCHW),
   ConvNeXt blocks and stages (NCHW), the channels-last blocks of timm's MaxViT/CoAtNet
   (``PartitionAttentionCl``) and GC ViT (``GlobalContextVitBlock``), which permute in ``forward`` code
   (NHWC; the blocks and stages around them permute back: NCHW), ``GlobalResponseNorm`` (by its
   ``channel_dim``), a module with an ``output_fmt`` (timm's ``PatchEmbed``) or a ``data_format`` (the
   LayerNorm of ConvNeXt's reference code and of HuggingFace's ConvNeXt); a ``Sequential`` (or timm's
   ``Mlp`` family, which run their parts in order) gives what its last part gives, passing over the parts
   that keep their input's layout (activations, dropout, ``Identity``, stochastic depth), and such a part
   inside a ``Sequential`` has the layout of the part before it;
3. **stated by the block around it**: inside a known channels-last block whose every map is NHWC (the Swin
   blocks, MaxViT's ``PartitionAttentionCl``, GC ViT's block), a part that states nothing (a ``DropPath``,
   an ``Identity``) gives NHWC;
4. **stated by the model** for its feature maps: timm's ``output_fmt = "NHWC"`` (Swin, Sequencer,
   MambaOut, ...) for the modules its ``feature_info`` names and those inside them (not its stem, which
   may be NCHW: MambaOut's is), torchvision's ``SwinTransformer`` for its ``features``;
5. otherwise PyTorch's convention, NCHW, **unless** the model holds modules that work on NHWC maps (a
   ``Permute`` to NHWC, a known channels-last block, or a block whose parts are a 2-D convolution and a
   ``Linear`` or ``LayerNorm`` over its channels, as in ConvNeXt's reference code): there a map whose
   layout nothing states could be either, and it is refused until declared.

A map read by any of 2-5 is checked at each mix against the model's input: its height and width as read
must be the input's over one stride (give or take a pixel of padding), or it is refused in one line. This
catches a block that permutes in ``forward`` code that nothing here knows (its ``(B, H, W, C)`` map read as
NCHW would be ``W x C``), and 4-D tensors that are no maps at all: a ``LayerNorm``'s or ``Linear``'s says
only which axis is the channels (NesT's ``(B, blocks, positions, C)``), a 1x1 convolution's may be unfolded
patches (MobileViT-v2's ``(B, C, pixels in a patch, patches)``). Where a map's sides happen to fit (its
channels equal its width, a square input with as many blocks as positions), the check cannot tell, and
the statements above decide. A map whose sides do not keep the input's proportions (a text recognizer's
``(B, C, 1, W)``) is mixed once its layout is declared.

Inside torchvision's MaxViT attention blocks the 4-D tensors are windows ``(B, windows, positions, C)``,
not maps; timm's MaxViT ``AttentionCl`` and GC ViT's ``WindowAttentionGlobal`` give windows of
``B * windows`` rows: refused, declared or not. The model's input is NCHW (images, as torchvision, timm and
HuggingFace vision models take them) unless declared. ``channels_last`` as a *memory format* is not a
layout: a ``(B, C, H, W)`` tensor stored channels-last is still indexed ``(B, C, H, W)``, and mixhook
reads shapes, never strides.

The region methods that also cut 1-D maps (signals, sequences) and 3-D maps (volumes, video) read those
maps' layouts as strictly: ``(B, C, L)`` ("NCL") or ``(B, L, C)`` ("NLC"), ``(B, C, D, H, W)`` ("NCDHW")
or ``(B, D, H, W, C)`` ("NDHWC"). The 1-D and 3-D convolutions, batch norms, pooling, padding and dropout
of ``torch.nn`` state channels first, ``Linear`` and a ``LayerNorm`` over the last dimension state them
last (through a ``Sequential`` as above); there is no convention to fall back on, since ``(B, L, C)``
sequences (transformers, RNNs) are as common as ``(B, C, L)`` signals, and video models take
``(B, C, T, H, W)`` (torchvision) or ``(B, T, C, H, W)`` (HuggingFace). So a 3-D or 5-D map that nothing
states, the model's input included, is refused until declared, except where a model states them:
torchvision's video models (``VideoResNet``, ``S3D``: ``(B, C, T, H, W)`` clips and maps throughout; its
``SwinTransformer3d``: NDHWC ``features``), HuggingFace's speech feature encoders (wav2vec2's and the
models that copy it: their convolution layers give ``(B, C, L)``, their positional convolution
``(B, L, C)``). A ``(B, L, C)`` sequence is cut along its positions only when declared ``layout="NLC"`` (a
ViT's patch tokens are better cut on their 2-D grid, ``tokens=(rows, columns)``, which a 1-D cut of the
sequence would silently stand in for).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch import nn

from .sites import INPUT, Site, check_per_layer

NCHW, NHWC = "NCHW", "NHWC"
NCL, NLC, NCDHW, NDHWC = "NCL", "NLC", "NCDHW", "NDHWC"
LAYOUTS = (NCHW, NHWC, NCL, NLC, NCDHW, NDHWC)  # a layout's length is its tensors' number of dimensions
CHANNELS_FIRST = {3: NCL, 4: NCHW, 5: NCDHW}
CHANNELS_LAST = {3: NLC, 4: NHWC, 5: NDHWC}
_SHAPES = {
    NCL: "(B, C, L)", NLC: "(B, L, C)", NCHW: "(B, C, H, W)", NHWC: "(B, H, W, C)",
    NCDHW: "(B, C, D, H, W)", NDHWC: "(B, D, H, W, C)",
}  # fmt: skip


class AmbiguousLayoutError(TypeError):
    """The layout of a map a region method would cut cannot be told (or a declared one contradicts the
    model): refused, never guessed."""


# Modules of torch.nn whose 4-D outputs are (B, C, H, W) (subclasses keep that: timm's BatchNormAct2d,
# Conv2dSame, ...).
_CHANNELS_FIRST = (
    nn.Conv2d, nn.ConvTranspose2d, nn.BatchNorm2d, nn.SyncBatchNorm, nn.InstanceNorm2d, nn.GroupNorm,
    nn.LocalResponseNorm, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d,
    nn.LPPool2d, nn.FractionalMaxPool2d, nn.MaxUnpool2d, nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle,
    nn.Dropout2d, nn.ZeroPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d, nn.ConstantPad2d, nn.ChannelShuffle,
    nn.Softmax2d, nn.Fold,
)  # fmt: skip
# Modules of torch.nn whose 3-D outputs are (B, C, L), and whose 5-D outputs are (B, C, D, H, W).
_COMMON_FIRST = (nn.SyncBatchNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.Upsample, nn.ChannelShuffle)
_FIRST_ND = {
    3: (
        nn.Conv1d, nn.ConvTranspose1d, nn.BatchNorm1d, nn.InstanceNorm1d, nn.MaxPool1d, nn.AvgPool1d,
        nn.AdaptiveMaxPool1d, nn.AdaptiveAvgPool1d, nn.LPPool1d, nn.MaxUnpool1d, nn.Dropout1d, nn.ZeroPad1d,
        nn.ReflectionPad1d, nn.ReplicationPad1d, nn.ConstantPad1d, nn.CircularPad1d, *_COMMON_FIRST,
    ),
    5: (
        nn.Conv3d, nn.ConvTranspose3d, nn.BatchNorm3d, nn.InstanceNorm3d, nn.MaxPool3d, nn.AvgPool3d,
        nn.AdaptiveMaxPool3d, nn.AdaptiveAvgPool3d, nn.LPPool3d, nn.MaxUnpool3d, nn.Dropout3d, nn.ZeroPad3d,
        nn.ReflectionPad3d, nn.ReplicationPad3d, nn.ConstantPad3d, nn.CircularPad3d, *_COMMON_FIRST,
    ),
}  # fmt: skip
# Modules that act on the last dimension: a 4-D output of theirs has its channels last.
_LAST_DIM = (nn.Linear, nn.Bilinear)
_LAST_DIM_NORMS = (
    nn.LayerNorm,
    nn.RMSNorm,
)  # when their forward is torch's own (the "2d" subclasses permute)
# Modules that keep their input's layout (elementwise, or over the whole tensor).
_KEEP = (
    nn.Identity, nn.Dropout, nn.AlphaDropout, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus,
    nn.Softsign, nn.Tanhshrink, nn.Softshrink, nn.Hardshrink, nn.Threshold, nn.LogSigmoid,
)  # fmt: skip

# Classes of torchvision and timm by "module.QualName" (neither library is imported for this).
_KNOWN = {
    "torchvision.models.convnext.CNBlock": NCHW,
    "torchvision.models.convnext.LayerNorm2d": NCHW,
    "torchvision.models.swin_transformer.SwinTransformerBlock": NHWC,
    "torchvision.models.swin_transformer.SwinTransformerBlockV2": NHWC,
    "torchvision.models.swin_transformer.PatchMerging": NHWC,
    "torchvision.models.swin_transformer.PatchMergingV2": NHWC,
    "torchvision.models.swin_transformer.ShiftedWindowAttention": NHWC,
    "torchvision.models.swin_transformer.ShiftedWindowAttentionV2": NHWC,
    "timm.layers.norm.LayerNorm2d": NCHW,
    "timm.layers.norm.LayerNorm2dFp32": NCHW,
    "timm.layers.norm.RmsNorm2d": NCHW,
    "timm.layers.norm.RmsNorm2dFp32": NCHW,
    "timm.layers.norm.SimpleNorm2d": NCHW,
    "timm.layers.norm.SimpleNorm2dFp32": NCHW,
    "timm.models.convnext.ConvNeXtBlock": NCHW,
    "timm.models.convnext.ConvNeXtStage": NCHW,
    "timm.models.swin_transformer.SwinTransformerBlock": NHWC,
    "timm.models.swin_transformer.SwinTransformerStage": NHWC,
    "timm.models.swin_transformer.PatchMerging": NHWC,
    "timm.models.swin_transformer_v2.SwinTransformerV2Block": NHWC,
    "timm.models.swin_transformer_v2.SwinTransformerV2Stage": NHWC,
    "timm.models.swin_transformer_v2.PatchMerging": NHWC,
    "timm.models.maxxvit.PartitionAttentionCl": NHWC,
    "timm.models.maxxvit.ParallelPartitionAttention": NHWC,
    "timm.models.maxxvit.PartitionAttention2d": NCHW,
    "timm.models.maxxvit.MaxxVitBlock": NCHW,
    "timm.models.maxxvit.ParallelMaxxVitBlock": NCHW,
    "timm.models.maxxvit.MaxxVitStage": NCHW,
    "timm.models.gcvit.GlobalContextVitBlock": NHWC,
    "timm.models.gcvit.GlobalContextVitStage": NCHW,
    "timm.layers.layer_scale.LayerScale2d": NCHW,
    "timm.layers.norm_act.FrozenBatchNormAct2d": NCHW,
    "timm.layers.norm_act.LayerNormAct": NHWC,
    "timm.layers.norm_act.LayerNormActFp32": NHWC,
    "timm.layers.norm_act.LayerNormAct2d": NCHW,
    "timm.layers.norm_act.LayerNormAct2dFp32": NCHW,
    "timm.layers.norm_act.RmsNormAct": NHWC,
    "timm.layers.norm_act.RmsNormActFp32": NHWC,
    "timm.layers.norm_act.RmsNormAct2d": NCHW,
    "timm.layers.norm_act.RmsNormAct2dFp32": NCHW,
    # blocks and stages that permute in forward() code, by what they return
    "timm.models.volo.OutlookAttention": NHWC,
    "timm.models.volo.Outlooker": NHWC,
    "timm.models.volo.Attention": NHWC,
    "timm.models.volo.Transformer": NHWC,
    "timm.models.volo.Downsample": NHWC,
    "timm.models.tiny_vit.TinyVitBlock": NHWC,
    "timm.models.tiny_vit.TinyVitStage": NCHW,
    "timm.models.tiny_vit.PatchMerging": NCHW,
    "timm.models.edgenext.ConvBlock": NCHW,
    "timm.models.edgenext.SplitTransposeBlock": NCHW,
    "timm.models.edgenext.EdgeNeXtStage": NCHW,
    "timm.models.nest.ConvPool": NCHW,
    "timm.models.nest.NestLevel": NCHW,
    "timm.models.mobilevit.MobileVitBlock": NCHW,
    "timm.models.mobilevit.MobileVitV2Block": NCHW,
    "timm.models.swin_transformer_v2_cr.PatchEmbed": NCHW,
    "timm.models.swin_transformer_v2_cr.PatchMerging": NHWC,
    "timm.models.swin_transformer_v2_cr.SwinTransformerV2CrBlock": NHWC,
    "timm.models.swin_transformer_v2_cr.SwinTransformerV2CrStage": NCHW,
    "transformers.models.convnext.modeling_convnext.ConvNextLayer": NCHW,
    "transformers.models.convnext.modeling_convnext.ConvNextStage": NCHW,
    "transformers.models.convnext.modeling_convnext.ConvNextEncoder": NCHW,
    "transformers.models.convnextv2.modeling_convnextv2.ConvNextV2Layer": NCHW,
    "transformers.models.convnextv2.modeling_convnextv2.ConvNextV2Stage": NCHW,
    "transformers.models.convnextv2.modeling_convnextv2.ConvNextV2Encoder": NCHW,
}
# Known channels-last blocks whose every 4-D tensor inside is an NHWC map too (windows aside: _WINDOWED), so
# that a part of theirs that states nothing (a DropPath, an Identity) has the block's layout. (ConvNeXt's
# blocks are not: NCHW outside, NHWC inside.)
_UNIFORM = {
    "torchvision.models.swin_transformer.SwinTransformerBlock",
    "torchvision.models.swin_transformer.SwinTransformerBlockV2",
    "timm.models.swin_transformer.SwinTransformerBlock",
    "timm.models.swin_transformer_v2.SwinTransformerV2Block",
    "timm.models.maxxvit.PartitionAttentionCl",
    "timm.models.maxxvit.ParallelPartitionAttention",
    "timm.models.gcvit.GlobalContextVitBlock",
    "timm.models.volo.Outlooker",
    "timm.models.volo.Transformer",
    "timm.models.swin_transformer_v2_cr.SwinTransformerV2CrBlock",
}
# timm's norm-act layers: the norm, then their ``drop`` and ``act`` parts, which keep the norm's layout.
_NORM_ACT = "timm.layers.norm_act."
# timm's norms over the last dimension (4-D outputs NHWC; on 3-D tokens too, so no sign of NHWC maps).
_LAST_DIM_NAMES = {
    "timm.layers.layer_scale.LayerScale",
    "timm.layers.norm.LayerNorm",
    "timm.layers.norm.LayerNormFp32",
    "timm.layers.norm.RmsNorm",
    "timm.layers.norm.RmsNormFp32",
    "timm.layers.norm.SimpleNorm",
    "timm.layers.norm.SimpleNormFp32",
}
# Classes that run their parts in the order they were registered, as a Sequential does.
_IN_ORDER = {
    "timm.layers.mlp.Mlp",
    "timm.layers.mlp.ConvMlp",
    "timm.layers.mlp.GluMlp",
    "timm.layers.mlp.SwiGLU",
    "timm.layers.mlp.GatedMlp",
    "timm.layers.mlp.GlobalResponseNormMlp",
}
_KEEP_NAMES = {
    "torchvision.ops.stochastic_depth.StochasticDepth",
    "timm.layers.drop.DropPath",
    "timm.layers.activations.GELU",
    "timm.layers.activations.GELUTanh",
    "timm.layers.activations.QuickGELU",
    "timm.layers.activations.Swish",
    "timm.layers.activations.Mish",
    "timm.layers.activations.Sigmoid",
    "timm.layers.activations.Tanh",
    "timm.layers.activations.HardSwish",
    "timm.layers.activations.HardSigmoid",
    "timm.layers.activations.HardMish",
    *(
        f"transformers.activations.{name}"
        for name in (
            "GELUTanh", "NewGELUActivation", "GELUActivation", "SiLUActivation", "FastGELUActivation",
            "QuickGELUActivation", "ClippedGELUActivation", "AccurateGELUActivation", "MishActivation",
            "LinearActivation", "LaplaceActivation", "ReLUSquaredActivation", "SqrtSoftplusActivation",
        )
    ),
}  # fmt: skip
# Whole models that state the layout of their ndim-D feature maps (besides a timm model's ``output_fmt``),
# with the module that holds them (None: the whole model, its input included).
_MODELS = {
    4: {"torchvision.models.swin_transformer.SwinTransformer": (NHWC, "features")},
    5: {
        "torchvision.models.video.resnet.VideoResNet": (NCDHW, None),
        "torchvision.models.video.s3d.S3D": (NCDHW, None),
        "torchvision.models.video.swin_transformer.SwinTransformer3d": (NDHWC, "features"),
    },
}
# Blocks whose inner 4-D tensors are windows, (B, windows, positions in a window, C), not maps.
_WINDOWS = {"torchvision.models.maxvit.PartitionAttentionLayer"}
# Modules whose own outputs (and everything inside) are windows: (B * windows, rows, columns, C) or
# (B * windows, positions, C).
_WINDOWED = {
    "timm.models.maxxvit.AttentionCl",
    "timm.models.gcvit.WindowAttentionGlobal",
    "timm.models.nest.TransformerLayer",  # (B, blocks, positions in a block, C)
}
# HuggingFace's speech feature encoders (wav2vec2 and the models that copy it: HuBERT, WavLM, ...): by the
# end of their class names, the layout of their 3-D outputs.
_HF_SPEECH = {
    "FeatureEncoder": NCL,
    "NoLayerNormConvLayer": NCL,
    "GroupNormConvLayer": NCL,
    "LayerNormConvLayer": NCL,
    "PositionalConvEmbedding": NLC,
}
# Blocks that hold a convolution and a LayerNorm over tokens (flattened), not over an NHWC map.
_NOT_PERMUTING = {
    "timm.layers.patch_embed.PatchEmbed",
    "timm.models.mobilevit.MobileVitBlock",  # (its LayerNorm is over unfolded patches)
    "timm.models.mobilevit.MobileVitV2Block",
    "timm.models.swin_transformer_v2_cr.PatchEmbed",
}


def _name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _format(value) -> str | None:
    value = getattr(value, "value", value)  # timm's Format is a str Enum
    return value if value in LAYOUTS else None


def check_layout(layout, specs: tuple[str, ...]):
    """A mixer's ``layout`` argument, checked: ``None``, one of :data:`LAYOUTS` for every layer, or a dict
    from some of ``specs`` to one; anything else is a one-line ``ValueError``."""
    expected = (
        "'NCHW' ((B, C, H, W) maps) or 'NHWC' ((B, H, W, C) maps), 'NCL' or 'NLC' for 1-D maps, 'NCDHW' or "
        "'NDHWC' for 3-D maps, or a dict from layer spec to one"
    )
    return check_per_layer("layout", layout, specs, lambda v: v in LAYOUTS, expected)


@dataclass(frozen=True)
class SiteLayout:
    """The layout of the maps at one site: ``layout`` (``None``: cannot be told, ``error`` says why and
    is raised when a region method meets a map there), how it was known (``how``, for messages) and on
    what ``basis``: ``"declared"`` and ``"input"`` (the model's input), which are taken as they are;
    ``"module"`` (the module, its place in a Sequential), ``"last_dim"`` (a last-dimension op: a Linear or
    a LayerNorm says which axis is the channels, not that the other two are a map's), ``"block"`` (a known
    block around it), ``"model"`` and ``"convention"``, under which a map is checked against the input's
    height and width (:meth:`check_sides`)."""

    layout: str | None
    how: str
    error: str | None = None
    basis: str = "declared"

    def of(self, kind: str, spec: str) -> str:
        """The layout, or the one-line :class:`AmbiguousLayoutError`."""
        if self.layout is None:
            raise AmbiguousLayoutError(f"{kind} at {spec!r}: {self.error}")
        return self.layout

    def check_sides(self, kind: str, spec: str, shape, grid: tuple[int, int, int] | None) -> None:
        """Refuse (one line) a map of ``shape`` whose height and width, as this layout reads them, cannot
        be the input's over one stride (``grid``: the input's number of dimensions, its height and its
        width): its axes were misread, or it is no map (unfolded patches, attention heads, windows). For
        the readings a model states (every basis but ``declared`` and ``input``), of 4-D maps under a 4-D
        input (images) and 5-D maps under a 5-D one (clips); a side of one pixel more or less than the
        stride gives is allowed for (padding), and a declared layout is how to accept a map whose sides
        do not keep the input's proportions (a text recognizer's ``(B, C, 1, W)``)."""
        if self.basis in ("declared", "input") or grid is None or self.layout is None:
            return
        if len(shape) not in (4, 5) or len(shape) != grid[0] or len(shape) != len(self.layout):
            return
        first = self.layout in CHANNELS_FIRST.values()
        height, width = (shape[-2], shape[-1]) if first else (shape[-3], shape[-2])
        rows, cols = grid[1:]
        if abs(height * cols - width * rows) <= rows + cols:
            return
        other = CHANNELS_LAST[len(shape)] if first else CHANNELS_FIRST[len(shape)]
        if self.basis == "last_dim":  # only its channels are known: the other axes are no map's
            remedy = (
                "they are not a map's height and width (windows, or blocks of positions); mix a layer "
                "whose output is the map"
            )
        elif self.basis in ("model", "convention"):
            remedy = (
                "those are not its height and width (a map the model permutes in code mixhook cannot read, "
                f"or no map at all: attention heads, windows); declare layout={other!r} if it is such a map, "
                f"or layout={self.layout!r}"
            )
        else:
            remedy = (
                "those are not a map's height and width in the input's proportions (no map at all: "
                f"unfolded patches, attention heads?); declare layout={self.layout!r} if it is a map"
            )
        raise AmbiguousLayoutError(
            f"{kind} at {spec!r}: {self.how} gives {self.layout} maps, which makes this {tuple(shape)} map "
            f"{height}x{width}, but the model's input is {rows}x{cols}: {remedy}"
        )


class _Model:
    """What one model states about the layouts of its modules' outputs (memoised per module name)."""

    def __init__(self, model: nn.Module, ndim: int = 4):
        self.model = model
        self.ndim = ndim  # of the maps whose layout is asked for
        self.names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
        self._memo: dict[str, tuple[str | None, str | None]] = {}

    def stated(self, name: str) -> tuple[str | None, str, str]:
        """The layout module ``name`` states for its output, what states it (the module, its place in a
        Sequential, a known block around it, or a model that encloses it and states the layout of the
        feature maps ``name`` lies among), and on what basis: ``"module"``, ``"last_dim"`` (a
        last-dimension op: only the channels are known), ``"block"`` or ``"model"``; ``(None, "", "")``
        where nothing does."""
        found, origin = self._origin(name)
        if found is not None:
            by_last_dim = self.ndim == 4 and _by_last_dim(self.model.get_submodule(origin))
            source = f"{type(self.model.get_submodule(name)).__name__} {name!r}"
            return found, source, "last_dim" if by_last_dim else "module"
        parts = name.split(".")
        if self.ndim == 4:
            for i in range(len(parts) - 1, 0, -1):  # enclosing blocks, innermost first
                outer = ".".join(parts[:i])
                block = self.model.get_submodule(outer)
                if _name(block) in _UNIFORM:
                    return (
                        _KNOWN[_name(block)],
                        f"the {type(block).__name__} block {outer!r} around it",
                        "block",
                    )
        for i in range(len(parts) - 1, -1, -1):  # enclosing modules, innermost first, the model last
            outer = ".".join(parts[:i])
            layout = self._model_level(self.model.get_submodule(outer), ".".join(parts[i:]))
            if layout is not None:
                return layout, f"the model {type(self.model.get_submodule(outer)).__name__}", "model"
        return None, "", ""

    def _model_level(self, module: nn.Module, inner: str | None = None) -> str | None:
        """The layout ``module`` (a whole model) states for its feature maps: for the module called
        ``inner`` inside it where given, only if ``inner`` lies among them (a timm model's ``output_fmt``
        holds for the modules its ``feature_info`` names and those inside them, not for its stem)."""
        if _name(module) in _MODELS.get(self.ndim, {}):
            layout, scope = _MODELS[self.ndim][_name(module)]
            return layout if inner is None or scope is None or _within(inner, (scope,)) else None
        if self.ndim == 4 and hasattr(module, "feature_info") and hasattr(module, "output_fmt"):  # timm
            layout = _format(module.output_fmt)
            if inner is None or layout is None:
                return layout
            info = module.feature_info if isinstance(module.feature_info, list) else []
            scope = tuple(d["module"] for d in info if isinstance(d, dict) and d.get("module"))
            return layout if _within(inner, scope) else None
        return None

    def _origin(self, name: str) -> tuple[str | None, str | None]:
        """The layout module ``name`` states and the module whose own statement it is (itself, or a part
        before it: see :meth:`_resolve`)."""
        if name not in self._memo:
            self._memo[name] = (None, None)  # (a cycle, which module trees do not have, ends here)
            self._memo[name] = self._resolve(name)
        return self._memo[name]

    def _resolve(self, name: str) -> tuple[str | None, str | None]:
        module = self.model.get_submodule(name)
        direct = _direct(module, ndim=self.ndim)
        if direct is not None:
            return direct, name
        if _in_order(module):  # its last part that states one
            return self._last_of(list(_children(module, name)), name)
        if _keeps(module):
            return self._before(name)
        return None, None

    def _before(self, name: str) -> tuple[str | None, str | None]:
        """The layout of what module ``name`` is given, where its parent runs its parts in order."""
        if not name:
            return None, None
        parent_name = name.rpartition(".")[0]
        parent = self.model.get_submodule(parent_name)
        if _name(parent).startswith(_NORM_ACT) or type(parent).__name__.endswith("ConvLayer"):
            # the activation after a norm-act layer's norm, or after a speech conv layer's convolution (and
            # norm): the layer's own layout, where it states one
            direct = _direct(parent, ndim=self.ndim)
            return direct, parent_name if direct is not None else None
        if not _in_order(parent):
            return None, None
        siblings = list(_children(parent, parent_name))
        index = [n for n, _ in siblings].index(name)
        return self._last_of(siblings[:index], parent_name)

    def _last_of(self, parts: list, owner: str) -> tuple[str | None, str | None]:
        """The layout the last of ``parts`` (run in order inside module ``owner``) states, passing over
        the parts that keep their input's; with none, what ``owner`` is given."""
        for part_name, part in reversed(parts):
            found = self._origin(part_name)
            if found[0] is not None:
                return found
            if not _keeps(part):
                return None, None
        return self._before(owner)

    def windows(self, name: str) -> tuple[str, bool] | None:
        """The window-partitioning block ``name`` lies inside (see ``_WINDOWS``), or the module at or
        around ``name`` whose output is windows (``_WINDOWED``: then ``True``), if any."""
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            outer = ".".join(parts[:i])
            module = self.model.get_submodule(outer)
            kind = _name(module)
            last = list(module.children())[-1:] if _in_order(module) else []
            if kind in _WINDOWED or (last and _name(last[0]) in _WINDOWED):  # (or a Sequential of them)
                return outer, True
            if kind in _WINDOWS and i < len(parts):
                return outer, False
        return None

    @cached_property
    def permuting(self) -> list[str]:
        """The modules that show the model works on NHWC maps (see the module docstring, rule 4)."""
        if self.ndim != 4:
            return []
        return [
            name or "(the model)"
            for module, name in self.names.items()
            if _direct(module, strong=True) == NHWC
            or (name and _permutes(module))
            or self._model_level(module) == NHWC
            or _name(module) in _UNIFORM
        ]


def _within(name: str, scope: tuple[str, ...]) -> bool:
    return any(name == s or name.startswith(f"{s}.") for s in scope)


def _children(module: nn.Module, name: str):
    prefix = f"{name}." if name else ""
    return [(f"{prefix}{n}", m) for n, m in module.named_children()]


def _direct(module: nn.Module, strong: bool = False, ndim: int = 4) -> str | None:
    """What ``module``'s own class (or attributes) says of its ``ndim``-D output. ``strong``: only
    statements that show NHWC maps exist (not the last-dimension rule of Linear and LayerNorm, which hold
    everywhere for 3-D tokens too)."""
    name = _name(module)
    if ndim != 4:
        if ndim == 3 and name.startswith("transformers.models."):
            found = next((v for k, v in _HF_SPEECH.items() if type(module).__name__.endswith(k)), None)
            if found is not None:
                return found
        if isinstance(module, _FIRST_ND[ndim]):
            return CHANNELS_FIRST[ndim]
        return CHANNELS_LAST[ndim] if _over_last_dim(module, name) else None
    if name in _KNOWN:
        return _KNOWN[name]
    if name == "torchvision.ops.misc.Permute":
        dims = list(getattr(module, "dims", []))
        return NHWC if dims == [0, 2, 3, 1] else NCHW if dims == [0, 3, 1, 2] else None
    if name == "timm.layers.mlp.GlobalResponseNorm" or name.endswith(".GlobalResponseNorm"):
        dim = getattr(module, "channel_dim", None)
        return NHWC if dim == -1 else NCHW if dim == 1 else None
    data_format = getattr(module, "data_format", None)  # ConvNeXt's reference LayerNorm, HuggingFace's
    if data_format in ("channels_last", "channels_first"):
        return NHWC if data_format == "channels_last" else NCHW
    fmt = getattr(module, "output_fmt", None)
    if fmt is not None and not hasattr(module, "feature_info"):  # a layer's own (timm's PatchEmbed)
        return _format(fmt) if getattr(module, "flatten", False) is False else None
    if isinstance(module, _CHANNELS_FIRST):
        return NCHW
    if strong:
        return None
    return NHWC if _over_last_dim(module, name) else None


def _over_last_dim(module: nn.Module, name: str) -> bool:
    """Whether ``module`` (its class's full ``name``) acts on its input's last dimension: a Linear, or a
    norm over one dimension (torch's ``LayerNorm``/``RMSNorm``, timm's last-dimension norms)."""
    if isinstance(module, _LAST_DIM) or name in _LAST_DIM_NAMES:
        return True
    return (
        isinstance(module, _LAST_DIM_NORMS)
        and type(module).forward in (nn.LayerNorm.forward, nn.RMSNorm.forward)
        and len(module.normalized_shape) == 1
    )


def _by_last_dim(module: nn.Module) -> bool:
    """Whether what ``module`` states of its 4-D output is only that its last dimension is the channels (a
    Linear, a LayerNorm over one dimension, timm's last-dimension norms and layer scale): that its other
    two are a map's height and width is then checked against the input, for they may be windows or
    blocks of positions (NesT's ``(B, blocks, positions, C)``)."""
    return _name(module) not in _KNOWN and _direct(module) == NHWC and _direct(module, strong=True) is None


def _last_dim_part(module: nn.Module) -> bool:
    """A Linear, or a LayerNorm over one dimension (torch's, timm's, or a class of that name: ConvNeXt's
    reference code has its own)."""
    if isinstance(module, _LAST_DIM) or _name(module) in _LAST_DIM_NAMES:
        return True
    shape = getattr(module, "normalized_shape", None)
    return "LayerNorm" in type(module).__name__ and "2d" not in type(module).__name__ and shape is not None


def _permutes(module: nn.Module) -> bool:
    """A block that holds a 2-D convolution beside a Linear or LayerNorm over the channels: it must permute
    its maps to NHWC between them (ConvNeXt's block)."""
    if _name(module) in _NOT_PERMUTING:
        return False
    parts = list(module.children())
    return any(isinstance(p, nn.Conv2d) for p in parts) and any(_last_dim_part(p) for p in parts)


def _in_order(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) or _name(module) in _IN_ORDER


def _keeps(module: nn.Module) -> bool:
    """Whether ``module`` gives its input's layout back (elementwise)."""
    return isinstance(module, _KEEP) or _name(module) in _KEEP_NAMES


def site_layout(
    model: nn.Module, site: Site, declared: str | None, facts: _Model | None = None, ndim: int = 4
) -> SiteLayout:
    """The layout of the ``ndim``-D maps (3, 4 or 5) at ``site`` of ``model`` (see the module docstring),
    with ``declared`` (the mixer's ``layout`` for this site) checked against what the model states.
    ``facts``: a :class:`_Model` of ``model`` for ``ndim``, shared by several sites."""
    facts = facts or _Model(model, ndim)
    first, last = CHANNELS_FIRST[ndim], CHANNELS_LAST[ndim]
    choices = f"layout={first!r} ({_SHAPES[first]}) or layout={last!r} ({_SHAPES[last]})"
    if declared is not None and len(declared) != ndim:
        return SiteLayout(
            None,
            "declared",
            f"layout={declared!r} was declared for {_SHAPES[declared]} maps, but the map is {ndim}-D; "
            f"declare {choices} for it (a dict gives each layer its own)",
        )
    if site.layer == INPUT:
        return _input_layout(model, facts, declared, ndim, choices)
    windows = facts.windows(site.layer) if ndim in (3, 4) else None
    if windows is not None and (windows[1] or ndim == 4):
        return _windows(model, site, *windows)
    stated, source, basis = facts.stated(site.layer)
    if declared is not None:
        if stated is not None and stated != declared:
            return SiteLayout(
                None,
                "declared",
                f"layout={declared!r} was declared, but {source} gives {stated} maps; declare "
                f"layout={stated!r} or leave it out",
            )
        return SiteLayout(declared, "declared")
    if stated == NLC:
        return SiteLayout(
            None,
            "sequence",
            f"{source} gives a (B, L, C) sequence; a region method would cut its L positions: declare "
            "layout='NLC' to do so (a ViT's patch tokens: tokens=(rows, columns) cuts their 2-D grid)",
        )
    if stated is not None:
        return SiteLayout(stated, source, basis=basis)
    module = type(model.get_submodule(site.layer)).__name__
    if ndim != 4:
        return SiteLayout(
            None,
            "unknown",
            f"{module} states no layout for its {ndim}-D map (1-D and 3-D maps have no convention to fall "
            f"back on); declare {choices}{_TOKENS if ndim == 3 else ''}",
        )
    permuting = facts.permuting
    if permuting:
        shown = ", ".join(permuting[:3]) + (", ..." if len(permuting) > 3 else "")
        return SiteLayout(
            None,
            "unknown",
            f"{module} states no layout for its (B, ?, ?, ?) map, "
            f"and the model works on (B, H, W, C) maps too ({shown}), so it may be (B, C, H, W) or (B, H, W, "
            "C); declare it: layout='NCHW' or layout='NHWC'",
        )
    return SiteLayout(NCHW, "PyTorch's convention", basis="convention")


_TOKENS = "; for (B, T, D) tokens declare their patch grid: tokens=(rows, columns) or 'auto'"


def _input_layout(
    model: nn.Module, facts: _Model, declared: str | None, ndim: int, choices: str
) -> SiteLayout:
    """The layout of the model's input: declared, images (4-D: NCHW), a torchvision video model's clips,
    or unknown."""
    if declared is not None:
        return SiteLayout(declared, "declared")
    if ndim == 4:
        return SiteLayout(NCHW, "the model's input (images)", basis="input")
    video = facts._model_level(model)  # a torchvision video model takes (B, C, T, H, W) clips
    if video is not None:
        how = f"the model {type(model).__name__}'s input (clips)"
        return SiteLayout(CHANNELS_FIRST[ndim], how, basis="input")
    return SiteLayout(
        None, "unknown", f"the model's input is a {ndim}-D map whose layout nothing states; declare {choices}"
    )


def _windows(model: nn.Module, site: Site, block: str, own: bool) -> SiteLayout:
    """A site at or inside ``block``, whose tensors are windows or blocks of positions, not maps
    (``own``: of ``B * windows`` rows, or ``(B, blocks, positions, C)``): refused, naming what to mix."""
    where = f"{type(model.get_submodule(block)).__name__} {block!r}"
    if own:
        return SiteLayout(
            None,
            "windows",
            f"{'at' if block == site.layer else 'inside'} {where} the tensors are windows or blocks of "
            "positions ((B * windows, positions, C), (B, blocks, positions, C)), not maps: mix a module "
            "around it whose output is the map",
        )
    return SiteLayout(
        None,
        "windows",
        f"inside {where} the 4-D tensors are windows (B, windows, positions in a window, C), not "
        f"maps: mix {block!r} itself, whose output is one",
    )


def channels_first(t, layout: str):
    """``t`` in ``layout`` as its channels-first view (``(B, C, ...)``)."""
    return t.permute(0, t.ndim - 1, *range(1, t.ndim - 1)) if layout in CHANNELS_LAST.values() else t


def channels_last(t):
    """A channels-first ``(B, C, ...)`` tensor back as its channels-last view ``(B, ..., C)``."""
    return t.permute(0, *range(2, t.ndim), 1)


def layout_facts(model: nn.Module, ndim: int = 4) -> _Model:
    """The per-model statements :func:`site_layout` reads for ``ndim``-D maps, to share among the sites
    of one model."""
    return _Model(model, ndim)
