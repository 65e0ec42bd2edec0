"""SUMix's loss policy: against the authors' IN_loss on the same CutMix (loss, the gradients of the model and
of the uncertainty layer, batch norm's running statistics, float64), its per-sample reading, the logits as
the uncertainty, at a hidden layer, the state and parameters it adds to its mixer, the refusals."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixhook import CutMix, ManifoldMixup, RegMixup
from mixhook.policies import SUMix
from tests.helpers import assert_same_step


class Net(nn.Module):
    """A small CNN with batch norm and a pooled Linear classifier named ``fc`` (the authors' ResNet's
    shape: a backbone, global pooling, a head)."""

    def __init__(self, classes=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)

    def features(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x))).mean((2, 3))

    def forward(self, x):
        return self.fc(self.features(x))


def net():
    torch.manual_seed(0)
    model = Net().double().train()
    with torch.no_grad():
        model.fc.weight.normal_(0, 1.0)  # (predictions far from uniform: the semantic weights move)
    return model


# From JinXins/SUMix, openmixup/models/heads/cls_mixup_head.py: ClsUncertainMixupHead.l2_norm,
# forward_head (is_norm) and IN_loss, as functions (self.criterion: a batch-mean cross-entropy; `.cuda()`
# and `device='cuda'` dropped; lam_a and lam_b made float64 where theirs are float32, the check being in
# float64).
def l2_norm(x):
    buffer = torch.pow(x, 2)
    norm = torch.sqrt(torch.sum(buffer, 1))
    output = torch.div(x, norm.view(-1, 1))
    return output


def forward_head(fc, uncertain, x, is_norm=True):
    x_cls = fc(x)
    if is_norm:
        x_uncertain = l2_norm(F.softmax(uncertain(x), dim=-1))
        return x_cls, x_uncertain
    return x_cls, x_cls


def IN_loss(score, labels, rand_index, gama, criterion=F.cross_entropy):  # noqa: N802
    y_a, y_b, lam = labels
    cls_one, cls_mix = score[0][0], score[1][0]
    uncertain_one, uncertain_mix = score[0][1], score[1][1]
    uncertain_one_ = uncertain_one[rand_index,]
    if isinstance(lam, torch.Tensor):
        lam = lam.view(-1, 1)
    avg_factor = y_a.size(0)
    sf = nn.Softmax(dim=-1)
    semantic_one, semantic_mix = sf(cls_one.clone().detach()), sf(cls_mix.clone().detach())
    semantic_one_ = semantic_one[rand_index,]
    for i in range(0, avg_factor):
        semantic_one[i, y_b[i]] = 0
        semantic_one_[i, y_a[i]] = 0
    alpha = l2_norm(sf(semantic_mix - semantic_one)) * avg_factor
    alpha_ = l2_norm(sf(semantic_mix - semantic_one_)) * avg_factor
    beta = uncertain_one + uncertain_mix
    beta_ = uncertain_one_ + uncertain_mix
    INa = torch.exp(-alpha)  # noqa: N806
    INb = torch.exp(-alpha_)  # noqa: N806
    INa_f = torch.exp(-(beta + alpha))  # noqa: N806
    INb_f = torch.exp(-(beta_ + alpha_))  # noqa: N806
    lam_a = torch.ones([avg_factor], dtype=torch.float64)
    lam_b = torch.ones([avg_factor], dtype=torch.float64)
    for i in range(INa.shape[0]):
        lam_a[i] = lam * INa[i, y_a[i]]
        lam_b[i] = (1 - lam) * INb[i, y_b[i]]
    lam_a = lam_a / (lam_a + lam_b)
    lam_b = 1 - lam_a
    return torch.mean(criterion(cls_mix, y_a) * lam_a + criterion(cls_mix, y_b) * lam_b) + gama * (
        criterion(INa_f, y_a) * lam + criterion(INb_f, y_b) * (1 - lam)
    )


def sumix(**kwargs):
    options = {"gamma": 0.5, **kwargs}
    layer = options.pop("layer", "input")
    return CutMix(layer, generator=torch.Generator().manual_seed(0)).use(SUMix("fc", **options))


BOX, INDEX = (1, 5, 2, 7), torch.tensor([2, 0, 3, 5, 1, 4])


def authors_step(model, uncertain, x, y, is_norm=True, gama=0.5):
    """mixup_classification.py's is_IN branch with CutMix on the same box and partners: the clean forward
    (with gradients), the mixed forward, IN_loss."""
    x_ori = model.features(x.clone().detach())
    outs_ori = forward_head(model.fc, uncertain, x_ori, is_norm)
    y1, y2, x1, x2 = BOX
    mixed = x.clone()
    mixed[:, :, y1:y2, x1:x2] = x[INDEX][:, :, y1:y2, x1:x2]
    lam = 1 - (y2 - y1) * (x2 - x1) / (x.shape[2] * x.shape[3])
    outs_mix = forward_head(model.fc, uncertain, model.features(mixed), is_norm)
    return IN_loss((outs_ori, outs_mix), (y, y[INDEX], lam), INDEX, gama)


@pytest.mark.parametrize("uncertainty", ["own", "logits"])
def test_the_loss_gradients_and_running_statistics_equal_the_authors(uncertainty):
    model, x, y = net(), torch.randn(6, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3, 1, 0])
    plain = copy.deepcopy(model)
    mix = sumix(uncertainty=uncertainty)
    with mix.attach(model):
        assert mix.clean  # (use() set it: the clean batch beside the mix)
        uncertain = copy.deepcopy(mix.policies[0].layer) if uncertainty == "own" else None
        mix.pin(box=BOX, index=INDEX)
        logits = model(x)
        assert logits.shape == (12, 4)
        loss = mix.loss(F.cross_entropy, logits, y)
    loss.backward()
    expected = authors_step(plain, uncertain, x, y, is_norm=uncertainty == "own")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    if uncertainty == "own":
        for a, b in zip(mix.parameters(), uncertain.parameters(), strict=True):
            assert a.grad is not None and a.grad.abs().sum() > 0
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    else:
        assert list(mix.parameters()) == []
    for name in ("bn1", "bn2"):  # (the clean half then the mixed, apart: the authors' two forwards)
        for stat in ("running_mean", "running_var"):
            torch.testing.assert_close(
                getattr(getattr(model, name), stat),
                getattr(getattr(plain, name), stat),
                rtol=1e-12,
                atol=1e-14,
            )
    lam = 1 - 4 * 5 / 64  # (the semantic weights and the term changed the loss: not plain CutMix's)
    mixed_logits = logits[6:].detach()
    cutmix_loss = lam * F.cross_entropy(mixed_logits, y) + (1 - lam) * F.cross_entropy(mixed_logits, y[INDEX])
    assert abs(float(loss.detach()) - float(cutmix_loss)) > 1e-3


def test_per_sample_weighs_each_samples_loss_by_its_own_weights():
    """reduce='per_sample' (the paper's formula): each sample's two losses by its own weights, written out
    by hand from the forward's logits and the uncertainty of each half (batch norm apart, as the two
    halves' own forwards)."""
    model, x, y = net(), torch.randn(6, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3, 1, 0])
    mix = sumix(reduce="per_sample")
    per_sample = lambda o, t: F.cross_entropy(o, t, reduction="none")  # noqa: E731
    with mix.attach(model):
        layer = mix.policies[0].layer
        mix.pin(box=BOX, index=INDEX)
        logits = model(x)
        loss = mix.loss(per_sample, logits, y)
    clean, mixed, rows = logits[:6], logits[6:], torch.arange(6)
    with torch.no_grad():
        p, q = F.softmax(clean, 1), F.softmax(mixed, 1)
        s_a, s_b = p.clone(), p[INDEX].clone()
        s_a[rows, y[INDEX]] = 0
        s_b[rows, y] = 0
        a, b = l2_norm(F.softmax(q - s_a, 1)) * 6, l2_norm(F.softmax(q - s_b, 1)) * 6
        lam = 1 - 4 * 5 / 64
        w_a = lam * torch.exp(-a)[rows, y]
        w_b = (1 - lam) * torch.exp(-b)[rows, y[INDEX]]
        w_a = w_a / (w_a + w_b)
        y1, y2, x1, x2 = BOX
        xm = x.clone()
        xm[:, :, y1:y2, x1:x2] = x[INDEX][:, :, y1:y2, x1:x2]
        u_c = l2_norm(F.softmax(layer(model.features(x)), 1))
        u_m = l2_norm(F.softmax(layer(model.features(xm)), 1))
        f_a, f_b = torch.exp(-(u_c + u_m + a)), torch.exp(-(u_c[INDEX] + u_m + b))
        expected = w_a * per_sample(mixed, y) + (1 - w_a) * per_sample(mixed, y[INDEX])
        expected = expected + 0.5 * (lam * per_sample(f_a, y) + (1 - lam) * per_sample(f_b, y[INDEX]))
    assert loss.shape == (6,) and w_a.std() > 1e-3  # (weights that differ between samples)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-13)


