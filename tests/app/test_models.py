"""PreActResNet-18 and torchvision models by name."""

import pytest
import torch

from mixhook.app.models import PreActResNet18, classification_models, torchvision_model


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (3, 32)])
def test_preact_resnet18_runs_at_digits_and_cifar_size(channels, size):
    model = PreActResNet18(in_channels=channels, num_classes=7)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 7)
    names = dict(model.named_children())
    assert list(names) == ["conv1", "layer1", "layer2", "layer3", "layer4", "linear"]
    assert sum(p.numel() for p in PreActResNet18().parameters()) == 11_171_146  # as the reference code


def test_torchvision_model_adapts_the_stem_and_keeps_names():
    model = torchvision_model("resnet18", in_channels=1, num_classes=10)
    assert model.conv1.in_channels == 1 and model.conv1.out_channels == 64
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert "layer2.0.bn1" in dict(model.named_modules())
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    mobile = torchvision_model("mobilenet_v3_small", in_channels=1, num_classes=4)
    assert mobile.features[0][0].in_channels == 1
    assert mobile(torch.randn(2, 1, 32, 32)).shape == (2, 4)


def test_unknown_torchvision_model_suggests_names():
    assert "resnet50" in classification_models()
    with pytest.raises(
        ValueError,
        match=r"model.name='resnet181' is not a torchvision classification model; did you mean resnet18",
    ):
        torchvision_model("resnet181")


# erichson/NFM at ed22d5d, src/cifar_models/preresnet.py: the authors' block and network (their mixing
# branches left out: the network they mix in is this one).
class AuthorsPreActBlock(torch.nn.Module):
    expansion = 1

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        nn, F = torch.nn, torch.nn.functional
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.relu = F.relu
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != self.expansion * planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, self.expansion * planes, kernel_size=1, stride=stride, bias=False)
            )

    def forward(self, x):
        out = self.relu(self.bn1(x))
        shortcut = self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.relu(self.bn2(out)))
        out += shortcut
        return out


class AuthorsPreActResNet(torch.nn.Module):
    def __init__(self, num_blocks, num_classes=10, width=1):
        super().__init__()
        widths = [int(w * width) for w in [64, 128, 256, 512]]
        self.in_planes = widths[0]
        self.conv1 = torch.nn.Conv2d(3, self.in_planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.layer1 = self._make_layer(widths[0], num_blocks[0], stride=1)
        self.layer2 = self._make_layer(widths[1], num_blocks[1], stride=2)
        self.layer3 = self._make_layer(widths[2], num_blocks[2], stride=2)
        self.layer4 = self._make_layer(widths[3], num_blocks[3], stride=2)
        self.linear = torch.nn.Linear(widths[3] * AuthorsPreActBlock.expansion, num_classes)
        self.blocks = [self.layer1, self.layer2, self.layer3, self.layer4]

    def _make_layer(self, planes, num_blocks, stride):
        strides = [stride] + [1] * (num_blocks - 1)
        layers = []
        for stride in strides:
            layers.append(AuthorsPreActBlock(self.in_planes, planes, stride))
            self.in_planes = planes * AuthorsPreActBlock.expansion
        return torch.nn.Sequential(*layers)

    def forward(self, x):
        out = self.conv1(x)
        for block in self.blocks:
            out = block(out)
        out = torch.nn.functional.avg_pool2d(out, 4)
        out = out.view(out.size(0), -1)
        return self.linear(out)


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 2])
def test_the_nfm_option_is_the_nfm_authors_network(width):
    """shortcut="activated" (and width 2: their PreActWideResNet18) equals the authors' network: the same
    parameters by name and shape, the same logits and gradients in float64; the default differs from it."""
    theirs = AuthorsPreActResNet([2, 2, 2, 2], num_classes=10, width=width).double().train()
    ours = PreActResNet18(num_classes=10, shortcut="activated", width=width).double().train()
    shapes = {n: p.shape for n, p in theirs.state_dict().items()}
    assert {n: p.shape for n, p in ours.state_dict().items()} == shapes
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(width))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12)
    plain = PreActResNet18(num_classes=10, width=width).double().train()  # He et al.'s: x on the shortcut
    plain.load_state_dict(theirs.state_dict())
    assert not torch.allclose(plain(x), theirs(x))


def test_bad_shortcut_and_width_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^shortcut='relu' is not a shortcut; valid: input, activated$"):
        PreActResNet18(shortcut="relu")
    for width in (0, -1, 0.3, "2"):  # 0.3: 19.2 channels, never rounded silently
        refusal = rf"^width must be a positive multiple of 1/64 .*, got {width!r}"
        with pytest.raises(ValueError, match=refusal):
            PreActResNet18(width=width)


def test_a_fractional_width_is_the_same_network_narrower():
    model = PreActResNet18(in_channels=1, width=0.25)
    channels = [model.conv1.out_channels, model.layer2[0].conv1.out_channels, model.linear.in_features]
    assert channels == [16, 32, 128]
    assert [n for n, _ in model.named_modules()] == [n for n, _ in PreActResNet18(1).named_modules()]


