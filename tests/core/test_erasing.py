"""Random Erasing and Cutout (mixhook/erasing.py): the rectangles are the authors' algorithm on the same
draws, the erased input is torchvision's ``erase`` with the same rectangles and values, a hidden layer's
erasing is a hand-edited forward's (logits and gradients, float64), in every layout, under activation
checkpointing, beside a mixer, and copied or resumed; what cannot be erased is refused in one line."""

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torchvision.transforms.v2 import functional as TF

import mixhook
from mixhook import Cutout, ManifoldMixup, RandomErasing
from mixhook.functional import generator_on
from tests.helpers import SmallCNN, grads


def _gen(seed: int = 3) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _replayed(hook, state, n, height, width, shape, dtype=torch.float64):
    """The rectangles and (random) values a forward drew from the generator state ``state``: what the hook
    draws, drawn again."""
    g = torch.Generator().set_state(state)
    boxes = hook.boxes(n, height, width, g)
    values = torch.randn(shape, generator=generator_on(torch.device("cpu"), g), dtype=dtype)
    return boxes, values


def _input_of(module: nn.Module, seen: list):
    return module.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))


# ------------------------------------------------------------------------------------- the method


def test_the_rectangles_are_the_authors_algorithm_on_the_same_draws():
    """zhunzhong07/Random-Erasing transforms.py (RandomErasing.__call__), with each random.uniform and
    random.randint replaced by the uniform draw mixhook made for it: the same rectangle for every sample
    (some samples left out by p, some after several attempts, a 9x7 map where few fit)."""
    for height, width, attempts in ((28, 28, 100), (9, 7, 3)):
        hook = RandomErasing(p=0.7, scale=(0.02, 0.4), ratio=(0.3, 1 / 0.3), attempts=attempts)
        n, g = 64, _gen(11)
        state = g.get_state()
        boxes = hook.boxes(n, height, width, g)
        r = torch.Generator().set_state(state)
        chance, u_area, u_ratio, u_top, u_left = (
            torch.rand(size, generator=r, dtype=torch.float64)
            for size in (n, (n, attempts), (n, attempts), n, n)
        )
        sl, sh, r1 = 0.02, 0.4, 0.3
        expected = []
        for i in range(n):
            box = (0, 0, 0, 0)
            if chance[i] < 0.7:  # (theirs: `if random.uniform(0, 1) > self.probability: return img`)
                for attempt in range(attempts):
                    area = height * width
                    target_area = (
                        sl + (sh - sl) * float(u_area[i, attempt])
                    ) * area  # random.uniform(sl, sh)
                    aspect_ratio = r1 + (1 / r1 - r1) * float(u_ratio[i, attempt])  # random.uniform(r1, 1/r1)
                    h = int(round(math.sqrt(target_area * aspect_ratio)))
                    w = int(round(math.sqrt(target_area / aspect_ratio)))
                    if w < width and h < height:
                        x1 = math.floor(float(u_top[i]) * (height - h + 1))  # random.randint(0, H - h)
                        y1 = math.floor(float(u_left[i]) * (width - w + 1))
                        box = (x1, y1, h, w)
                        break
            expected.append(box)
        assert boxes.tolist() == [list(b) for b in expected]
        erased = boxes[:, 2] > 0
        assert 0 < erased.sum() < n  # (both kinds of sample are there)
        area = (boxes[erased, 2] * boxes[erased, 3]).double() / (height * width)
        assert area.max() <= 0.4 * 1.3 and (boxes[:, 0] + boxes[:, 2] <= height).all()
        assert (boxes[:, 1] + boxes[:, 3] <= width).all()


def test_the_rectangles_follow_the_papers_distribution():
    """Over many draws: a share p erased, areas spread over [0.02, 0.4] of the map, aspect ratios over
    [0.3, 3.33] (uniform: mean 1.82; log: mean 1.26), every place reached."""
    n = 20_000
    for aspect, mean_ratio in (
        ("uniform", (0.3 + 1 / 0.3) / 2),
        ("log", (1 / 0.3 - 0.3) / math.log(1 / 0.09)),
    ):
        boxes = RandomErasing(p=0.5, aspect=aspect).boxes(n, 64, 64, _gen(1))
        erased = boxes[boxes[:, 2] > 0]
        assert abs(len(erased) / n - 0.5) < 0.02
        area = (erased[:, 2] * erased[:, 3]).double() / 64**2
        assert 0.015 < area.min() and area.max() < 0.45 and abs(area.mean() - 0.21) < 0.02
        ratio = erased[:, 2].double() / erased[:, 3]
        assert abs(ratio.mean() - mean_ratio) < 0.1  # (its sides are rounded: a little off the draw's)
        assert erased[:, 0].min() == 0 and (erased[:, 0] + erased[:, 2]).max() == 64


