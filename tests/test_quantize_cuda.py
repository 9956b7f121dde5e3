"""``graphwrap.quantize(model, "fp8")`` on a GPU of compute capability 8.9 or later (and "int8"
and "int4" weight-only, graphwrap's own): the FP8
product (torch's row-wise product, fast accumulation) against the same arithmetic written
out; an attention layer's three projections as one product against each layer's own; graphwrap's kernel that scales rows to E4M3 against the torch steps it replaces, bit for bit; a GraphedModule over a quantized MLP replays a graph and gives eager's output; the shared
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("width", [64, 4096])
def test_a_norm_that_scales_its_rows_writes_the_norm_and_rows_to_fp8_of_it_bit_for_bit(dtype, rows, width):
    """normed(): the RMSNorm as graphwrap's norm kernel writes it, and in the same kernel that
    result's rows in E4M3 with their scales, as rows_to_fp8 makes them from it; an FP8 layer
    given that very output reads them (no other scaling); fp32 is not taken."""
    from graphwrap import quantized as qz
    from graphwrap.decoding.kernels import norm

    torch.manual_seed(rows + width)
    x = torch.randn(rows, 1, width, device=DEV, dtype=dtype) * 3
    w = torch.rand(width, device=DEV, dtype=dtype) + 0.5
    y = qz.normed(x, w, 1e-5)
    assert y is not None and y.shape == x.shape and y.dtype == dtype
    if rows <= norm.ROWS:  # (graphwrap's norm kernel's result, to its last bit: Triton may sum in another order)
        torch.testing.assert_close(y, norm.rms(x, w, 1e-5), atol=0, rtol=torch.finfo(dtype).eps)
    torch.testing.assert_close(y, norm.reference(x, w, 1e-5), atol=2e-3, rtol=1e-2)
    q, s = qz._scaled(y, width)
    want_q, want_s = rows_to_fp8(y.reshape(-1, width))
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    layer = Fp8Linear(nn.Linear(width, 32, bias=False).to(DEV, dtype))
    calls = []
    real = qz.rows_to_fp8
    qz.rows_to_fp8 = lambda r: calls.append(r) or real(r)
    try:
        got = layer(y)
        assert not calls, "the rows the norm scaled"
        torch.testing.assert_close(got, layer(y.clone()), atol=0, rtol=0)
        assert calls, "another tensor: scaled again"
    finally:
        qz.rows_to_fp8 = real
        qz.forget()
    assert qz.normed(x.float(), w.float(), 1e-5) is None


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


def near_the_eager_best(model, device=DEV):
    """A GraphedModule over ``model`` (returned, open) whose shared batch, given four random
    prompts at once, twice (the second replays what the first captured), makes 16 greedy tokens
    each of which is, teacher-forced through the eager model on the batch's own sequence, within
    1% of the logits' spread of that model's best (in fp16 the batch's rows take other kernels
    than the eager model's, so its argmax may differ where two are that close)."""
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 101, (1, n), generator=g).to(device) for n in (5, 17, 40, 9)]
    for _ in range(2):
        futs = [gm.submit_generate(p, max_new_tokens=16, do_sample=False) for p in prompts]
        for p, f in zip(prompts, futs):
            out = f.result(timeout=300)
            with torch.no_grad():
                logits = model(out).logits[0, p.shape[1] - 1:-1].float()
            ours = logits.gather(1, out[0, p.shape[1]:, None])[:, 0]
            best, spread = logits.max(1).values, logits.max(1).values - logits.min(1).values
            assert ((best - ours) <= 0.01 * spread).all(), (best - ours) / spread
    return gm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_shared_batch_over_a_quantized_model_gives_its_own_greedy_tokens_on_the_gpu(monkeypatch, dtype):
    """The batch's forwards make q, k and v as one product (together) and, in fp16 and bf16, the
    MLP's SiLU, product and row scaling as one kernel (gated); its check's products are exact,
    each layer's own. In fp32 the tokens are model.generate's; in fp16, where the batch's rows
    take other kernels than generate's single row (few_rows, torch's fast accumulation), each of
    the batch's tokens is, teacher-forced through the eager model on the batch's own sequence,
    within 1% of the logits' spread of that model's best."""
    from graphwrap import quantized

    made = {"together": [], "gated": [], "normed": []}

    def counted(name):
        real = getattr(quantized, name)

        def call(*args):
            out = real(*args)
            made[name].append((out is not None, getattr(quantized._HERE, "exact", False)))  # (the check: exact)
            return out
        monkeypatch.setattr(quantized, name, call)

    counted("together")
    counted("gated")
    counted("normed")
    model = graphwrap.quantize(_llama().to(DEV, dtype), "fp8")
    if dtype == torch.float32:
        gm = own_tokens(model, (5, 17, 40, 9), new=16, seed=1, device=DEV, rounds=2)
    else:
        gm = near_the_eager_best(model)
    d = gm.stats()["decode"]
    assert d["steps"] > 0 and any(k["status"] == "graphed" for k in d["step"]["keys"]), d["step"]["keys"]
    for name, calls in made.items():
        ours_ = [one for one, exact in calls if not exact]
        want = dtype != torch.float32 or name == "together"  # (fp32: no FP8 kernel of graphwrap's but the product)
        assert ours_ and all(o == want for o in ours_), (name, ours_[:8])
        assert not any(one for one, exact in calls if exact), f"the check's products are exact ({name})"
    gm.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096), (256, 48)])
