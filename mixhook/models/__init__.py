"""Models for the experiment app: the papers' PreActResNet-18 and any torchvision classifier."""

from .preact_resnet import PreActBlock, PreActResNet, PreActResNet18
from .tv import classification_models, torchvision_model

__all__ = ["PreActBlock", "PreActResNet", "PreActResNet18", "classification_models", "torchvision_model"]