def test_at_the_input_it_is_torchvisions_erase_with_the_same_rectangles_and_values():
    model = SmallCNN().double().train()
    x = torch.randn(16, 3, 12, 10, dtype=torch.float64)
    for value in ("random", 0.5, [0.1, -0.2, 0.3]):
        hook = RandomErasing(p=0.8, value=value, generator=_gen())
        state = hook.generator.get_state()
        seen = []
        handle = _input_of(model.conv1, seen)
        with hook.attach(model):
            model(x)
        handle.remove()
        boxes, noise = _replayed(hook, state, 16, 12, 10, x.shape)
        assert torch.equal(boxes, hook.last)
        fill = (
            noise if value == "random" else torch.tensor(value, dtype=x.dtype).view(-1, 1, 1).expand_as(x[0])
        )
        for i, (top, left, h, w) in enumerate(boxes.tolist()):
            v = (noise[i] if value == "random" else fill)[:, top : top + h, left : left + w]
            assert torch.equal(seen[0][i], TF.erase(x[i], top, left, h, w, v)), (value, i)
        assert not torch.equal(seen[0], x)  # (it erased something)


class _Net(nn.Module):
    """conv1 - ReLU - conv2 - pool - linear; ``erase`` (hand-edited): conv1's output erased in place."""

    def __init__(self, erase=None):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2, self.fc = (
            nn.Conv2d(2, 4, 3, padding=1),
            nn.Conv2d(4, 5, 3, padding=1),
            nn.Linear(5, 3),
        )
        self.erase = erase

    def forward(self, x):
        h = self.conv1(x)
        if self.erase is not None:
            boxes, values = self.erase
            h = h.clone()
            for i, (top, left, rows, cols) in enumerate(boxes.tolist()):
                h[i, :, top : top + rows, left : left + cols] = values[
                    i, :, top : top + rows, left : left + cols
                ]
        return self.fc(F.relu(self.conv2(F.relu(h))).mean((2, 3)))


@pytest.mark.parametrize("value", ["random", [0.5, -1.0, 0.0, 2.0]])
def test_at_a_hidden_layer_logits_and_gradients_are_a_hand_edited_forwards(value):
    x, y = torch.randn(8, 2, 9, 9, dtype=torch.float64), torch.randint(0, 3, (8,))
    model = _Net().double().train()
    hook = RandomErasing("conv1", p=0.75, value=value, generator=_gen(5))
    state = hook.generator.get_state()
    with hook.attach(model):
        out = model(x)
        F.cross_entropy(out, y).backward()
    boxes, noise = _replayed(hook, state, 8, 9, 9, (8, 4, 9, 9))
    values = (
        noise
        if value == "random"
        else torch.tensor(value, dtype=x.dtype).view(1, -1, 1, 1).expand(8, 4, 9, 9)
    )
    hand = _Net((boxes, values)).double().train()
    expected = hand(x)
    F.cross_entropy(expected, y).backward()
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    for name, g in grads(model).items():
        assert torch.allclose(g, grads(hand)[name], atol=1e-12, rtol=0), name
    plain = _Net().double().train()
    assert not torch.allclose(out, plain(x))  # it changes the forward
    model.eval()
    with hook.attach(model):
        assert torch.equal(model(x), plain.eval()(x))  # evaluation: the model as it is