def test_at_a_hidden_layer_and_with_blending_mixers():
    """SUMix on any two-sample mixer: Manifold Mixup at conv2, the loss finite and its gradients reaching
    the uncertainty layer and the layers before the mix (through the clean rows' uncertainty)."""
    model, x, y = net(), torch.randn(6, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3, 1, 0])
    mix = ManifoldMixup("conv2", generator=torch.Generator().manual_seed(1)).use(SUMix("fc"))
    with mix.attach(model):
        loss = mix.loss(F.cross_entropy, model(x), y)
    loss.backward()
    assert torch.isfinite(loss) and model.conv1.weight.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mix.parameters())


def test_the_uncertainty_layer_is_saved_loaded_and_made_from_the_mixers_seed():
    a = sumix()
    with a.attach(net()):
        with torch.no_grad():
            a.policies[0].layer.weight.add_(1.0)
        state = a.state_dict()
    assert set(state["policies"]) == {"loss"}
    torch.save(state, buffer := __import__("io").BytesIO())
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    late = sumix()
    late.load_state_dict(state)  # (before attach: loaded when the layer is made)
    with late.attach(net()):
        torch.testing.assert_close(late.policies[0].layer.weight, a.policies[0].layer.weight, rtol=0, atol=0)
    fresh = sumix()
    with fresh.attach(net()):
        torch.testing.assert_close(
            fresh.policies[0].layer.weight, a.policies[0].layer.weight - 1, rtol=0, atol=0
        )
        assert fresh.policies[0].layer.weight.dtype == torch.float64  # (the classifier's)
    with pytest.raises(
        ValueError, match="^load_state_dict\\(\\): the state holds policies' \\(loss\\), and CutMix uses none"
    ):
        CutMix("input").load_state_dict(state)


