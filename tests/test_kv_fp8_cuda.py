"""The shared batch's cache in FP8 on a GPU (``decode={"kv_cache_dtype": "fp8"}``,
graphwrap/decoding/cache/fp8.py): the step's write into FP8 pools bit for bit as the torch form
stores, the step's and the piece's attention kernels over FP8 pools against their torch
references, and the batch's tokens through its graphs against the model decoding alone through
a cache kept as the FP8 pool keeps it."""

import pytest
import torch
from test_kv_fp8_cpu import _model as small_model
from test_kv_fp8_cpu import _stored_as_fp8

pytestmark = pytest.mark.cuda
pytest.importorskip("triton", reason="needs Triton (torch's CUDA wheels bring it)")
tr = pytest.importorskip("transformers", reason="needs transformers")
DEV = "cuda"


@pytest.fixture(autouse=True)
def _e4m3_kernels():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("graphwrap's kernels read FP8 from compute capability 8.9 (this GPU gathers instead)")


@pytest.mark.parametrize("n,h,d", [(64, 8, 128), (1, 8, 128), (7, 3, 80), (5, 16, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_step_write_into_fp8_pools_stores_as_the_torch_form_bit_for_bit(n, h, d, dtype):
    from graphwrap.decoding.cache import fp8
    from graphwrap.decoding.kernels import step_write

    g = torch.Generator(device=DEV).manual_seed(0)
    keys = torch.zeros(40, 16, h, d, device=DEV, dtype=fp8.FORMAT)
    values = torch.zeros_like(keys)
    k = (torch.randn(n, 1, h, d, generator=g, device=DEV) * 30).to(dtype).transpose(1, 2)[:, :, -1]
    v = torch.randn(n, 1, h, d, generator=g, device=DEV).to(dtype).transpose(1, 2)[:, :, -1]
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 3e-6], dtype=dtype)  # saturated both ways, zero, below E4M3
    slot = torch.randperm(40 * 16, generator=g, device=DEV)[:n]
    where, offset = slot // 16, slot % 16
    scales = fp8.Scales(0.07, 0.003)
    want_k, want_v = keys.clone(), values.clone()
    step_write.reference(want_k, want_v, where, offset, k, v, scales.keys, scales.values)
    assert step_write.applies(keys, values, k, v)
    step_write.put(keys, values, where, offset, k, v, scales)
    assert torch.equal(keys.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(values.view(torch.uint8), want_v.view(torch.uint8))
    assert not keys.float().isnan().any()


def _fp8_pools(shape, g, scales):
    from graphwrap.decoding.cache import fp8

    k = torch.randn(shape, generator=g, device=DEV) * 40
    v = torch.randn(shape, generator=g, device=DEV)
    return fp8.encode(k, scales.keys), fp8.encode(v, scales.values)


@pytest.mark.parametrize("dtype,hq,hkv,d,window,softcap", [
    (torch.float16, 32, 8, 128, None, None), (torch.bfloat16, 12, 12, 64, None, None),
    (torch.float32, 4, 2, 64, 17, 5.0), (torch.float16, 16, 8, 256, 100, 30.0)])
@pytest.mark.parametrize("splits", [1, 16])
def test_the_paged_attention_kernel_reads_fp8_pools_back_with_their_scales(dtype, hq, hkv, d, window, softcap,
                                                                           splits):
    from graphwrap.decoding.cache import fp8
    from graphwrap.decoding.kernels import paged_attention

    g = torch.Generator(device=DEV).manual_seed(0)
    scales = fp8.Scales(0.2, 0.005)
    k_pool, v_pool = _fp8_pools((300, 16, hkv, d), g, scales)
    lengths = torch.tensor([1, 15, 16, 17, 64, 65, 200, 513, 1000], device=DEV)
    table = torch.randint(1, 300, (9, 64), generator=g, device=DEV)
    query = (torch.randn((9, hq, 1, d), generator=g, device=DEV) * 0.05).to(dtype)
    got = paged_attention.attend(query, k_pool, v_pool, table, lengths, 0.1, window, softcap, splits, scales)
    want = paged_attention.reference(query, k_pool, v_pool, table, lengths, 0.1, window, softcap, scales.keys,
                                     scales.values)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,hq,hkv,d,width,start,valid,window", [
    (torch.float16, 32, 8, 128, 128, 3000, 128, None), (torch.float16, 32, 8, 128, 512, 700, 400, None),
    (torch.bfloat16, 8, 4, 64, 128, 260, 77, 100), (torch.float32, 4, 2, 64, 32, 300, 32, None)])