def test_a_channels_last_map_is_erased_over_its_height_and_width():
    """A (B, H, W, C) map (a LayerNorm over its channels states it; or declared) is erased over H and W, as
    its (B, C, H, W) view would be; undeclared where nothing states it, it is refused in one line."""

    class Nhwc(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(4)  # (a 4-D output of a LayerNorm over the last dim: NHWC)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.norm(x.permute(0, 2, 3, 1)).mean((1, 2)))

    x = torch.randn(6, 4, 8, 5, dtype=torch.float64)
    model = Nhwc().double().train()
    seen = []
    model.norm.register_forward_hook(lambda m, a, o: seen.append(o.detach().clone()))
    model(x)  # (not hooked: the map as it is)
    hook = RandomErasing("norm", p=1.0, value=7.0, generator=_gen())
    with hook.attach(model):
        model(x)  # (its hook runs first: the other one sees the erased map)
    boxes = hook.last
    assert (
        (boxes[:, 2] > 0).all()
        and (boxes[:, 0] + boxes[:, 2] <= 8).all()
        and (boxes[:, 1] + boxes[:, 3] <= 5).all()
    )
    channels_first = seen[0].permute(0, 3, 1, 2).clone()  # (B, C, H, W)
    for i, (top, left, h, w) in enumerate(boxes.tolist()):
        channels_first[i, :, top : top + h, left : left + w] = 7.0
    assert torch.equal(seen[1], channels_first.permute(0, 2, 3, 1))

    class Permuting(nn.Module):  # a (B, H, W, C) map from forward code, next to channels-last modules
        def __init__(self):
            super().__init__()
            self.conv, self.mlp = nn.Conv2d(3, 4, 1), nn.Linear(4, 2)
            self.act = nn.GELU()

        def forward(self, x):
            return self.mlp(self.act(self.conv(x).permute(0, 2, 3, 1))).mean((1, 2))

    net = Permuting().train()
    with RandomErasing("act").attach(net), pytest.raises(TypeError) as info:
        net(torch.randn(2, 3, 12, 12))  # (read as NCHW: 12x4, not the input's 12x12 over a stride)
    assert "this (2, 12, 12, 4) map 12x4, but the model's input is 12x12" in str(info.value)
    assert "declare layout='NHWC' if it is such a map" in str(info.value) and "\n" not in str(info.value)
    declared = RandomErasing("act", layout="NHWC", p=1.0, generator=_gen())
    with declared.attach(net):
        net(torch.randn(2, 3, 12, 12))
    assert (declared.last[:, 2] > 0).all() and (declared.last[:, 0] + declared.last[:, 2] <= 12).all()


def test_what_is_not_one_map_is_refused_in_one_line():
    tokens = nn.Sequential(nn.Linear(4, 4)).train()
    with RandomErasing("0").attach(tokens), pytest.raises(TypeError) as info:
        tokens(torch.randn(2, 5, 4))
    assert "erases a rectangle of one (B, C, H, W) map, and the output is" in str(info.value)
    model = SmallCNN().train()
    with RandomErasing("conv1", value=[1.0, 2.0]).attach(model), pytest.raises(ValueError) as info:
        model(torch.randn(2, 3, 6, 6))
    assert (
        str(info.value) == "RandomErasing: value has 2 numbers, one per channel, and the map has 8 channels"
    )
    for kwargs, message in (
        ({"p": 1.5}, "p must be a probability in [0, 1], got 1.5"),
        ({"scale": (0.5, 0.1)}, "scale must be (low, high) with 0 < low <= high, <= 1, got (0.5, 0.1)"),
        ({"scale": (0.0, 0.4)}, "scale must be (low, high) with 0 < low <= high, <= 1, got (0.0, 0.4)"),
        ({"ratio": (0.3,)}, "ratio must be (low, high) with 0 < low <= high, finite, got (0.3,)"),
        ({"value": "noise"}, "value must be 'random', a finite number or one finite number per channel"),
        ({"aspect": "square"}, "aspect must be one of uniform, log, got 'square'"),
        ({"attempts": 0}, "attempts must be an int >= 1, got 0"),
    ):
        with pytest.raises(ValueError) as info:
            RandomErasing(**kwargs)
        assert str(info.value).startswith(f"RandomErasing: {message}")
    with pytest.raises(ValueError, match="Cutout: size must be the square's side in pixels"):
        Cutout(size=1.5)


def test_activation_checkpointing_erases_the_same_rectangles_with_the_same_values():
    class Checkpointed(_Net):
        def forward(self, x):
            h = checkpoint(lambda t: F.relu(self.conv1(t)), x, use_reentrant=False)
            return self.fc(F.relu(self.conv2(h)).mean((2, 3)))

    x, y = torch.randn(6, 2, 9, 9, dtype=torch.float64), torch.randint(0, 3, (6,))
    results = []
    for cls in (_Net, Checkpointed):
        model = cls().double().train()
        hook = RandomErasing("conv1", p=0.9, generator=_gen(7))
        with hook.attach(model):
            F.cross_entropy(model(x), y).backward()
        results.append((hook.last, grads(model), hook.generator.get_state()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][2], results[1][2])
    for name, g in results[0][1].items():
        assert torch.allclose(g, results[1][1][name], atol=1e-12, rtol=0), name


@pytest.mark.parametrize("order", ["erasing first", "mixer first"])
@pytest.mark.parametrize("layer", ["input", "conv1"])
def test_beside_a_mixer_the_map_is_erased_then_mixed(order, layer):
    """Whatever the order of attaching, at one layer the mixer mixes the erased map, as after a data
    pipeline's erasing: h' = lam * e + (1 - lam) * e[index], e the erased map."""
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    model = SmallCNN().double().train()
    erasing = RandomErasing(layer, p=1.0, value=0.0, generator=_gen(1))
    mixer = ManifoldMixup(layer, alpha=1.0, generator=_gen(2))
    after = model.conv1 if layer == "input" else model.act
    seen = []
    after.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    hooks = (erasing, mixer) if order == "erasing first" else (mixer, erasing)
    with mixhook.attach(model, *hooks):
        model(x)
    alone = SmallCNN().double().train()
    alone.load_state_dict(model.state_dict())
    seen_alone = []
    (alone.conv1 if layer == "input" else alone.act).register_forward_pre_hook(
        lambda m, a: seen_alone.append(a[0].detach().clone())
    )
    with RandomErasing(layer, p=1.0, value=0.0, generator=_gen(1)).attach(alone):
        alone(x)
    e = seen_alone[0]
    lam, index = float(mixer.last.lam), mixer.last.index
    assert torch.allclose(seen[0], lam * e + (1 - lam) * e[index], atol=1e-12)
    assert torch.equal(erasing.last, RandomErasing(layer, p=1.0, generator=_gen(1)).boxes(8, 8, 8, _gen(1)))


def test_a_saliency_mixers_gradient_pass_sees_the_input_erased_once():
    """SaliencyMix's gradient pass runs the model in eval mode: the erasing does not act (nor draw) again
    there, so the pass reads the erased input the mix then cuts."""
    x, y = torch.randn(8, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (8,))
    model = SmallCNN().double().train()
    erasing = RandomErasing(p=1.0, value=0.0, generator=_gen(1))
    mixer = mixhook.SaliencyMix("input", saliency="gradient", generator=_gen(2))
    with mixhook.attach(model, mixer, erasing):
        mixer.use_targets(y)
        model(x)
    once = RandomErasing(p=1.0, value=0.0, generator=_gen(1))
    once.boxes(8, 8, 8, once.generator)
    assert torch.equal(erasing.generator.get_state(), once.generator.get_state())  # one draw only


def test_state_copies_and_removal():
    """state_dict() resumes the same rectangles; a copy of the hooked model erases nothing; a pickled hook
    keeps its settings and generator, detached; remove() leaves the model as it was."""
    x = torch.randn(4, 3, 8, 8)
    first = RandomErasing("conv1", p=0.9, generator=_gen(4))
    model = SmallCNN().train()
    with first.attach(model):
        model(x)
        state = first.state_dict()
        model(x)
        after = first.last.clone()
        copied = copy.deepcopy(model)
        twin = SmallCNN().train()
        twin.load_state_dict(model.state_dict())
        assert torch.equal(copied(x), twin(x))  # (the copy has none of the hooks)
    resumed = RandomErasing("conv1", p=0.9, generator=_gen(99))
    resumed.load_state_dict(state)
    with resumed.attach(model):
        model(x)
    assert torch.equal(resumed.last, after)
    restored = pickle.loads(pickle.dumps(first))
    assert (
        restored.model is None
        and restored.p == 0.9
        and torch.equal(restored.generator.get_state(), first.generator.get_state())
    )
    plain = SmallCNN().train()
    plain.load_state_dict(model.state_dict())
    assert torch.equal(model(x), plain(x))  # (removed: nothing erased)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_autocast_keeps_the_maps_dtype():
    model = SmallCNN().train()
    hook = RandomErasing("conv1", p=1.0, generator=_gen())
    seen = []
    model.act.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with hook.attach(model), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(4, 3, 8, 8))
    assert seen[0].dtype == torch.bfloat16