# From kaidic/LDAM-DRW models/resnet_cifar.py (2536330): ResNet_s with option A, as the test's reference.
class _LambdaLayer(torch.nn.Module):
    def __init__(self, lambd):
        super().__init__()
        self.lambd = lambd

    def forward(self, x):
        return self.lambd(x)


class _LdamBlock(torch.nn.Module):
    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        nn, F = torch.nn, torch.nn.functional
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = _LambdaLayer(
                lambda x: F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, planes // 4, planes // 4), "constant", 0)
            )

    def forward(self, x):
        F = torch.nn.functional
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class _LdamResNet32(torch.nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        nn = torch.nn
        self.in_planes = 16
        self.conv1 = nn.Conv2d(3, 16, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._make_layer(16, 5, 1)
        self.layer2 = self._make_layer(32, 5, 2)
        self.layer3 = self._make_layer(64, 5, 2)
        self.linear = nn.Linear(64, num_classes)

    def _make_layer(self, planes, num_blocks, stride):
        layers = []
        for s in [stride] + [1] * (num_blocks - 1):
            layers.append(_LdamBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return torch.nn.Sequential(*layers)

    def forward(self, x):
        F = torch.nn.functional
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.avg_pool2d(out, out.size()[3])
        return self.linear(out.view(out.size(0), -1))


def test_resnet32_is_the_ldam_drw_codes_network():
    from mixhook.app.models import ResNet32

    torch.manual_seed(0)
    ours, theirs = ResNet32(3, 10).double(), _LdamResNet32(10).double()
    assert sum(p.numel() for p in ours.parameters()) == 464_154
    theirs.load_state_dict(ours.state_dict())  # the same names and shapes
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    for mode in ("train", "eval"):
        getattr(ours, mode)(), getattr(theirs, mode)()
        torch.testing.assert_close(ours(x), theirs(x))
    assert ResNet32(1, 7)(torch.randn(2, 1, 8, 8)).shape == (2, 7)  # digits too
    with pytest.raises(ValueError, match="depth must be 6n \\+ 2"):
        from mixhook.app.models import CifarResNet

        CifarResNet(33)


# zhunzhong07/Random-Erasing at ed05424, models/fashion/resnet.py: its BasicBlock and ResNet (below depth 44,
# where it builds bottlenecks), the lines a forward needs; `(depth - 2) / 6` there is `//` here (their
# float count of blocks fails in today's Python), `fc` kept as their name for the classifier.
class _ErasingBlock(torch.nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        residual = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            residual = self.downsample(x)
        out += residual
        return self.relu(out)


class _ErasingResNet(torch.nn.Module):
    def __init__(self, depth, num_classes=10):
        super().__init__()
        nn = torch.nn
        n = (depth - 2) // 6
        self.inplanes = 16
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(16, n)
        self.layer2 = self._make_layer(32, n, stride=2)
        self.layer3 = self._make_layer(64, n, stride=2)
        self.avgpool = nn.AvgPool2d(7)
        self.fc = nn.Linear(64, num_classes)

    def _make_layer(self, planes, blocks, stride=1):
        nn = torch.nn
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )
        layers = [_ErasingBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [_ErasingBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.avgpool(x).view(x.size(0), -1))


@pytest.mark.parametrize("depth", [20, 32])
def test_the_projection_resnet_is_the_random_erasing_codes_network(depth):
    """CifarResNet(shortcut="projection") is the network of Random Erasing's Fashion-MNIST script: the
    same parameters (their `fc` is our `linear`), the same outputs in training and evaluation on 28x28
    images, and their initialisation (convolutions N(0, 2 / (9 * out_channels)), batch norm 1 and 0)."""
    from mixhook.app.models import CifarResNet

    torch.manual_seed(0)
    ours, theirs = CifarResNet(depth, 1, 10, "projection").double(), _ErasingResNet(depth).double()
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert sum(p.numel() for p in CifarResNet(20, 1, 10, "projection").parameters()) == 272_186
    theirs.load_state_dict({k.replace("linear.", "fc."): v for k, v in ours.state_dict().items()})
    x = torch.randn(4, 1, 28, 28, dtype=torch.float64)
    for mode in ("train", "eval"):
        getattr(ours, mode)(), getattr(theirs, mode)()
        torch.testing.assert_close(ours(x), theirs(x))
    conv = ours.layer3[0].conv2.weight.detach()
    assert (
        abs(float(conv.std()) - (2 / (9 * 64)) ** 0.5) < 0.01
        and ours.layer2[0].downsample[1].weight.eq(1).all()
    )
    with pytest.raises(ValueError, match="depth=44 with shortcut=projection: the Random Erasing code builds"):
        CifarResNet(44, shortcut="projection")
    with pytest.raises(ValueError, match="shortcut='B' is not a shortcut; valid: zeros, projection"):
        CifarResNet(20, shortcut="B")
