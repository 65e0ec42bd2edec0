"""TransMix: the label weights against the authors' transmix_label on the same attention (timm's ViT,
fused attention included), torchvision's ViT (nn.MultiheadAttention), tokens at a block, the refusals."""

import copy
import math

import pytest
import torch
import torchvision
from torch import nn

from mixhook import TransMix
from mixhook.functional import smooth_one_hot
from tests.helpers import Lazy, gen

timm = Lazy("timm")  # imported when a test first uses it, not at collection


def tiny_vit():
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=16, patch_size=4, embed_dim=12,
        depth=2, num_heads=2,
    ).double().train()  # fmt: skip


# From Beckschen/TransMix, transmix.py: Mixup_transmix.transmix_label (with `.cuda()` dropped); `target`
# is (area target, y1, y2, box), y2 the partner's one-hot label (the batch flipped), attn (N, hw).
def reference_transmix_label(target, attn, input_shape, ratio=0.5):
    (_, y1, y2, box) = target
    lam0 = (box[1] - box[0]) * (box[3] - box[2]) / (input_shape[2] * input_shape[3])
    mask = torch.zeros((input_shape[2], input_shape[3]))
    mask[box[0] : box[1], box[2] : box[3]] = 1
    mask = nn.Upsample(size=int(math.sqrt(attn.shape[1])))(mask.unsqueeze(0).unsqueeze(0)).int()
    mask = mask.view(1, -1).repeat(len(attn), 1)  # (b, hw)
    w1, w2 = torch.sum((1 - mask) * attn, dim=1), torch.sum(mask * attn, dim=1)
    lam1 = w2 / (w1 + w2)  # (b, )
    lam = (lam0 + lam1) / 2  # ()+(b,) ratio=0.5
    target = y1 * (1.0 - lam).unsqueeze(1) + y2 * lam.unsqueeze(1)
    return target


@pytest.mark.parametrize("fused", [True, False])
def test_the_targets_equal_the_authors_transmix_label_on_the_same_attention(fused):
    model = tiny_vit()
    model.blocks[1].attn.fused_attn = fused
    plain = copy.deepcopy(model)
    plain.blocks[1].attn.fused_attn = False  # the reference reads the attention matrix itself
    x, y = torch.randn(4, 3, 16, 16, dtype=torch.double), torch.tensor([0, 1, 2, 1])
    flip = torch.arange(3, -1, -1)  # the reference pairs each sample with the batch flipped
    box = (2, 10, 4, 16)
    mix = TransMix("input", attention="blocks.1.attn", generator=gen())
    with mix.attach(model):
        mix.pin(box=box, index=flip)
        logits = model(x)
    mixed = x.clone()
    mixed[:, :, 2:10, 4:16] = x.flip(0)[:, :, 2:10, 4:16]
    seen = {}
    plain.blocks[1].attn.attn_drop.register_forward_hook(lambda m, a, out: seen.__setitem__("attn", a[0]))
    torch.testing.assert_close(logits, plain(mixed), rtol=0, atol=1e-12)  # the mix is CutMix's
    attn = seen["attn"][:, :, 0, 1:].mean(1)  # the class token's row over the patches, mean over heads
    smoothing = 0.1
    y1, y2 = smooth_one_hot(y, 3, smoothing).double(), smooth_one_hot(y.flip(0), 3, smoothing).double()
    expected = reference_transmix_label((None, y1, y2, box), attn, x.shape)
    torch.testing.assert_close(mix.targets(y, 3, smoothing).double(), expected, rtol=1e-6, atol=1e-7)
    assert float(mix.last.info["area_lam"]) == 1 - 8 * 12 / 256
    torch.testing.assert_close(mix.last.info["attention"], attn, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"^targets\(\): TransMix weighs each image's labels by the class"):
        mix.targets(torch.zeros(4, 16, 16, dtype=torch.int64), 3)  # a label map: no per-pixel weights


