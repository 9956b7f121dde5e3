"""``graphwrap.quantize(model, "fp8")`` on a GPU of compute capability 8.9 or later (and "int8" and
"int4" weight-only, through torchao, where it is installed): the FP8
product (cutlass's row-wise kernel, its output in bfloat16) against the same arithmetic written
out; graphwrap's kernel that scales rows to E4M3 against the torch steps it replaces, bit for bit; a GraphedModule over a quantized MLP replays a graph and gives eager's output; the shared
decode batch over a quantized model gives that model's own greedy tokens (fp32 around the
products, TF32 off)."""

import pytest
import torch
import torch.nn as nn
from test_quantize_cpu import _by_hand, _llama, own_tokens

import graphwrap
from graphwrap import GraphedModule
from graphwrap.quantized import Fp8Linear, fp8_supported, rows_to_fp8, rows_to_fp8_reference

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fp32_exact")]
DEV = "cuda"


@pytest.fixture(autouse=True)
def _fp8_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = fp8_supported(torch.device(DEV))
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_an_fp8_linear_on_the_gpu_is_the_fp8_product(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(256, 512, bias=True).to(DEV, dtype)
    x = torch.randn(7, 256, device=DEV, dtype=dtype)
    got = Fp8Linear(linear)(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), _by_hand(x, linear).float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [16, 4096, 14336])
def test_the_row_scaling_kernel_is_the_torch_steps_bit_for_bit(dtype, width):
    torch.manual_seed(width)
    x = torch.randn(37, width, device=DEV, dtype=dtype) * torch.logspace(-3, 2, 37, device=DEV, dtype=dtype)[:, None]
    x[3] = 0  # (a row of zeros)
    x[5, 7] = 1e4 if dtype != torch.float16 else 6e4  # (one large value: the rest of its row rounds small)
    for rows in (x, x[:, :width // 2 * 2:2] if width > 16 else x, x[:0]):
        q, scale = rows_to_fp8(rows)
        want_q, want_scale = rows_to_fp8_reference(rows)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows.shape[0], 1)
        assert torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_a_graphed_quantized_mlp_replays_and_gives_eagers_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(DEV).half().eval()
    graphwrap.quantize(model, "fp8")
    gm = GraphedModule(model)
    for n in (3, 17, 3):
        x = torch.randn(n, 64, device=DEV, dtype=torch.float16)
        with torch.no_grad():
            assert torch.equal(gm(x), model(x))
    s = gm.stats()
    assert s["eager_calls"] == {} and sum(b["replays"] for b in s["keys"][0]["buckets"].values()) >= 2, s
    gm.close()


def test_the_shared_batch_over_a_quantized_model_gives_its_own_greedy_tokens_on_the_gpu():
    model = graphwrap.quantize(_llama().to(DEV), "fp8")
    gm = own_tokens(model, (5, 17, 40, 9), new=16, seed=1, device=DEV, rounds=2)
    d = gm.stats()["decode"]
    assert d["steps"] > 0 and any(k["status"] == "graphed" for k in d["step"]["keys"]), d["step"]["keys"]
    gm.close()


# ------------------------------------------------------------------ int8 and int4 weight-only (torchao)

@pytest.mark.parametrize("kind, dtype", [("int8", torch.float32), ("int4", torch.bfloat16)])
def test_weight_only_layers_replay_in_graphs_and_the_shared_batch_gives_the_models_own_tokens(kind, dtype):
    pytest.importorskip("torchao", reason="needs torchao (the quant extra): pip install 'graphwrap[quant]'")
    torch.manual_seed(0)
    mlp = graphwrap.quantize(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(DEV, dtype).eval(),
                             kind)
    gm = GraphedModule(mlp)
    for n in (3, 17, 3):
        x = torch.randn(n, 256, device=DEV, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(gm(x), mlp(x))
    s = gm.stats()
    assert s["eager_calls"] == {} and sum(b["replays"] for b in s["keys"][0]["buckets"].values()) >= 2, s
    gm.close()
    model = graphwrap.quantize(_llama().to(DEV, dtype), kind)
    gm = own_tokens(model, (5, 17, 40, 9), new=16, seed=1, device=DEV, rounds=2)
    d = gm.stats()["decode"]
    assert d["steps"] > 0 and any(k["status"] == "graphed" for k in d["step"]["keys"]), d["step"]["keys"]
    gm.close()