def test_the_piece_attention_kernel_reads_fp8_pools_back_with_their_scales(dtype, hq, hkv, d, width, start, valid,
                                                                           window):
    from graphwrap.decoding.cache import fp8
    from graphwrap.decoding.kernels import piece_attention

    g = torch.Generator(device=DEV).manual_seed(0)
    scales = fp8.Scales(0.2, 0.005)
    k_pool, v_pool = _fp8_pools((500, 16, hkv, d), g, scales)
    line = torch.randperm(499, generator=g, device=DEV)[:400] + 1
    at = torch.tensor([start, valid, 7], device=DEV)
    query = (torch.randn((1, hq, width, d), generator=g, device=DEV) * 0.05).to(dtype)
    want = piece_attention.reference(query, k_pool, v_pool, line, at, 0.1, window, None, scales.keys, scales.values)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for splits in (1, 4):
        got = piece_attention._launch(query[0], k_pool, v_pool, line, at, 0.1, window or 0, 0.0, splits=splits,
                                      k_scale=scales.keys, v_scale=scales.values)[None]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    got = piece_attention.attend_piece(query, k_pool, v_pool, line, at, 0.1, window, None, scales)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _model(kind, dtype):
    return small_model(kind, gain=1.0, width=256, vocab=1000, positions=2048).to(DEV, dtype)


def _teacher_forced(model, prompt, out, scales, whole: bool):
    """The logits of ``model`` at each of ``out``'s new tokens, decoding alone through a cache
    kept as the FP8 pool keeps it (``whole``: the prompt's forward attends over its own keys as
    made; else it went in pieces, each over what it stored)."""
    from graphwrap.loops.decode import cache_keyword

    cache = tr.DynamicCache(config=model.config)
    for layer, s in zip(cache.layers, scales):
        _stored_as_fp8(layer, s, raw_first=whole)
    kw = {cache_keyword(model): cache, "use_cache": True}
    n = prompt.shape[1]
    rows = []
    with torch.no_grad():
        logits = model(input_ids=prompt, **kw).logits[0, -1:]
        for i in range(n, out.shape[1]):
            rows.append(logits[0].float())
            logits = model(input_ids=out[:, i:i + 1], **kw).logits[0, -1:]
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_batch_in_fp8_replays_and_each_token_is_near_the_fp8_models_best(kind, dtype, monkeypatch):
    """Short prompts (each prefilled whole) and long ones (in pieces: WHOLE 0), at once, twice
    (the second replays what the first captured): each new token is, teacher-forced through the
    model alone over an FP8 cache on the batch's own sequence, within 1% of the logits' spread
    of that model's best."""
    from graphwrap import GraphedModule
    from graphwrap.decoding.engine import pieces

    monkeypatch.setattr(pieces, "WHOLE", 0)
    model = _model(kind, dtype)
    gm = GraphedModule(model, decode={"kv_cache_dtype": "fp8"})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 1000, (1, n), generator=g).to(DEV) for n in (5, 17, 40, 9, 700, 1300)]
    for _ in range(2):
        futs = [gm.submit_generate(p, max_new_tokens=24, do_sample=False) for p in prompts]
        outs = [f.result(timeout=300) for f in futs]
    store = gm.__dict__["_gw_decode"].store
    assert store.kernel and all(t.dtype == torch.float8_e4m3fn for t in store.keys)
    for p, out in zip(prompts, outs):
        logits = _teacher_forced(model, p, out, store.scales, whole=p.shape[1] < 512)
        ours = logits.gather(1, out[0, p.shape[1]:, None])[:, 0]
        best, spread = logits.max(1).values, logits.max(1).values - logits.min(1).values
        assert ((best - ours) <= 0.01 * spread).all(), (p.shape, (best - ours) / spread)
    d = gm.stats()["decode"]
    assert any(k["status"] == "graphed" for k in d["step"]["keys"]), d["step"]["keys"]
    assert d["prefill_pieces"] >= 2 and not d["capture_failed"], d
    gm.close()