# -------------------------------------------------------------------------------------------- Cutout


def test_cutout_is_the_authors_code_on_the_same_centres():
    """uoguelph-mlrg/Cutout util/cutout.py (Cutout.__call__), its np.random.randint replaced by the centres
    mixhook drew: the same squares, clipped at the edges, and the same image (theirs multiplies by the
    mask: 0 where cut)."""
    n, height, width, length, holes = 12, 11, 9, 6, 2
    hook = Cutout(size=length, holes=holes, generator=_gen(8))
    g = _gen(8)
    state = g.get_state()
    boxes = hook.boxes(n, height, width, g)
    r = torch.Generator().set_state(state)
    torch.rand(n, generator=r, dtype=torch.float64)  # (each sample's chance: p = 1)
    ys, xs = torch.randint(height, (n, holes), generator=r), torch.randint(width, (n, holes), generator=r)
    img = torch.randn(n, 3, height, width)
    model = nn.Sequential(nn.Identity()).train()
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with Cutout(size=length, holes=holes, generator=_gen(8)).attach(model):
        model(img)
    for i in range(n):
        mask = torch.ones(height, width)
        for k in range(holes):
            y, x = int(ys[i, k]), int(xs[i, k])
            y1, y2 = max(0, min(y - length // 2, height)), max(0, min(y + length // 2, height))  # np.clip
            x1, x2 = max(0, min(x - length // 2, width)), max(0, min(x + length // 2, width))
            mask[y1:y2, x1:x2] = 0.0
            assert boxes[i, k].tolist() == [y1, x1, y2 - y1, x2 - x1]
        assert torch.equal(seen[0][i], img[i] * mask.expand_as(img[i]))
    assert Cutout(size=0.5).side(28, 20) == 10 and Cutout(size=14).side(7, 7) == 14
    # CIFAR's 16 pixels on digits' 8x8 images: every square would cover the whole image, wherever centred
    net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1)).train()
    with Cutout(size=16).attach(net), pytest.raises(ValueError) as info:
        net(torch.randn(2, 1, 8, 8))
    assert str(info.value).startswith("Cutout at 'input': its 16-pixel square covers the whole 8x8 map")
    with Cutout(size=15, generator=_gen()).attach(net):  # (centred at the far corner it leaves a row)
        net(torch.randn(2, 1, 8, 8))


def test_a_batch_norm_that_a_mixer_normalises_apart_is_refused_in_either_order():
    """AutoMix and a SUMix policy normalise their clean and mixed rows apart at every batch-norm layer,
    computing its output again after the layer's hooks: erasing that output would be dropped (silently, in
    one attach order): refused in one line, whatever the order; the layer after it is erased as usual."""
    from mixhook import CutMix
    from mixhook.policies import SUMix

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.act, self.fc = (
                nn.Conv2d(3, 4, 3, padding=1),
                nn.BatchNorm2d(4),
                nn.ReLU(),
                nn.Linear(4, 3),
            )

        def forward(self, x):
            return self.fc(self.act(self.bn(self.conv(x))).mean((2, 3)))

    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 0])
    for first in (True, False):
        net = Net().train()
        mixer = CutMix("input", generator=_gen()).use(SUMix("fc"))
        erasing = RandomErasing("bn", p=1.0, generator=_gen())
        with (
            mixhook.attach(net, *((erasing, mixer) if first else (mixer, erasing))),
            pytest.raises(ValueError) as info,
        ):
            mixer.use_targets(y)
            net(x)
        assert str(info.value).startswith(
            "RandomErasing at 'bn': CutMix with SUMix normalises its clean and mixed rows apart at each"
        )
    net = Net().train()
    mixer = CutMix("input", generator=_gen()).use(SUMix("fc"))
    with mixhook.attach(net, mixer, RandomErasing("act", p=1.0, generator=_gen())):
        mixer.use_targets(y)
        net(x)