def test_a_few_rows_product_is_the_fp8_product_written_out(dtype, rows, k, n):
    """Up to ROWS rows, graphwrap's kernel (few_rows), beyond them torch's: both the FP8 products
    summed and scaled, to the output dtype's rounding (fast accumulation: a little more)."""
    from graphwrap.quantized import ROWS, product

    g = torch.Generator(device=DEV).manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g, device=DEV).to(dtype)
    w = nn.Linear(k, n, bias=False).to(DEV, dtype)
    layer = Fp8Linear(w)
    q, s = rows_to_fp8(x)
    got = product(q, s, layer.weight_fp8, layer.weight_scale, dtype)
    want = (q.float() * s) @ (layer.weight_fp8.float() * layer.weight_scale.t()).t()
    assert got.dtype == dtype and got.shape == (rows, n)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    # (torch's product accumulates fast: 0.68% at 65 rows of 14,336 inputs)
    assert err < (1e-2 if dtype == torch.bfloat16 or rows > ROWS else 2e-3), (err, rows <= ROWS)
    torch.testing.assert_close(layer(x[:, None]), got[:, None])  # (the layer's own call: the same)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [17, 24, 64, 100, 192, 256])
@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 4096), (14336, 4096), (2048, 2560)])
def test_graphwraps_e4m3_tiles_are_the_fp8_product_written_out(monkeypatch, dtype, rows, k, n):
    """graphwrap's E4M3 tiles (fp8_tiles) at fp8_tile_shape's shape and others, each step's sum
    added in full fp32 or not: the FP8 products summed and scaled; product() takes them on a
    Hopper GPU exactly where fp8_tile_shape gives a shape, and then gives their result."""
    from graphwrap import quantized
    from graphwrap.quantized import fp8_tile_shape, fp8_tiles, product

    g = torch.Generator(device=DEV).manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=g, device=DEV).to(dtype)
    layer = Fp8Linear(nn.Linear(k, n, bias=False).to(DEV, dtype))
    q, s = rows_to_fp8(x)
    want = (q.float() * s) @ (layer.weight_fp8.float() * layer.weight_scale.t()).t()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    chosen = fp8_tile_shape(rows, n, k, sms)
    shapes = [((64, 64, 128, 4, 4), True), ((128, 128, 128, 8, 3), True), ((64, 128, 256, 4, 4), False)]
    for shape, precise in shapes + ([(chosen, True)] if chosen else []):
        got = fp8_tiles(q, s, layer.weight_fp8, layer.weight_scale, dtype, shape, precise)
        assert got.dtype == dtype and got.shape == (rows, n)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        # (each step's sum added in fp32: the output dtype's rounding; the whole inner dimension at
        # the tensor cores' fast accumulation, as torch's fast-accumulating product: a little more)
        assert err < ((8e-3 if dtype == torch.bfloat16 else 2e-3) if precise else 1.5e-2), (shape, precise, err)
    taken = []
    real = quantized.fp8_tiles
    monkeypatch.setattr(quantized, "fp8_tiles", lambda *a: taken.append(a[-1]) or real(*a))
    got = product(q, s, layer.weight_fp8, layer.weight_scale, dtype)
    hopper = torch.cuda.get_device_capability(DEV)[0] == 9
    assert taken == ([chosen] if hopper and chosen else [])
    if taken:
        torch.testing.assert_close(got, fp8_tiles(q, s, layer.weight_fp8, layer.weight_scale, dtype, chosen),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind, k, n", [(kind, k, n) for kind in ("fp8", "int8")
                                        for k, n in ((4096, 6144), (4096, 28672), (14336, 4096), (256, 48))]
                         + [("int8", 200, 40)])
