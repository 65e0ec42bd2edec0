"""One module per benchmark case; each returns the dict that run.py writes under its key."""

from mixhook.app.models import PreActResNet18

# The channels of every case's PreActResNet-18 times this: run.py --quick sets 0.25 (stages of 16, 32, 64
# and 128 channels), so that the smoke run in the test suite takes seconds; the full run keeps the paper's.
PREACT_WIDTH = 1.0


def preact_resnet18() -> PreActResNet18:
    """The benchmarks' PreActResNet-18 (3 channels, 10 classes) at ``PREACT_WIDTH``."""
    return PreActResNet18(in_channels=3, num_classes=10, width=PREACT_WIDTH)
