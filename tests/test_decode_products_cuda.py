"""A step's matrix products in graphwrap's kernels (Triton) on a GPU: Llama's gated MLP's first
half in one (graphwrap/decoding/mlp.py) against transformers' LlamaMLP's own operations, and the
attention's query, key and value projections in one (graphwrap/decoding/qkv.py) against three
``F.linear``, over a step's rows (1 to 64) and the widths of the models served (the 1.1B shape,
a 7-8B shape, widths no tile divides, biases as Qwen2's); where they do not apply."""

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("triton", reason="needs Triton (torch's CUDA wheels bring it)")


@pytest.mark.parametrize("m,k,n", [(64, 2048, 5632), (1, 2048, 5632), (37, 4096, 14336), (5, 200, 300)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", [None, 1, 4])
def test_the_gated_kernel_equals_transformers_operations_to_rounding(m, k, n, dtype, split):
    from graphwrap.decoding import mlp

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 1, k, generator=g, device="cuda").to(dtype)
    wg = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    wu = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    kw = {} if split is None else {"split": split}  # None: the default
    got = mlp.gate_up(x, wg, wu, **kw)
    assert torch.equal(got, mlp.gate_up(x, wg, wu, **kw)), "the same result every run"
    own = mlp.reference(x, wg, wu)  # transformers' kernels: the products, SiLU, the product
    exact = mlp.reference(x.double(), wg.double(), wu.double())
    assert got.shape == (m, 1, n) and got.dtype == dtype
    err, own_err = (got.double() - exact).abs().max().item(), (own.double() - exact).abs().max().item()
    assert err <= 2 * own_err + 1e-3, (err, own_err)  # no further from the exact result than rounding puts own
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    torch.testing.assert_close(got, own, atol=tol, rtol=tol)


def test_where_the_gated_kernel_does_not_apply():
    from graphwrap.decoding import mlp

    def lin(bias=False, dtype=torch.float16):
        return torch.nn.Linear(64, 96, bias=bias, device="cuda", dtype=dtype)

    x = torch.randn(8, 1, 64, device="cuda", dtype=torch.float16)
    assert mlp.applies(x, lin(), lin())
    assert not mlp.applies(x, lin(bias=True), lin()), "a bias"
    assert not mlp.applies(x.float(), lin(dtype=torch.float32), lin(dtype=torch.float32)), "fp32: cuBLAS's"
    assert not mlp.applies(torch.randn(mlp.ROWS + 1, 64, device="cuda", dtype=torch.float16), lin(), lin()), \
        "more rows than a step's: cuBLAS's"
    assert not mlp.applies(x.cpu(), lin().cpu(), lin().cpu()), "not on the GPU"


@pytest.mark.parametrize("m,k,ns", [(64, 2048, (2048, 256, 256)), (1, 2048, (2048, 256, 256)),
                                    (37, 4096, (4096, 1024, 1024)), (5, 200, (96, 40, 40))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split", [None, 1, 4])
def test_the_projections_kernel_equals_three_linears_to_rounding(m, k, ns, dtype, bias, split):
    from graphwrap.decoding import qkv

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 1, k, generator=g, device="cuda").to(dtype)
    ws = [(torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype) for n in ns]
    bs = [torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None for n in ns]
    kw = {} if split is None else {"split": split}  # None: the default
    got = qkv.project(x, ws, bs, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, qkv.project(x, ws, bs, **kw))), "the same result every run"
    own = qkv.reference(x, ws, bs)  # cuBLAS's, one by one
    exact = qkv.reference(x.double(), [w.double() for w in ws], [b.double() if bias else None for b in bs])
    for a, b, e, n in zip(got, own, exact, ns):
        assert a.shape == (m, 1, n) and a.dtype == dtype and a.is_contiguous()
        err, own_err = (a.double() - e).abs().max().item(), (b.double() - e).abs().max().item()
        assert err <= 2 * own_err + 1e-3, (err, own_err)
        tol = 2e-2 if dtype == torch.float16 else 6e-2
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_where_the_projections_kernel_does_not_apply():
    from graphwrap.decoding import qkv

    def lin(n=32, bias=False, dtype=torch.float16):
        return torch.nn.Linear(64, n, bias=bias, device="cuda", dtype=dtype)

    x = torch.randn(8, 1, 64, device="cuda", dtype=torch.float16)
    assert qkv.applies(x, [lin(64), lin(), lin()]) and qkv.applies(x, [lin(bias=True)] * 3)
    assert not qkv.applies(x, [lin(), lin(bias=True), lin()]), "biases on some only"
    assert not qkv.applies(x, [lin(), lin()]), "two"
    assert not qkv.applies(x.float(), [lin(dtype=torch.float32)] * 3), "fp32: cuBLAS's"
    assert not qkv.applies(torch.randn(qkv.ROWS + 1, 64, device="cuda", dtype=torch.float16), [lin()] * 3), \
        "more rows than a step's: cuBLAS's"


@pytest.mark.parametrize("m,k", [(64, 2048), (3, 4096), (5, 200)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split", [None, 1, 4])
def test_both_kernels_norm_their_input_as_rms_norm_would(m, k, dtype, split):
    """With an RMSNorm folded in: the products of ``rms_norm(x, weight)`` (torch's kernel, which
    rounds once), to the rounding of the sums' order; the normed input is never written."""
    from graphwrap.decoding import mlp, qkv

    g = torch.Generator(device="cuda").manual_seed(1)
    x = (3 * torch.randn(m, 1, k, generator=g, device="cuda")).to(dtype)
    nw = (1 + 0.2 * torch.randn(k, generator=g, device="cuda")).to(dtype)
    norm = (nw, 1e-5)
    kw = {} if split is None else {"split": split}
    ws = [(torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype) for n in (k, k // 8, k // 8)]
    got, own = qkv.project(x, ws, [None] * 3, norm=norm, **kw), qkv.reference(x, ws, [None] * 3, norm=norm)
    wg, wu = [(torch.randn(3 * k, k, generator=g, device="cuda") / k ** 0.5).to(dtype) for _ in range(2)]
    got.append(mlp.gate_up(x, wg, wu, norm=norm, **kw))
    own.append(mlp.reference(x, wg, wu, norm=norm))
    unnormed = qkv.project(x, ws, [None] * 3, **kw)[0]
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    for a, b in zip(got, own):
        assert a.shape == b.shape and a.dtype == dtype
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert (unnormed - own[0]).abs().max() > 10 * tol, "(the norm does change the result)"