def test_one_row_goes_where_row_shape_says_and_gives_the_tiles_product(monkeypatch, dtype, kind, k, n):
    """At one row few_rows takes the CUDA cores' kernel (one_row) where row_shape gives it a
    shape, the tiles elsewhere; each within rounding of the other and of the product written
    out in fp32 (uneven widths through the kernel's masks)."""
    from graphwrap import quantized
    from graphwrap.quantized import Int8Linear, few_rows, row_shape

    g = torch.Generator(device=DEV).manual_seed(k + n)
    x = torch.randn(1, k, generator=g, device=DEV).to(dtype)
    linear = nn.Linear(k, n, bias=False).to(DEV, dtype)
    if kind == "fp8":
        layer = Fp8Linear(linear)
        q, s, w = *rows_to_fp8(x), layer.weight_fp8
        want = (q.float() * s) @ (w.float() * layer.weight_scale.t()).t()
    else:
        layer = Int8Linear(linear)
        q, s, w = x, None, layer.weight_int8
        want = x.float() @ (w.float() * layer.weight_scale.t()).t()
    rows = []
    real = quantized.one_row
    monkeypatch.setattr(quantized, "one_row", lambda *a, **kw: rows.append(1) or real(*a, **kw))
    got = few_rows(q, s, w, layer.weight_scale, dtype)
    tiles = few_rows(q, s, w, layer.weight_scale, dtype, bn=32, bk=256, split=1)
    assert len(rows) == (row_shape(n, k, kind == "fp8") is not None)
    assert got.dtype == dtype and got.shape == (1, n)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for out in (got, tiles):
        assert ((out.float() - want).abs().max() / want.abs().max()).item() < tol
    assert ((got.float() - tiles.float()).abs().max() / want.abs().max()).item() < tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize("shared", [True, False])
def test_silu_the_product_and_the_row_scaling_as_one_kernel_are_the_mlps_own(dtype, rows, shared):
    """gated(): the down projection's input made and scaled to E4M3 in one kernel, against the
    layers' own calls with torch's SiLU and product between them (an element whose SiLU rounds
    otherwise may move one E4M3 step: to the products' rounding); the gate and up projections
    as one product where quantize laid them out in one buffer, and apart where not."""
    from graphwrap.quantized import _joined, gated

    torch.manual_seed(rows)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(512, 1536, bias=False), nn.Linear(512, 1536, bias=False)
    mlp.down_proj = nn.Linear(1536, 512, bias=True)
    graphwrap.quantize(mlp.to(DEV, dtype), "fp8")
    assert _joined([mlp.gate_proj.weight_fp8, mlp.up_proj.weight_fp8], 0) is not None
    if not shared:
        mlp.up_proj._buffers["weight_fp8"] = mlp.up_proj.weight_fp8.clone()
    x = torch.randn(rows, 1, 512, device=DEV, dtype=dtype)
    got = gated(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err < 2e-2, err
    assert gated(x.float(), mlp.gate_proj, mlp.up_proj, mlp.down_proj) is None, "fp16 and bf16 only"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_query_key_and_value_as_one_product_are_each_layers_own(dtype, rows):
    """The Llama-3-8B shape's widths (4,096 in; 4,096, 1,024 and 1,024 out): together() against
    each layer's own call, to the fp16 products' rounding (another kernel sums in another order);
    the product is written in the model's dtype where this torch writes it."""
    from graphwrap.quantized import _writes, together

    torch.manual_seed(rows)
    attn = nn.Module()
    for name, n in (("q_proj", 4096), ("k_proj", 1024), ("v_proj", 1024)):
        setattr(attn, name, nn.Linear(4096, n, bias=False).to(DEV, dtype))
    graphwrap.quantize(attn, "fp8")
    layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(rows, 1, 4096, device=DEV, dtype=dtype)
    outs = together(x, layers)
    assert outs is not None
    for m, o in zip(layers, outs):
        want = m(x)
        assert o.dtype == dtype and o.shape == want.shape
        torch.testing.assert_close(o, want, atol=2e-2, rtol=2e-2)
    assert _writes(torch.device(DEV), torch.bfloat16)
    assert isinstance(_writes(torch.device(DEV), torch.float16), bool)


# ------------------------------------------------------------------ int8 and int4 weight-only

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 64, 256])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096), (200, 40)])
def test_an_int8_layers_product_on_the_gpu_is_its_weight_rounded_written_out(dtype, rows, k, n):
    """Int8Linear through graphwrap's kernel (few_rows with int8 weights, at any number of rows)
    against the same product written out in fp32: each int8 value exact in the input's dtype,
    summed in fp32, scaled, rounded once."""
    from graphwrap.quantized import Int8Linear

    torch.manual_seed(rows + k)
    layer = Int8Linear(nn.Linear(k, n, bias=False).to(DEV, dtype))
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    got = layer(x)
    want = x.float() @ (layer.weight_int8.float() * layer.weight_scale.t()).t()
    assert got.dtype == dtype and got.shape == (rows, n)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [17, 40, 64, 200, 256])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096), (2048, 2560)])
