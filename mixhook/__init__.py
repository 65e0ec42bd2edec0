"""mixhook: training-time augmentation and regularization hooks for any PyTorch ``nn.Module``.

The library core imports torch only::

    from mixhook import ManifoldMixup
    mix = ManifoldMixup(["input", "layer1", "layer2"], alpha=2.0)
    with mix.attach(model):
        loss = mix.loss(F.cross_entropy, model(x), y)
"""

from . import mixers, policies
from .compose import attach
from .erasing import Cutout, RandomErasing
from .gradients import GradClip, GradScale
from .hooks import HookHandle, LayerHook
from .layers import (
    INPUT,
    UnknownLayerError,
    describe,
    fastai_layers,
    layer_names,
    portable_names,
    register_layers,
    resolve_layer,
    resolve_layers,
)
from .lm import LossHook, LossState, NEFTune, NoiseFiT, SFTMix
from .mixers import *  # noqa: F403  (every mixer, found in mixhook/mixers/, and the contract)
from .probes import ActivationStats, FeatureRecorder, GradStats, ShapeTrace
from .scaling import InputScale
from .schedule import MixSchedule, Ramp

__all__ = [
    "INPUT",
    "ActivationStats",
    "Cutout",
    "FeatureRecorder",
    "GradClip",
    "GradScale",
    "GradStats",
    "HookHandle",
    "InputScale",
    "LayerHook",
    "LossHook",
    "LossState",
    "MixSchedule",
    "NEFTune",
    "NoiseFiT",
    "Ramp",
    "RandomErasing",
    "SFTMix",
    "ShapeTrace",
    "UnknownLayerError",
    "attach",
    "describe",
    "fastai_layers",
    "layer_names",
    "mixers",
    "policies",
    "portable_names",
    "register_layers",
    "resolve_layer",
    "resolve_layers",
]
__all__ += mixers.__all__

__version__ = "0.1.0"
