"""A step's matrix products in graphwrap's kernels (Triton) on a GPU: Llama's gated MLP's first
half in one (graphwrap/decoding/kernels/mlp.py) against transformers' LlamaMLP's own operations, and the
attention's query, key and value projections in one (graphwrap/decoding/kernels/qkv.py) against three
``F.linear``, over a step's rows (1 to 64) and the widths of the models served (the 1.1B shape,
a 7-8B shape, widths no tile divides, biases as Qwen2's); where they do not apply. The step's
RMSNorm (graphwrap/decoding/kernels/norm.py) against transformers' LlamaRMSNorm the same way."""

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("triton", reason="needs Triton (torch's CUDA wheels bring it)")


def mlp_cards():
    from graphwrap.decoding.kernels import mlp

    return sorted(set(mlp.CARDS.values()))


@pytest.mark.parametrize("m,k,n", [(64, 2048, 5632), (1, 2048, 5632), (37, 4096, 14336), (5, 200, 300)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [None, *mlp_cards()], ids=lambda s: "card's" if s is None else str(s))
def test_the_gated_kernel_equals_transformers_operations_to_rounding(m, k, n, dtype, shape):
    """With this card's shape of work, and with each card's of graphwrap's table."""
    from graphwrap.decoding.kernels import mlp

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 1, k, generator=g, device="cuda").to(dtype)
    wg = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    wu = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    got = mlp.gate_up(x, wg, wu, *(shape or ()))
    own = mlp.reference(x, wg, wu)  # transformers' kernels: the products, SiLU, the product
    exact = mlp.reference(x.double(), wg.double(), wu.double())
    assert got.shape == (m, 1, n) and got.dtype == dtype
    err, own_err = (got.double() - exact).abs().max().item(), (own.double() - exact).abs().max().item()
    assert err <= 2 * own_err + 1e-3, (err, own_err)  # no further from the exact result than rounding puts own
    tol = 2e-2 if dtype == torch.float16 else 6e-2
    torch.testing.assert_close(got, own, atol=tol, rtol=tol)


def test_where_the_gated_kernel_does_not_apply():
    from graphwrap.decoding.kernels import mlp

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
                                    (37, 4096, (4096, 1024, 1024)), (5, 200, (96, 40, 40)),
                                    (64, 5632, (2048,)), (5, 200, (96,))])  # (one product: the tune's)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("split", [None, 1, 4])