def test_a_copy_of_the_mixer_and_a_removed_one_keep_no_model():
    """A pickle of a mixer with SUMix (an EMA copy of a training setup) holds the uncertainty layer but not
    the model's classifier; nor does the policy once its mixer is removed (the model can be freed)."""
    import gc
    import pickle
    import weakref

    mix, model = sumix(), net()
    with mix.attach(model):
        copied = pickle.loads(pickle.dumps(mix))
    assert copied.policies[0]._like is None and copied.policies[0].layer is not None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and mix.policies[0]._like is None and mix.policies[0].layer is not None


def test_refusals_are_one_line():
    model = net()
    with pytest.raises(TypeError, match="^SUMix's loss replaces the whole loss, and RegMixup's has terms"):
        RegMixup("input").use(SUMix("fc"))
    with pytest.raises(TypeError, match="^SUMix: classifier='bn2' is a BatchNorm2d, not the Linear"):
        CutMix("input").use(SUMix("bn2")).attach(model)
    with pytest.raises(ValueError, match="^uncertainty must be one of own, logits, got 'x'$"):
        SUMix("fc", uncertainty="x")
    with pytest.raises(ValueError, match="^reduce must be one of authors, per_sample, got 'mean'$"):
        SUMix("fc", reduce="mean")
    mix = CutMix("input").use(SUMix("fc"))
    mix.clean = False
    with pytest.raises(
        ValueError, match="^SUMix reads the clean rows beside the mix, and CutMix.clean is False"
    ):
        mix.attach(model)
    mix = sumix(reduce="per_sample")
    with mix.attach(model):
        logits = model(torch.randn(6, 3, 8, 8, dtype=torch.double))
        with pytest.raises(ValueError, match="^loss\\(\\): SUMix with reduce='per_sample' weighs each"):
            mix.loss(F.cross_entropy, logits, torch.tensor([0, 1, 2, 3, 1, 0]))
        with pytest.raises(ValueError, match="^targets\\(\\)"):
            mix.targets(torch.tensor([0, 1, 2, 3, 1, 0]), 4)
    with pytest.raises(
        ValueError, match="^SUMix reads each partner's clean prediction among the batch's, and Bal"
    ):
        CutMix("input").use(SUMix("fc"), __import__("mixhook").policies.BalancedMixup()).attach(model)
    with pytest.raises(
        ValueError, match="^SUMix reads each partner's clean prediction, which another rank holds"
    ):
        ManifoldMixup("input", partners="global").use(SUMix("fc"))
    with pytest.raises(TypeError, match="^SUMix's loss replaces the whole loss, and AutoMix's has terms"):
        __import__("mixhook").AutoMix("input").use(SUMix("fc"))


