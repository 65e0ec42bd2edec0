"""mixhook: training-time augmentation and regularization hooks for any PyTorch ``nn.Module``.

The library core imports torch only::

    from mixhook import ManifoldMixup
    mix = ManifoldMixup(["input", "layer1", "layer2"], alpha=2.0)
    with mix.attach(model):
        loss = mix.loss(F.cross_entropy, model(x), y)
"""

from .compose import OneOf, attach
from .cutmix import CutMix
from .gradients import GradClip, GradScale
from .hooks import HookHandle, LayerHook
from .layers import INPUT, UnknownLayerError, layer_names, resolve_layers
from .mixing import (
    ManifoldMixup,
    Mixer,
    MixState,
    NoisyFeatureMixup,
    blend,
    mix_targets,
    sample_beta,
    sample_lam,
    smooth_one_hot,
)
from .patchup import PatchUp
from .probes import ActivationStats, FeatureRecorder, GradStats, ShapeTrace
from .scaling import InputScale

__all__ = [
    "INPUT",
    "ActivationStats",
    "CutMix",
    "FeatureRecorder",
    "GradClip",
    "GradScale",
    "GradStats",
    "HookHandle",
    "InputScale",
    "LayerHook",
    "ManifoldMixup",
    "MixState",
    "Mixer",
    "NoisyFeatureMixup",
    "OneOf",
    "PatchUp",
    "ShapeTrace",
    "UnknownLayerError",
    "attach",
    "blend",
    "layer_names",
    "mix_targets",
    "resolve_layers",
    "sample_beta",
    "sample_lam",
    "smooth_one_hot",
]

__version__ = "0.1.0"