def test_int8_tiles_with_the_weights_on_the_left_are_the_product_written_out(monkeypatch, dtype, rows, k, n):
    """graphwrap's int8 tiles (int8_tiles, the weights the left operand) at int8_tile_shape's shape
    and others against the product written out in fp32; an Int8Linear takes them exactly where
    that rule gives a shape, and then gives their result."""
    from graphwrap import quantized
    from graphwrap.quantized import Int8Linear, int8_tile_shape, int8_tiles

    torch.manual_seed(rows + k + n)
    layer = Int8Linear(nn.Linear(k, n, bias=False).to(DEV, dtype))
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    want = x.float() @ (layer.weight_int8.float() * layer.weight_scale.t()).t()
    chosen = int8_tile_shape(rows, n, k, torch.cuda.get_device_properties(DEV).multi_processor_count)
    for shape in [(32, 64, 128, 4, 4), (64, 64, 128, 4, 3), (128, 64, 128, 4, 4), (64, 128, 64, 8, 3), chosen]:
        got = int8_tiles(x, layer.weight_int8, layer.weight_scale, shape)
        assert got.dtype == dtype and got.shape == (rows, n)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), (shape, err)
    taken = []
    real = quantized.int8_tiles
    monkeypatch.setattr(quantized, "int8_tiles", lambda *a: taken.append(a[-1]) or real(*a))
    got = layer(x)
    assert taken == [chosen]
    torch.testing.assert_close(got, int8_tiles(x, layer.weight_int8, layer.weight_scale, chosen), rtol=0, atol=0)


def test_the_shared_batch_over_int8_layers_in_fp16_takes_one_product_for_q_k_and_v(monkeypatch):
    """The batch's forwards make an int8 attention layer's q, k and v as one product (together),
    and each of its tokens is, teacher-forced through the eager model on the batch's own
    sequence, within 1% of the logits' spread of that model's best (its rows take other kernels
    than generate's single row); a graph of an int8 MLP replays eager's output."""
    from graphwrap import quantized

    made = []
    real = quantized.together
    monkeypatch.setattr(quantized, "together", lambda *a: made.append(real(*a)) or made[-1])
    mlp = graphwrap.quantize(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(DEV).half().eval(),
                             "int8")
    gm = GraphedModule(mlp)
    for n in (3, 17, 3):
        x = torch.randn(n, 256, device=DEV, dtype=torch.float16)
        with torch.no_grad():
            assert torch.equal(gm(x), mlp(x))
    assert gm.stats()["eager_calls"] == {}
    gm.close()
    model = graphwrap.quantize(_llama().to(DEV, torch.float16), "int8")
    gm = near_the_eager_best(model)
    d = gm.stats()["decode"]
    assert d["steps"] > 0 and any(k["status"] == "graphed" for k in d["step"]["keys"]), d["step"]["keys"]
    assert made and any(o is not None for o in made), "q, k and v as one product"
    gm.close()



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 7, 16, 17, 64, 256])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096), (256, 40)])
def test_an_int4_layers_product_on_the_gpu_is_its_unpacked_weights_written_out(dtype, rows, k, n):
    """Int4Linear through graphwrap's kernels (up to 64 rows the tiles with the weights made whole,
    past them int4_product's; a width they do not divide, int4_product's few rows' tiles, its groups
    in parts) against the unpacked weight's product
    written out in fp32: each value exact, summed and scaled in fp32, rounded once."""
    from graphwrap.quantized import Int4Linear
    from graphwrap.weight_only import unpack

    torch.manual_seed(rows + k)
    layer = Int4Linear(nn.Linear(k, n, bias=False).to(DEV, dtype))
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    got = layer(x)
    want = x.float() @ unpack(layer.weight_int4, layer.weight_scale).t()
    assert got.dtype == dtype and got.shape == (rows, n)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64])