def test_a_oneof_shares_one_uncertainty_layer_between_its_mixers():
    """``OneOf([...]).use(SUMix(...))``: every mixer takes the same policy, so one uncertainty layer, given
    once by the OneOf's parameters(); each forward's loss is its chosen mixer's, finite, and trains it."""
    from mixhook import OneOf

    model, x, y = net(), torch.randn(6, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3, 1, 0])
    policy = SUMix("fc")
    both = OneOf([CutMix("input"), ManifoldMixup("conv2")], generator=torch.Generator().manual_seed(0))
    both.use(policy)
    with both.attach(model):
        params = list(both.parameters())
        assert len(params) == 2 and all(any(p is q for q in policy.layer.parameters()) for p in params)
        for choice in (0, 1):
            both.pin(choice=choice)
            loss = both.loss(F.cross_entropy, model(x), y)
            loss.backward()
            assert torch.isfinite(loss) and policy.layer.weight.grad.abs().sum() > 0
            policy.layer.zero_grad()


def test_at_a_hidden_layer_it_equals_the_authors_loss_on_the_hand_split_forward():
    """Manifold Mixup at conv2 with SUMix: the layers before the mix run once on the batch; after it, the
    clean and mixed rows apart (bn2 normalises each by its own statistics, updated by the clean then the
    mixed). The authors' IN_loss on those two halves, computed by hand: loss, gradients, running stats."""
    model, x, y = net(), torch.randn(6, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3, 1, 0])
    plain = copy.deepcopy(model)
    mix = ManifoldMixup("conv2", generator=torch.Generator().manual_seed(1)).use(SUMix("fc"))
    with mix.attach(model):
        uncertain = copy.deepcopy(mix.policies[0].layer)
        mix.pin(lam=0.3, index=INDEX)
        loss = mix.loss(F.cross_entropy, model(x), y)
    loss.backward()
    h = plain.conv2(F.relu(plain.bn1(plain.conv1(x))))
    mixed = 0.3 * h + 0.7 * h[INDEX]
    pooled = [F.relu(plain.bn2(t)).mean((2, 3)) for t in (h, mixed)]  # (bn2 apart: clean, then mixed)
    outs = [forward_head(plain.fc, uncertain, f) for f in pooled]
    expected = IN_loss(outs, (y, y[INDEX], 0.3), INDEX, 0.5)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-13)
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    for name in ("bn1", "bn2"):
        torch.testing.assert_close(getattr(model, name).running_var, getattr(plain, name).running_var)


def test_use_turns_clean_on_and_back_and_keeps_a_clean_set_before():
    mix = CutMix("input").use(SUMix("fc"))
    assert mix.clean
    mix.use()
    assert not mix.clean  # (SUMix gone: the mixer trains on its mix alone again)
    kept = ManifoldMixup("input")
    kept.clean = True
    kept.use(SUMix("fc"))
    kept.use()
    assert kept.clean  # (what it was before SUMix)