def test_torchvision_vit_reads_the_multihead_attention_of_the_named_layer():
    torch.manual_seed(0)
    model = (
        torchvision.models.VisionTransformer(
            image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=12, mlp_dim=24, num_classes=3
        )
        .double()
        .train()
    )
    layer = model.encoder.layers.encoder_layer_1
    seen = {}
    layer.self_attention.register_forward_pre_hook(lambda m, a: seen.__setitem__("q", a[0].detach()))
    mix = TransMix("input", attention="encoder.layers.encoder_layer_1.self_attention", ratio=0.25)
    with mix.attach(model):
        mix.pin(box=(0, 8, 0, 8), index=[1, 0, 3, 2])  # the top-left 2x2 patches of the 4x4 grid
        model(torch.randn(4, 3, 16, 16, dtype=torch.double))
        model.eval()
        with torch.no_grad():
            _, weights = layer.self_attention(seen["q"], seen["q"], seen["q"], need_weights=True)
        model.train()
    attention = weights[:, 0, 1:]
    pasted = torch.zeros(4, 4, dtype=torch.double)
    pasted[:2, :2] = 1
    pasted = pasted.flatten()
    share = (attention * pasted).sum(1) / attention.sum(1)
    expected = 1 - (0.25 * (1 - 0.75) + 0.75 * share)
    torch.testing.assert_close(mix.last.lam, expected, rtol=1e-12, atol=1e-14)
    assert mix.last.lam.shape == (4,) and len(set(mix.last.lam.tolist())) == 4


def test_huggingface_vit_attention_is_read_whatever_attention_implementation_runs():
    """HuggingFace's ViT (sdpa by default, which returns no weights): the weights TransMix reads equal
    the eager implementation's output_attentions on the same mixed batch."""
    import transformers

    config = transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=12, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=24, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config).double().train()
    eager = transformers.ViTForImageClassification._from_config(config, attn_implementation="eager").double()
    eager.load_state_dict(model.state_dict())
    x = torch.randn(3, 3, 16, 16, dtype=torch.double)
    mix = TransMix("input", attention="vit.layers.1.attention", generator=gen())
    with mix.attach(model):
        mix.pin(box=(4, 12, 0, 8), index=[2, 0, 1])
        model(pixel_values=x)
    mixed = x.clone()
    mixed[:, :, 4:12, 0:8] = x[[2, 0, 1], :, 4:12, 0:8]
    eager.eval()  # no dropout in this config: the train-mode weights are the eval ones
    attn = eager(pixel_values=mixed, output_attentions=True).attentions[-1][:, :, 0, 1:].mean(1)
    # HuggingFace's eager attention takes its softmax in float32, hence the tolerance
    torch.testing.assert_close(mix.last.info["attention"], attn, rtol=1e-6, atol=1e-8)


def test_on_a_blocks_tokens_the_box_is_already_on_the_patch_grid():
    model = tiny_vit()
    mix = TransMix("blocks.0", attention="blocks.1.attn", tokens="auto", generator=gen(1))
    with mix.attach(model):
        mix.pin(box=(1, 3, 1, 4))
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    attention = mix.last.info["attention"]
    pasted = torch.zeros(4, 4, dtype=torch.double)
    pasted[1:3, 1:4] = 1
    share = (attention * pasted.flatten()).sum(1) / attention.sum(1)
    torch.testing.assert_close(mix.last.lam, 1 - (0.5 * 6 / 16 + 0.5 * share), rtol=1e-12, atol=1e-14)


def test_refusals_are_one_line():
    model = tiny_vit()
    with pytest.raises(
        TypeError, match="TransMix: attention='blocks.1.mlp' is a Mlp, not an attention module"
    ):
        TransMix("input", attention="blocks.1.mlp").attach(model)
    with pytest.raises(ValueError, match="ratio must be in"):
        TransMix("input", attention="blocks.1.attn", ratio=2)
    mix = TransMix("blocks.1", attention="blocks.0.attn", tokens="auto")
    with (
        mix.attach(model),
        pytest.raises(
            RuntimeError,
            match="TransMix: attention layer 'blocks.0.attn' ran before the mixed layer 'blocks.1'",
        ),
    ):
        model(torch.randn(2, 3, 16, 16, dtype=torch.double))
    net = nn.Sequential(*(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True) for _ in range(2))).train()
    mix = TransMix("0", attention="1.self_attn", tokens=(2, 2))
    with mix.attach(net):
        net(torch.randn(3, 5, 8))  # declared tokens: 1 leading token and a 2x2 grid
    assert mix.last.lam.shape == (3,) and mix.last.info["attention"].shape == (3, 4)

    class ConvAttention(nn.Module):  # a (B, C, H, W) map, then attention over its pixels: no stated grid
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 2, stride=2)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            t = self.conv(x).flatten(2).transpose(1, 2)
            return self.attn(t, t, t)[0].mean(1)

    net = ConvAttention().train()
    with pytest.raises(TypeError, match="TransMix: ConvAttention does not state its patch grid"):
        with TransMix("conv", attention="attn").attach(net):
            net(torch.randn(3, 3, 8, 8))