@pytest.mark.parametrize("k, n", [(4096, 6144), (14336, 4096), (2048, 2560), (384, 192)])
def test_int4_tiles_with_the_weights_on_the_left_are_the_product_written_out(monkeypatch, dtype, rows, k, n):
    """graphwrap's int4 tiles (weight_only.tiles, the weights made whole in registers, the left
    operand) at tile_shape's shape and others (one part and several, a last part of fewer groups) against the unpacked
    weight's product written out in fp32; an Int4Linear takes them exactly where that rule gives a
    shape, and then gives their result."""
    from graphwrap import weight_only
    from graphwrap.quantized import Int4Linear

    torch.manual_seed(rows + k + n)
    layer = Int4Linear(nn.Linear(k, n, bias=False).to(DEV, dtype))
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    want = x.float() @ weight_only.unpack(layer.weight_int4, layer.weight_scale).t()
    chosen = weight_only.tile_shape(rows, n, k, torch.cuda.get_device_properties(DEV).multi_processor_count)
    assert chosen is not None
    for shape in [(16, 64, 1, 4, 3), (32, 64, 3, 4, 2), (64, 64, 2, 4, 4), (16, 128, 8, 4, 3), chosen]:
        if n % shape[1]:
            continue
        got = weight_only.tiles(x, layer.weight_int4, layer.weight_scale, shape)
        assert got.dtype == dtype and got.shape == (rows, n)
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), (shape, err)
    taken = []
    real = weight_only.tiles
    monkeypatch.setattr(weight_only, "tiles", lambda *a: taken.append(a[-1]) or real(*a))
    got = layer(x)
    assert taken == [chosen]
    torch.testing.assert_close(got, real(x, layer.weight_int4, layer.weight_scale, chosen), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_shared_batch_over_int4_layers_takes_one_product_for_q_k_v_and_for_gate_and_up(monkeypatch, dtype):
    """The batch's forwards make an int4 attention layer's q, k and v as one product and the MLP's
    gate and up as one (together), and each of its tokens is, teacher-forced through the eager
    model on the batch's own sequence, within 1% of the logits' spread of that model's best; a
    graph of an int4 MLP replays eager's output."""
    from graphwrap import quantized

    made = []
    real = quantized.together
    monkeypatch.setattr(quantized, "together", lambda x, layers: made.append((len(layers), real(x, layers))) or made[-1][1])
    mlp = graphwrap.quantize(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(DEV, dtype).eval(),
                             "int4")
    gm = GraphedModule(mlp)
    for n in (3, 17, 3):
        x = torch.randn(n, 256, device=DEV, dtype=dtype)
        with torch.no_grad():
            assert torch.equal(gm(x), mlp(x))
    assert gm.stats()["eager_calls"] == {}
    gm.close()
    model = graphwrap.quantize(_llama(hidden=128, intermediate=256).to(DEV, dtype), "int4")
    gm = near_the_eager_best(model)
    d = gm.stats()["decode"]
    assert d["steps"] > 0 and any(k["status"] == "graphed" for k in d["step"]["keys"]), d["step"]["keys"]
    assert {n for n, o in made if o is not None} == {2, 3}, "q, k and v as one product; gate and up as one"
    gm.close()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_weight_only_layers_replay_in_graphs_and_the_shared_batch_gives_the_models_own_tokens(kind):
    """In fp32 (the layers' weight made again and torch's product), a graph replays eager's
    output and the shared batch gives model.generate's greedy tokens."""
    torch.manual_seed(0)
    dtype = torch.float32
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
    model = graphwrap.quantize(_llama(hidden=128, intermediate=256).to(DEV, dtype), kind)
    gm = own_tokens(model, (5, 17, 40, 9), new=16, seed=1, device=DEV, rounds=2)
    d = gm.stats()["decode"]
    assert d["steps"] > 0 and any(k["status"] == "graphed" for k in d["step"]["keys"]), d["step"]["keys"]
    gm.close()
