"""SAMix: OpenMixup's SAMix Mix Block (its lam encoding, value network and query/key) with AutoMix's
training; the mask, the loss and one step against OpenMixup's code are in tests/mixers/test_automix.py (run
for both classes)."""

import math

import pytest
from torch import nn

from mixhook import SAMix
from mixhook.mixers.mixblock import rescale_lam
from tests.mixers.test_automix import Net


# openmixup/models/heads/pmix_block.py: PixelMixBlock.rescale_lam_mult
def rescale_lam_mult(lam, k=1):
    assert k >= 0
    k += 1
    lam = float(lam)
    return 1 / (k - 2 / 3) * (4 / 3 * math.pow(lam, 3) - 2 * lam**2 + k * lam)


@pytest.mark.parametrize("k", [0.0, 0.25, 1.0, 10.0])
def test_the_lam_rescaling_is_openmixups_and_keeps_0_half_and_1(k):
    for lam in (0.0, 0.1, 0.3, 0.5, 0.77, 1.0):
        assert rescale_lam(lam, k) == rescale_lam_mult(lam, k)
    assert [rescale_lam(v, k) for v in (0.0, 0.5, 1.0)] == pytest.approx([0.0, 0.5, 1.0])


def test_samix_builds_openmixups_samix_block_from_the_features_channels():
    model = Net()
    mix = SAMix("input", "layer3")
    with mix.attach(model):
        block = mix.mix_block
        assert (
            block.channels == 32
            and block.lam_mul == 1.0
            and block.lam_residual
            and block.lam_mul_k == (0.25,)
        )
        assert block.upsampling == ("bilinear",) and mix.mask_loss_mode == "L1+Variance"
        # ConvNeck(in=C, hid=C // 2, out=1, num_layers=2, kernel_size=1): conv (no bias), BN, ELU, conv
        kinds = [type(m) for m in block.value]
        assert kinds == [nn.Conv2d, nn.BatchNorm2d, nn.ELU, nn.Conv2d]
        assert block.value[0].in_channels == 32 and block.value[0].out_channels == 16
        assert block.value[0].bias is None and block.value[3].bias is None
        # x_qk_concat: query and key, two convolutions of the two samples' concatenated features
        assert block.key is not None and block.query.in_channels == block.key.in_channels == 64
        assert block.query.out_channels == 16 and block.query.bias is not None
        assert len(list(mix.parameters())) == len(list(block.parameters())) == 8
