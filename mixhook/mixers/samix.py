"""SAMix: AutoMix with the scenario-agnostic Mix Block and mask loss.

Paper: Li, Liu, Wang, Tan, Liu, Wu, Li. "Boosting Discriminative Visual Representation Learning with
Scenario-Agnostic Mixup." 2021. https://arxiv.org/abs/2111.15454. The code: Westlake-AI/openmixup
(``configs/classification/cifar100/samix/basic/r18_l2_a2_bili_val_dp0_mul_x_cat_L1_var_01_mlr5e_2.py`` on
``openmixup/models/classifiers/automix.py`` and ``heads/pmix_block.py``).
"""

from __future__ import annotations

import dataclasses

from ..engine.mixer import with_defaults
from .automix import AutoMix


class SAMix(AutoMix):
    """SAMix (Li et al. 2021): AutoMix with SAMix's Mix Block and mask loss (OpenMixup's CIFAR-100 config):
    lam encoded by scaling the features (``lam_mul=1``, ``lam_residual``, ``lam_mul_k=0.25``), a two-layer
    value network (1x1 convolutions to ``channels // 2`` with batch norm and ELU, then to 1), query and key
    of both samples' concatenated features, bilinear upsampling, and the ``"L1+Variance"`` mask loss. Its
    Mix Block's loss in that config is the soft cross-entropy of the mixed one-hot labels with
    ``neg_weight=0.5``, which weighs the classes a label gives 0 and so changes nothing: the mixed
    criterion, as AutoMix's. Cost: a step 2.4x a Manifold Mixup step at ``layer2`` on an H200
    (PreActResNet-18, batch 128), 2.8x on 2 CPU cores at the input. Arguments as :class:`AutoMix`."""

    card = dataclasses.replace(  # (AutoMix's card: its family, example and picture settings)
        AutoMix.card,
        paper="Li et al. 2021",
        mixes="AutoMix with SAMix's Mix Block and mask loss",
        where="as AutoMix",
        signature=(
            'SAMix(layer="input", features="layer3", ..., mask_loss_mode="L1+Variance", '
            'upsampling="bilinear")'
        ),
        hook="as AutoMix",
        commands="`mixup=samix` (`experiment=li2021_cifar100_samix`)",
        details=(
            "AutoMix with OpenMixup's SAMix Mix Block: lam encoded by scaling both samples' features "
            "(`lam_mul=1`, residual, lam rescaled with `k=0.25`), a two-layer value network (1x1 "
            "convolutions with batch norm and ELU), query and key of the concatenated features; the "
            "L1+Variance mask loss (sharper masks). `mixup=samix` ships AutoMix's Mix Block rate (0.005, no "
            "momentum) and half the clean loss (`clean_weight=0.5`; OpenMixup's 1.0 trains the clean loss on "
            "a head of its own, where the model's one classifier takes both): at 1.0 it diverged on one seed "
            "of three on the default experiment, at 0.5 it trains all three (98.33%, 98.61%, 99.17%; [the "
            "study](learned_mixers_study/README.md)). Its config's Mix Block loss (soft cross-entropy "
            "with `neg_weight=0.5`) weighs only classes the mixed label gives 0: it is the mixed criterion"
        ),
    )

    # what differs from AutoMix: two defaults and the Mix Block's options
    __init__ = with_defaults(AutoMix.__init__, mask_loss_mode="L1+Variance", upsampling="bilinear")
    block_options = {
        "lam_mul": 1.0,
        "lam_residual": True,
        "lam_mul_k": 0.25,
        "x_qk_concat": True,
        "value_hidden": "half",
    }