def test_with_the_clean_batch_kept_the_weights_read_the_mixed_rows_attention():
    """clean=True doubles the batch before the attention layer: the label weights are the mixed rows'."""
    model = tiny_vit()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    index, box = torch.arange(3, -1, -1), (2, 10, 4, 16)
    kept, alone = TransMix("input", attention="blocks.1.attn"), TransMix("input", attention="blocks.1.attn")
    kept.clean = True
    with kept.attach(model):
        kept.pin(box=box, index=index)
        model(x)
    with alone.attach(plain):
        alone.pin(box=box, index=index)
        plain(x)
    assert kept.last.lam.shape == (4,)
    torch.testing.assert_close(kept.last.lam, alone.last.lam, rtol=1e-10, atol=1e-12)


class Holding(nn.Module):
    """A module holding the ViT (a LightningModule's self.net, a wrapper for the HuggingFace Trainer): it
    states no patch grid of its own."""

    def __init__(self, vit):
        super().__init__()
        self.net = vit

    def forward(self, x):
        return self.net(x)


def test_a_vit_held_by_another_module_states_its_grid_to_the_attention_around_it():
    from mixhook import MixPro

    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    for make in (
        lambda p: TransMix("input", attention=f"{p}blocks.1.attn", generator=gen()),
        lambda p: MixPro("input", attention=f"{p}blocks.1.attn", cell=4, generator=gen()),  # (16 cells)
    ):
        bare, held = tiny_vit(), Holding(tiny_vit())
        outs, states = [], []
        for model, prefix in ((bare, ""), (held, "net.")):
            mix = make(prefix)
            with mix.attach(model):
                outs.append(model(x))
                states.append(mix.last)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        torch.testing.assert_close(states[0].lam, states[1].lam, rtol=0, atol=0)
        assert states[0].info.keys() == states[1].info.keys()


def test_with_attention_dropout_the_weights_are_read_before_it_and_draw_nothing():
    """nn.MultiheadAttention is called again to read its weights: in eval mode, so they are the softmax
    before its dropout, and the call draws nothing from the global generator that the forward's own
    dropout draws from (the logits equal an unhooked run's on the mixed batch, from the same seed)."""
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=12, mlp_dim=24, num_classes=3,
        attention_dropout=0.5, dropout=0.2,
    ).double().train()  # fmt: skip
    unhooked = copy.deepcopy(model)
    layer = model.encoder.layers.encoder_layer_1.self_attention
    seen = []
    layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    x = torch.randn(4, 3, 16, 16, dtype=torch.double)
    mix = TransMix("input", attention="encoder.layers.encoder_layer_1.self_attention")
    with mix.attach(model):
        mix.pin(box=(0, 8, 0, 8), index=[1, 0, 3, 2])
        torch.manual_seed(5)
        logits = model(x)
    mixed = x.clone()
    mixed[:, :, 0:8, 0:8] = x[[1, 0, 3, 2], :, 0:8, 0:8]
    torch.manual_seed(5)
    torch.testing.assert_close(logits, unhooked(mixed), rtol=0, atol=0)
    layer.eval()
    with torch.no_grad():
        _, weights = layer(seen[0], seen[0], seen[0], need_weights=True)
    torch.testing.assert_close(mix.last.info["attention"], weights[:, 0, 1:], rtol=1e-12, atol=1e-14)
