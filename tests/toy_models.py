"""Small user models, built through `model._target_=tests.toy_models.<Name>` like a user's own."""

from torch import nn


class TupleBlockNet(nn.Module):
    """A model whose `block` returns a tuple (features, aux), which cannot be mixed as is."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.block = _Pair()
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        features, _ = self.block(self.stem(x))
        return self.head(features.mean((2, 3)))


class PermutedInCodeNet(nn.Module):
    """Its `block` works on (B, H, W, C) maps, permuted to in `forward` code: nothing in it states that."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 12, 3, padding=1)
        self.block = _ChannelsLast(12)
        self.head = nn.Linear(12, num_classes)

    def forward(self, x):
        return self.head(self.block(self.stem(x).permute(0, 2, 3, 1)).mean((1, 2)))


class _ChannelsLast(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(channels), nn.Linear(channels, channels)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _Pair(nn.Module):
    def forward(self, x):
        return x.relu(), x.abs().mean()


class OddOutputsNet(nn.Module):
    """Layers whose outputs cannot be mixed: `named` returns a dict, `pooled` loses the batch dim."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 4, 3, padding=1)
        self.named = _Named()
        self.pooled = _BatchMean()
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        h = self.named(self.stem(x))["features"]
        return self.head(h.mean((2, 3)) + self.pooled(h).mean((1, 2)))


class _Named(nn.Module):
    def forward(self, x):
        return {"features": x.relu()}


class _BatchMean(nn.Module):
    def forward(self, x):
        return x.mean(0)


class CountForwards:
    """A user's own hook class, not derived from mixhook's: counts the forwards of one layer."""

    def __init__(self, layer: str):
        self.layer, self.calls = layer, 0

    def attach(self, model):
        return model.get_submodule(self.layer).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.calls += 1


class NanAt:
    """A user's own hook class: from the ``step``-th training forward on, ``layer`` returns NaN."""

    def __init__(self, layer: str, step: int):
        self.layer, self.step, self.calls = layer, step, 0

    def attach(self, model):
        return model.get_submodule(self.layer).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training:
            self.calls += 1
            if self.calls >= self.step:
                return output * float("nan")
        return None


class TinyConvNet(nn.Module):
    """conv - BN - ReLU - conv - pool - linear: a small (B, C, H, W) model for quick app runs."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.conv2(self.act(self.bn(self.conv1(x)))).mean((2, 3)))


class Warns:
    """A user's own hook class whose layer, in training, warns as torch and libraries do: a Python
    ``UserWarning`` and a message on a ``torch.*`` logger (where dynamo's graph breaks go)."""

    def __init__(self, layer: str):
        self.layer = layer

    def attach(self, model):
        return model.get_submodule(self.layer).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if module.training:
            import logging
            import warnings

            warnings.warn("a library's warning", UserWarning, stacklevel=1)
            logging.getLogger("torch._dynamo.toy").warning("a graph break")
        return None
