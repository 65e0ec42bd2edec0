"""The fused blend (mixhook.fused): the Triton kernel's arithmetic run by Triton's interpreter on the CPU
against torch's lerp (a GPU runs the compiled kernel in tests/e2e/test_cuda.py), the torch.library op's
registration (opcheck), its gradients against the formula's in float64, and where blend() takes it."""

import pytest
import torch

from mixhook import ManifoldMixup, fused
from mixhook.functional import blend
from tests.helpers import fused_off_and_on

triton = pytest.importorskip("triton")
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from mixhook import fused_kernel  # noqa: E402  (imports Triton)

KERNEL = InterpretedFunction(fused_kernel.gather_lerp_kernel)


def _ulps(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """The largest difference of ``a`` and ``b`` in units of their dtype's spacing at ``scale`` (the
    larger of a lerp's two ends: a blend that cancels has its rounding error at the ends' scale)."""
    spacing = torch.finfo(b.dtype).eps * scale.double().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return ((a.double() - b.double()).abs() / spacing).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("shape", "layout"),
    [((6, 5, 7), None), ((4, 3, 5, 5), torch.channels_last), ((3, 2 * fused_kernel.BLOCK + 17), None)],
    ids=["3-d", "channels-last", "rows of three blocks"],
)
@pytest.mark.parametrize("lam", [0.3, 0.5, 0.7, 0.0, 1.0])
def test_the_kernel_is_torchs_lerp_of_the_gathered_rows(dtype, shape, layout, lam):
    torch.manual_seed(0)
    h = torch.randn(*shape).to(dtype)
    h = h if layout is None else h.contiguous(memory_format=layout)
    index = torch.randperm(shape[0])
    assert fused.fusable(h)
    out = fused_kernel.launch(KERNEL, h, index, lam)
    expected = torch.lerp(h.index_select(0, index), h, lam)
    assert out.stride() == h.stride() and out.dtype == dtype
    # both weigh in float32 with torch's formula; a fused multiply-add (torch's vectorized CPU kernel) may
    # round once less: at most one unit in the last place of the ends, and the output's rounding
    ends = torch.maximum(h.abs(), h.index_select(0, index).abs())
    assert _ulps(out, expected, ends) <= 1.0
    if lam in (0.0, 1.0):
        assert torch.equal(out, h if lam == 1.0 else h.index_select(0, index))


def test_what_the_kernel_does_not_take():
    h = torch.randn(4, 3, 5, 5)
    assert not fused.fusable(h.double())  # (no speed case: torch's ops)
    assert not fused.fusable(h.transpose(0, 1))  # a sample is no dense block
    assert not fused.fusable(h[:, :, :2])
    assert not fused.fusable(torch.randn(0, 3))
    assert not fused.fusable(
        torch.empty(2, fused.ROW_LIMIT + 1, device="meta")
    )  # (CUDA's grid: 65,535 blocks)
    assert fused.fusable(torch.empty(2, fused.ROW_LIMIT, device="meta"))
    assert fused.ROW_LIMIT == 65_535 * fused_kernel.BLOCK
    assert fused.fusable(h.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2))  # channels-last


@pytest.mark.slow
def test_the_op_is_registered_as_torch_checks_an_op():
    h = torch.randn(5, 3, 4, requires_grad=True)
    index = torch.randperm(5)
    torch.library.opcheck(fused.gather_lerp, (h, index, torch.argsort(index), 0.3))


def test_the_ops_gradients_are_the_formulas_to_second_order():
    torch.manual_seed(1)
    h = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    index = torch.randperm(6)
    inverse = torch.argsort(index)
    out = fused.gather_lerp(h, index, inverse, 0.3)
    assert torch.allclose(out, 0.3 * h + 0.7 * h[index], rtol=0, atol=1e-15)
    torch.autograd.gradcheck(lambda t: fused.gather_lerp(t, index, inverse, 0.3), (h,))
    torch.autograd.gradgradcheck(lambda t: fused.gather_lerp(t, index, inverse, 0.3), (h,))
    g = torch.randn(6, 4, dtype=torch.float64)
    (mine,) = torch.autograd.grad(fused.gather_lerp(h, index, inverse, 0.3), h, g)
    (formula,) = torch.autograd.grad(0.3 * h + 0.7 * h[index], h, g)
    assert torch.allclose(mine, formula, rtol=0, atol=1e-15)


def test_blend_takes_it_only_on_cuda_when_turned_on_and_mixes_the_same(monkeypatch):
    # on the CPU, turned on or not, a Manifold Mixup step is bit for bit the default's (the op is never
    # reached: its calls are counted)
    def step():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 3))
        mix = ManifoldMixup("1", generator=torch.Generator().manual_seed(3))
        mix.attach(net)
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        mix.loss(torch.nn.functional.cross_entropy, net(x), y).backward()
        return net[0].weight.grad

    grads, calls = fused_off_and_on(monkeypatch, step)
    assert torch.equal(*grads) and not calls
    assert not fused.enabled()
    h = torch.randn(32, 4096, requires_grad=True)
    fused.use(True)
    try:
        out = blend(h, 0.3, torch.randperm(32), permutation=True)
    finally:
        fused.use(False)
    assert not calls and out.grad_fn is not None
