"""A broad sample of the model zoo in the full suite (see tests/e2e/test_zoo.py), at two layers other than
the quick tier's: models whose maps come as several (HRNet), channels-last (Swin, ConvNeXt, GC ViT, TinyViT),
windowed (MaxViT), in blocks of positions (NesT), as tokens (ViTs, CaiT, Hiera), as 1-D speech features
(wav2vec2), and text models with padding (an encoder, a decoder-only LM, an encoder-decoder); the cheapest of
each kind, so that the sample costs under a minute."""

import pytest

from tests.e2e.test_zoo import check

SAMPLE = [
    "timm/regnetx_002", "timm/hrnet_w18_small", "timm/convnext_atto", "timm/gcvit_xxtiny", "timm/nest_tiny",
    "timm/swin_tiny_patch4_window7_224", "timm/cait_xxs24_224", "timm/hiera_tiny_224",
    "timm/inception_next_atto", "timm/tiny_vit_5m_224", "torchvision/googlenet", "torchvision/swin",
    "torchvision/maxvit", "torchvision/vit", "huggingface/electra", "huggingface/distilbert",
    "huggingface/llama", "huggingface/marian", "huggingface/deit", "huggingface/wav2vec2",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", SAMPLE)
def test_a_broad_sample_of_the_zoo_is_exact_or_refused(name):
    check(name, layers=2, seed=2)
