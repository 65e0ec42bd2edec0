"""Models for the experiment app: the papers' PreActResNet-18 and CIFAR ResNet-32, any torchvision classifier,
any timm model, and an MLP for tabular data."""

from mixhook.layers import register_layers

from .mlp import MLP
from .preact_resnet import PreActBlock, PreActResNet, PreActResNet18
from .resnet_cifar import CifarResNet, ResNet32
from .timm_models import timm_model
from .tv import classification_models, torchvision_model

# What portable specs (stage:k, block:k, depth:f) reach in the app's own models, numbered as timm numbers
# a ResNet: stage 0 is the stem (CifarResNet's ends in a functional ReLU: its stage 0 is bn1, before it).
register_layers(PreActResNet, stages=["conv1", "layer1", "layer2", "layer3", "layer4"], blocks=["layer*.*"])
register_layers(CifarResNet, stages=["bn1", "layer1", "layer2", "layer3"], blocks=["layer*.*"])
register_layers(MLP, blocks=["layer1", "layer2"])

__all__ = [
    "MLP",
    "CifarResNet",
    "ResNet32",
    "PreActBlock",
    "PreActResNet",
    "PreActResNet18",
    "classification_models",
    "timm_model",
    "torchvision_model",
]