def test_the_projections_kernel_equals_its_linears_to_rounding(m, k, ns, dtype, bias, split):
    from graphwrap.decoding.kernels import qkv

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 1, k, generator=g, device="cuda").to(dtype)
    ws = [(torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype) for n in ns]
    bs = [torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None for n in ns]
    kw = {} if split is None else {"split": split}  # None: the default (two parts where the tiles are few)
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
    from graphwrap.decoding.kernels import qkv

    def lin(n=32, bias=False, dtype=torch.float16):
        return torch.nn.Linear(64, n, bias=bias, device="cuda", dtype=dtype)

    x = torch.randn(8, 1, 64, device="cuda", dtype=torch.float16)
    assert qkv.applies(x, [lin(64), lin(), lin()]) and qkv.applies(x, [lin(bias=True)] * 3)
    assert not qkv.applies(x, [lin(), lin(bias=True), lin()]), "biases on some only"
    assert not qkv.applies(x, [lin(), lin()]), "two"
    assert not qkv.applies(x.float(), [lin(dtype=torch.float32)] * 3), "fp32: cuBLAS's"
    assert not qkv.applies(torch.randn(qkv.ROWS + 1, 64, device="cuda", dtype=torch.float16), [lin()] * 3), \
        "more rows than a step's: cuBLAS's"


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_the_shared_batch_runs_both_kernels_in_its_graphs_and_gives_the_models_tokens_in_fp16(family, monkeypatch):
    """Concurrent fp16 calls (half under ``inference_mode``) through the shared batch, whose
    captures and eager forwards take the projections' and the MLP's kernels (Qwen2's projections
    with biases): each call's tokens are ``model.generate``'s, or part where eager's two best
    logits were within fp16 rounding of each other."""
    from helpers import same_or_near_tie, thread_results

    from graphwrap import GraphedModule
    from graphwrap.decoding.kernels import mlp, norm, qkv

    tr = pytest.importorskip("transformers", reason="needs transformers")
    torch.manual_seed(0)
    cfg = getattr(tr, f"{family}Config")(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000, max_position_embeddings=512, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = tr.AutoModelForCausalLM.from_config(cfg).half().to("cuda").eval()
    calls = []
    project, gate_up = qkv.project, mlp.gate_up
    monkeypatch.setattr(qkv, "project", lambda *a, **k: calls.append("qkv") or project(*a, **k))
    monkeypatch.setattr(mlp, "gate_up", lambda *a, **k: calls.append("mlp") or gate_up(*a, **k))
    rms = norm.rms
    monkeypatch.setattr(norm, "rms", lambda *a, **k: calls.append("norm") or rms(*a, **k))
    g = torch.Generator().manual_seed(3)
    reqs = [(torch.randint(2, 1000, (1, int(p)), generator=g).cuda(), int(k))
            for p, k in zip(torch.randint(3, 50, (8,), generator=g), torch.randint(8, 30, (8,), generator=g))]
    gm = GraphedModule(model)

    def one(i):
        with torch.inference_mode() if i % 2 else torch.no_grad():
            return gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False)

    for _ in range(2):  # the second pass replays what the first captured beside it
        got = thread_results(one, len(reqs))
        assert gm.__dict__["_gw_decode"].captures.finish(120)
    assert {"qkv", "mlp", "norm"} <= set(calls), "the batch's forwards took the kernels"
    for (ids, k), out in zip(reqs, got):
        same_or_near_tie(model, ids, out, k)
    d = gm.stats()["decode"]
    assert d["rows_busy"] == 0 and not d["step"]["eager_calls"], d["step"]["eager_calls"]
    gm.close()


@pytest.mark.parametrize("m,n", [(64, 2048), (1, 2048), (37, 4096), (5, 300), (64, 8192)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_norm_kernel_equals_transformers_rmsnorm_to_rounding(m, n, dtype):
    from graphwrap.decoding.kernels import norm

    tr = pytest.importorskip("transformers", reason="needs transformers")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(m, 1, n, generator=g, device="cuda")).to(dtype)
    layer = tr.models.llama.modeling_llama.LlamaRMSNorm(n, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        layer.weight.copy_(1 + 0.2 * torch.randn(n, generator=g, device="cuda"))
        own = layer(x)  # transformers' operations (rounded before the weight's product)
    exact = norm.reference(x.double(), layer.weight.double(), 1e-6)
    assert norm.applies(x, layer.weight)
    got = norm.rms(x, layer.weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    ulp = torch.finfo(dtype).eps * exact.abs().clamp(min=1)
    assert ((got.double() - exact).abs() <= ulp).all(), "rounded once from fp32"
    assert ((got.double() - exact).abs() <= (own.double() - exact).abs() + ulp).all()
    strided = torch.randn(m, 2 * n, generator=g, device="cuda").to(dtype)[:, ::2]
    assert torch.allclose(norm.rms(strided, layer.weight, 1e-6).float(),
                          norm.reference(strided, layer.weight, 1e-6).float(), atol=ulp.max().item() * 4)


def test_where_the_norm_kernel_does_not_apply():
    from graphwrap.decoding.kernels import norm

    x = torch.randn(8, 1, 256, device="cuda").half()
    w = torch.ones(256, device="cuda").half()
    assert norm.applies(x, w)
    assert not norm.applies(x.float(), w.float()), "fp32: PyTorch's"
    assert not norm.applies(x, w.float()), "a weight of another dtype"
    assert not norm.applies(torch.randn(65, 256, device="cuda").half(), w), "more rows than a step's"
    assert not norm.applies(x.cpu(), w.cpu())
