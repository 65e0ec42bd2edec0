"""A broad sample of the model zoo (see tests/e2e/test_zoo.py), at two layers other than the quick tier's:
models whose maps come as several (HRNet), channels-last (Swin, ConvNeXt, GC ViT, TinyViT), windowed
(MaxViT), in blocks of positions (NesT), as tokens (ViTs, CaiT, Hiera), as 1-D speech features (wav2vec2),
and text models with padding (an encoder, a decoder-only LM, an encoder-decoder); the cheapest of each kind.

The full suite runs a sample of it, one model of each kind it keeps in a process (:data:`IN_SUITE`); the
whole sample is a step of .ci/run of its own, after the suite: ``python -m tests.e2e.test_zoo_sample``
(each model's line and time; exit 1 naming the models with a wrong result or an error).
"""

import sys
import time

import pytest

from tests.e2e.test_zoo import check

SAMPLE = [
    "timm/regnetx_002", "timm/hrnet_w18_small", "timm/convnext_atto", "timm/gcvit_xxtiny", "timm/nest_tiny",
    "timm/swin_tiny_patch4_window7_224", "timm/cait_xxs24_224", "timm/hiera_tiny_224",
    "timm/inception_next_atto", "timm/tiny_vit_5m_224", "torchvision/googlenet", "torchvision/swin",
    "torchvision/maxvit", "torchvision/vit", "huggingface/electra", "huggingface/distilbert",
    "huggingface/llama", "huggingface/marian", "huggingface/deit", "huggingface/wav2vec2",
]  # fmt: skip
# in the suite: each kind whose models build and run in about a second or less (channels-last maps and
# windows, tokens, text with padding, speech); HRNet's several maps, NesT's blocks, the slower ConvNeXt,
# GC ViT, TinyViT, Hiera, InceptionNeXt and GoogLeNet (2 to 15 s each) in the .ci/run step
IN_SUITE = [
    "timm/regnetx_002", "timm/swin_tiny_patch4_window7_224", "timm/cait_xxs24_224", "torchvision/swin",
    "torchvision/maxvit", "torchvision/vit", "huggingface/electra", "huggingface/distilbert",
    "huggingface/llama", "huggingface/marian", "huggingface/deit", "huggingface/wav2vec2",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_SUITE)
def test_a_broad_sample_of_the_zoo_is_exact_or_refused(name):
    check(name, layers=2, seed=2)


def main() -> int:
    """The whole sample, as .ci/run's step: one line per model, then the total time."""
    import warnings

    warnings.filterwarnings("ignore")  # the libraries' own deprecation notices about their configs
    start, failed = time.time(), []
    for name in SAMPLE:
        began = time.time()
        try:
            check(name, layers=2, seed=2)
            outcome = "exact or refused"
        except AssertionError as error:
            failed.append(name)
            outcome = f"FAILED: {error}"
        print(f"zoo sample: {name}: {outcome} ({time.time() - began:.0f} s)", flush=True)
    print(f"zoo sample: {len(SAMPLE)} models, {len(failed)} failed ({time.time() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
