"""Models for the experiment app: the papers' PreActResNet-18 and CIFAR ResNet-32, any torchvision classifier,
any timm model, and an MLP for tabular data."""

from .mlp import MLP
from .preact_resnet import PreActBlock, PreActResNet, PreActResNet18
from .resnet_cifar import CifarResNet, ResNet32
from .timm_models import timm_model
from .tv import classification_models, torchvision_model

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