def test_a_large_batch_over_few_classes_gives_finite_weights():
    """At 512 samples over 4 confident classes the authors' two exponentials underflow to 0 (their weight
    0/0, NaN) for some samples; the log-ratio gives a finite loss."""
    torch.manual_seed(0)
    model = Net().train()
    with torch.no_grad():
        model.fc.weight.normal_(0, 4.0)
    x, y = torch.randn(512, 3, 8, 8), torch.randint(0, 4, (512,))
    mix = CutMix("input", generator=torch.Generator().manual_seed(0)).use(SUMix("fc"))
    index = torch.randperm(512)
    with mix.attach(model):
        mix.pin(box=BOX, index=index)
        logits = model(x)
        loss = mix.loss(F.cross_entropy, logits, y)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():  # (the authors' weights on the same predictions: IN_loss's lines)
        p, q, rows = F.softmax(logits[:512], 1), F.softmax(logits[512:], 1), torch.arange(512)
        s_a, s_b = p.clone(), p[index].clone()
        s_a[rows, y[index]] = 0
        s_b[rows, y] = 0
        a, b = l2_norm(F.softmax(q - s_a, 1)) * 512, l2_norm(F.softmax(q - s_b, 1)) * 512
        lam = 1 - 4 * 5 / 64
        w_a, w_b = lam * torch.exp(-a)[rows, y], (1 - lam) * torch.exp(-b)[rows, y[index]]
    assert torch.isnan(w_a / (w_a + w_b)).any()


def _checkpointed_net(reentrant):
    from torch.utils.checkpoint import checkpoint

    class Wrapped(Net):
        def forward(self, x):
            return checkpoint(self.fc, self.features(x), use_reentrant=reentrant)

    torch.manual_seed(0)
    model = Wrapped().double().train()
    with torch.no_grad():
        model.fc.weight.normal_(0, 1.0)
    return model


def test_a_classifier_inside_a_non_reentrant_checkpoint_computes_what_a_plain_one_does():
    """The classifier recomputed in backward: the uncertainty layer's computation runs again with it (the
    tensors its graph saved), and the loss and every gradient equal the run without the checkpoint."""
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.double), torch.tensor([0, 1, 2, 3, 1, 0])
    found = []
    for model in (net(), _checkpointed_net(False)):
        mix = sumix()
        with mix.attach(model):
            mix.pin(box=BOX, index=INDEX)
            loss = mix.loss(F.cross_entropy, model(x), y)
            loss.backward()
            found.append((loss.detach(), [p.grad for p in (*model.parameters(), *mix.parameters())]))
    assert_same_step(*found)


def test_a_classifier_inside_a_reentrant_checkpoint_is_refused_in_one_line():
    """A reentrant checkpoint runs the classifier without gradients: the uncertainty term would train
    nothing, without a word."""
    model, x = _checkpointed_net(True), torch.randn(6, 3, 8, 8, dtype=torch.double).requires_grad_()
    mix = sumix()
    with mix.attach(model):
        logits = model(x)
        with pytest.raises(RuntimeError, match="^loss\\(\\): SUMix's uncertainty was computed without grad"):
            mix.loss(F.cross_entropy, logits, torch.tensor([0, 1, 2, 3, 1, 0]))


def test_more_refusals_from_the_review():
    from mixhook.policies import DecoupledLoss, LocalWeights, Remix

    model = net()
    for other in (Remix([1, 1, 1, 1]), LocalWeights(sigma=0.5)):
        name = type(other).__name__
        with pytest.raises(
            ValueError, match=f"^SUMix weighs the labels itself, and {name} changes the mixed"
        ):
            CutMix("input").use(SUMix("fc"), other).attach(model)
    with pytest.raises(
        RuntimeError, match="^SUMix: the uncertainty layer is made when its mixer is attached"
    ):
        list(sumix().parameters())
    assert list(sumix(uncertainty="logits").parameters()) == []
    policy, other_model = SUMix("fc"), net()
    with CutMix("input").use(policy).attach(model):
        with pytest.raises(
            ValueError, match="^SUMix is attached through another mixer to another classifier"
        ):
            CutMix("input").use(policy).attach(other_model)
    state = sumix()
    with state.attach(net()):
        saved = state.state_dict()
    with pytest.raises(
        ValueError, match="^SUMix.load_state_dict\\(\\): the state holds an uncertainty layer"
    ):
        sumix(uncertainty="logits").load_state_dict(saved)
    decoupled = CutMix("input", generator=torch.Generator().manual_seed(0)).use(DecoupledLoss())
    refused = (
        r"^load_state_dict\(\): the state holds a SUMix policy's \(loss\), and CutMix uses DecoupledLoss"
    )
    with pytest.raises(ValueError, match=refused):
        decoupled.load_state_dict(saved)
