"""The shared batch's cache in FP8 (``decode={"kv_cache_dtype": "fp8"}``,
graphwrap/decoding/cache/fp8.py) on a CPU: the format and its scales, a write into FP8 pools, the
options, and the batch's tokens against the model decoding alone through a cache that stores
and reads back its keys and values as the FP8 pool does: gathered, and read in place (the
kernels' torch references, which the operators run off a GPU), prompts whole and in pieces.
Needs transformers (skipped with the reason without it)."""

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.decoding.cache import fp8
from graphwrap.decoding.engine import pieces as pieces_mod
from graphwrap.decoding.engine import server as server_mod
from graphwrap.decoding.kernels import paged_attention, piece_attention, step_write
from graphwrap.decoding.kernels.attention import sdpa_model
from graphwrap.loops.decode import cache_keyword

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
SHARED = "graphwrap's shared decode batch"
FP8 = {"kv_cache_dtype": "fp8"}


def _model(kind="llama", gain=3.0, width=64, vocab=101, positions=256):
    """A small model of two layers whose weights are ``gain`` times their initial values (3 for
    the tiny one: large enough that FP8's rounding of its keys and values changes its greedy
    tokens, which the tests check)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=2, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions,
                            bos_token_id=1, eos_token_id=None, pad_token_id=0)
    elif kind == "mistral":  # (a sliding window of 4)
        cfg = tr.MistralConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                               max_position_embeddings=positions, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                               sliding_window=4)
    else:
        cfg = tr.LlamaConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=positions,
                             bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = tr.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(gain)
    return model


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 101, (n,), generator=g).tolist() for n in lengths]


def _stored_as_fp8(layer, scales: fp8.Scales, raw_first: bool):
    """``layer`` (of the model's own cache) keeps each key and value as the FP8 pool reads it
    back; with ``raw_first``, its first forward (a whole prompt's) attends over its own keys as
    made, as the batch's prompt forward does."""
    update = layer.update

    def stored(k, v, *args, **kwargs):
        first = raw_first and not layer.is_initialized
        keys, values = update(fp8.round_trip(k, scales.keys), fp8.round_trip(v, scales.values), *args, **kwargs)
        return (k, v) if first else (keys, values)

    layer.update = stored


def _fp8_alone(model, prompt, n, scales, chunk=None):
    """The model's greedy tokens decoding ``prompt`` alone through a cache kept as the FP8 pool
    keeps it: the prompt in one forward, or in pieces of ``chunk`` (each piece attends over what
    the pieces before it and itself stored, as the batch's pieces do)."""
    cache = tr.DynamicCache(config=model.config)
    in_pieces = chunk is not None and len(prompt) > chunk
    for layer, s in zip(cache.layers, scales):
        _stored_as_fp8(layer, s, raw_first=not in_pieces)
    kw = {cache_keyword(model): cache, "use_cache": True}
    parts = [prompt[i:i + chunk] for i in range(0, len(prompt), chunk)] if in_pieces else [prompt]
    out = list(prompt)
    with torch.no_grad():
        for part in parts:
            logits = model(input_ids=torch.tensor([part]), **kw).logits
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model(input_ids=torch.tensor([[out[-1]]]), **kw).logits
    return torch.tensor([out])


def _alone(model, prompt, n):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=n)


def _batch_against_fp8_alone(gm, model, prompts, news, chunk=None):
    """Every prompt decoded at once through the batch: each gets the tokens of the model alone
    over the FP8 cache; at least one differs from the model's own (fp32) cache's."""
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i]), len(prompts))
    scales = gm.__dict__["_gw_decode"].store.scales
    differs = 0
    for p, n, out in zip(prompts, news, got):
        assert torch.equal(out, _fp8_alone(model, p, n, scales, chunk)), p
        differs += not torch.equal(out, _alone(model, p, n))
    assert differs, "FP8's rounding changed no token: the test cannot tell the FP8 cache from the model's own"
    assert gm.stats()["generate"] == {SHARED: len(prompts)}


# ------------------------------------------------------------------ the format and its scales


def test_each_layers_scale_puts_headroom_times_its_largest_at_e4m3s_largest():
    s = fp8.scales_for([224.0, 0.0, 3.5], [1.0, 2.0, float("nan")])
    assert s[0] == fp8.Scales(fp8.HEADROOM * 224.0 / 448.0, fp8.HEADROOM / 448.0)
    assert s[1].keys == 1.0 and s[1].values == fp8.HEADROOM * 2.0 / 448.0  # (a layer of zeros: scale 1)
    assert s[2].values == 1.0
    ids = fp8.calibration_ids(101, 256)
    assert len(ids) == 256 and min(ids) >= 1 and max(ids) <= 100 and len(set(ids)) == 100


def test_a_stored_value_is_saturated_never_nan_and_reads_back_within_half_a_step():
    scale = 0.25
    x = torch.tensor([1e6, -1e6, 100.0, -3.3, 0.0, 0.7])
    stored = fp8.encode(x, scale)
    assert stored.dtype == torch.float8_e4m3fn
    back = fp8.decode(stored, scale, torch.float32)
    assert not back.isnan().any()
    assert back[0] == 448 * scale and back[1] == -448 * scale  # saturated
    inside = x.abs() <= 448 * scale
    assert torch.all((back - x).abs()[inside] <= x.abs()[inside] / 16 + 2 ** -9 * scale)  # 3 bits: half a step
    assert torch.equal(fp8.round_trip(x.half(), scale), back.half())
    assert torch.equal(fp8.decode(x, scale, torch.float16), x.half())  # (a pool of the model's dtype: as it is)


def test_a_write_into_fp8_pools_stores_each_key_over_its_layers_scale():
    keys = torch.zeros((4, 2, 3, 8), dtype=torch.float8_e4m3fn)
    values = torch.zeros_like(keys)
    k, v = torch.randn(2, 3, 8) * 50, torch.randn(2, 3, 8)
    where, offset = torch.tensor([3, 1]), torch.tensor([1, 0])
    step_write.put(keys, values, where, offset, k, v, fp8.Scales(0.5, 0.01))
    assert torch.equal(keys[3, 1].float(), fp8.encode(k[0], 0.5).float())
    assert torch.equal(keys[1, 0].float(), fp8.encode(k[1], 0.5).float())
    assert torch.equal(values[1, 0].float(), fp8.encode(v[1], 0.01).float())
    assert keys[0].float().abs().sum() == 0 and keys[3, 0].float().abs().sum() == 0  # nothing else written


@pytest.mark.parametrize("window", [None, 3])
def test_the_attentions_read_an_fp8_pool_back_with_its_scales(window):
    """The step's and the piece's attention (their torch references, which the GPU's kernels are
    tested against) over FP8 pools give what they give over the pools read back."""
    g = torch.Generator().manual_seed(0)
    k32, v32 = torch.randn(12, 4, 2, 16, generator=g) * 9, torch.randn(12, 4, 2, 16, generator=g)
    ks = fp8.Scales(0.05, 0.004)
    kf, vf = fp8.encode(k32, ks.keys), fp8.encode(v32, ks.values)
    kb, vb = fp8.decode(kf, ks.keys, torch.float32), fp8.decode(vf, ks.values, torch.float32)
    table = torch.tensor([[3, 7, 1, 0], [9, 2, 5, 11]])
    lengths = torch.tensor([7, 13])
    q = torch.randn(2, 4, 1, 16, generator=g)
    got = paged_attention.reference(q, kf, vf, table, lengths, 0.25, window, None, ks.keys, ks.values)
    want = paged_attention.reference(q, kb, vb, table, lengths, 0.25, window)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(want, paged_attention.reference(q, k32, v32, table, lengths, 0.25, window), atol=1e-4)
    qp = torch.randn(1, 4, 5, 16, generator=g)
    at = torch.tensor([6, 4, 1])
    got = piece_attention.reference(qp, kf, vf, table[1], at, 0.25, window, None, ks.keys, ks.values)
    torch.testing.assert_close(got, piece_attention.reference(qp, kb, vb, table[1], at, 0.25, window))


# ------------------------------------------------------------------ the options


def test_the_options_refuse_an_unknown_dtype_and_an_fp8_cache_of_whole_rows():
    model = _model()
    with pytest.raises(GraphwrapError, match="kv_cache_dtype.*'auto'.*'fp8'"):
        GraphedModule(model, decode={"kv_cache_dtype": "int8"})
    with pytest.raises(GraphwrapError, match="paged pool.*paged=False"):
        GraphedModule(model, decode={"kv_cache_dtype": "fp8", "paged": False})
    GraphedModule(model, decode={"kv_cache_dtype": "auto"}).close()


def test_fp8_asked_of_a_model_the_batch_does_not_serve_says_so(caplog, monkeypatch):
    from graphwrap.decoding.engine import probe

    monkeypatch.setattr(probe, "probe", lambda *a, **k: "a model the test turned away")
    model = _model()
    gm = GraphedModule(model, decode={**FP8, "rows": 2})
    with caplog.at_level("WARNING", logger="graphwrap"):
        out = gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    assert torch.equal(out, _alone(model, [5, 6, 7], 4))  # (its own cache, in its dtype)
    assert any("kv_cache_dtype" in r.getMessage() and "model's own cache" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ the batch's tokens


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral"])
def test_the_batch_in_fp8_gives_the_tokens_of_the_model_over_an_fp8_cache(kind):
    model = _model(kind)
    gm = GraphedModule(model, decode=FP8)
    _batch_against_fp8_alone(gm, model, _prompts([3, 11, 6, 20, 2, 9]), [25, 10, 30, 12, 40, 18])
    server = gm.__dict__["_gw_decode"]
    store = server.store
    assert server.cache.paged and all(t.dtype == torch.float8_e4m3fn for t in store.keys + store.values)
    # The scales: the calibration forward's largest key and value of each layer, with headroom.
    ids = torch.tensor([fp8.calibration_ids(101, fp8.CALIBRATION)])
    with torch.no_grad():
        own = model(input_ids=ids, use_cache=True, **{cache_keyword(model): tr.DynamicCache(config=model.config)})
    cache = getattr(own, "cache", None) or own.past_key_values
    want = fp8.scales_for([float(lay.keys.abs().max()) for lay in cache.layers],
                          [float(lay.values.abs().max()) for lay in cache.layers])
    assert store.scales == want
    d = gm.stats()["decode"]["kv_cache"]
    assert d["dtype"] == "fp8_e4m3" and d["layers"] == 2
    assert d["key_scale"] == [min(s.keys for s in want), max(s.keys for s in want)]
    gm.close()


def test_an_fp8_position_takes_one_byte_a_value():
    model = _model()  # (fp32: 2 layers, keys and values, 2 key heads of 16)
    got = {}
    for kv in ("auto", "fp8"):
        gm = GraphedModule(model, decode={"kv_cache_dtype": kv, "rows": 4})
        gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
        server = gm.__dict__["_gw_decode"]
        got[kv] = (server.cache.token_bytes, server.store.nbytes() // (server.cache.blocks * server.cache.block))
        gm.close()
    values = 2 * 2 * 2 * 16
    assert got == {"auto": (4 * values, 4 * values), "fp8": (values, values)}


def test_long_prompts_in_pieces_over_an_fp8_cache_give_the_model_alones_tokens(monkeypatch):
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (a long prompt that finds the batch empty: in pieces too)
    model = _model()
    gm = GraphedModule(model, decode=FP8)
    _batch_against_fp8_alone(gm, model, _prompts([30, 3, 21, 6, 9]), [12, 30, 10, 20, 15], chunk=8)
    assert gm.stats()["decode"]["prefill_pieces"] >= 4 + 3 + 2
    gm.close()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral"])
def test_an_fp8_pool_read_in_place_with_pieces_inside_steps_gives_the_same_tokens(monkeypatch, kind):
    """As a GPU reads the pool (each row to its own length; a long prompt's pieces inside the
    decoding rows' step), with the kernels' torch references."""
    monkeypatch.setattr(server_mod, "reads_in_place", lambda model, device, kv=None: sdpa_model(model))
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)
    monkeypatch.setattr(pieces_mod, "BUDGET", None)
    model = _model(kind)
    gm = GraphedModule(model, decode=FP8)
    _batch_against_fp8_alone(gm, model, _prompts([3, 30, 6, 2, 19]), [30, 12, 25, 30, 10], chunk=8)
    server = gm.__dict__["_gw_decode"]
    d = gm.stats()["decode"]
    assert server.store.kernel and server.mixed_engine is not None
    assert d["mixed_steps"] > 0 and not d["mixed_failed"], d
    gm.close()


def test_serve_kv_cache_dtype_fp8_reaches_the_batch(tmp_path):
    """``serve --kv-cache-dtype fp8`` is the batch's ``decode={"kv_cache_dtype": "fp8"}``; without
    it the cache is the model's dtype."""
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    import tiny_lm
    from test_http_cpu import _args

    from graphwrap.serve.api import cli

    d = tiny_lm.make(str(tmp_path))
    assert cli.parser().parse_args([d]).kv_cache_dtype is None
    with pytest.raises(SystemExit):
        cli.parser().parse_args([d, "--kv-cache-dtype", "int8"])
    for kv in (None, "fp8"):
        served = cli.load(_args(d, kv_cache_dtype=kv))
        try:
            store = served.gm.__dict__["_gw_decode"].store
            want = torch.float8_e4m3fn if kv else torch.float32
            assert all(t.dtype == want for t in store.keys + store.values)
            assert (served.gm.stats()["decode"]["kv_cache"] is None) == (kv is None)
        finally:
            served.engine.close(cancel=True, timeout=30)


def test_weights_changed_in_place_make_the_fp8_batch_again_with_new_scales():
    """The scales came from the weights the batch was made with: where their values change in
    place (``load_state_dict``, ``mul_``), the next call finds the batch stale, and a new one,
    with scales taken again, gives the changed model's tokens over an FP8 cache."""
    model = _model()
    gm = GraphedModule(model, decode=FP8)
    prompt = _prompts([7])[0]
    gm.generate(torch.tensor([prompt]), max_new_tokens=4)
    first = gm.__dict__["_gw_decode"]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    out = gm.generate(torch.tensor([prompt]), max_new_tokens=20)
    again = gm.__dict__["_gw_decode"]
    assert again is not first and again.store.scales != first.store.scales
    assert torch.equal(out, _fp8_alone(model, prompt, 20, again.store.scales))
    gm.close()


def test_a_batch_in_the_models_dtype_keeps_serving_when_values_change_in_place():
    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=2)
    first = gm.__dict__["_gw_decode"]
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    out = gm.generate(torch.tensor([[5, 6]]), max_new_tokens=6)
    assert gm.__dict__["_gw_decode"] is first  # (its cache is the model's dtype: only the prefixes go)
    assert torch.equal(out, _alone(model, [5, 6], 6))
    gm.close()


@pytest.mark.parametrize("weights", ["fp8", "int8"])
def test_quantized_weights_beside_an_fp8_cache_give_that_models_tokens(weights):
    """``graphwrap.quantize`` and the FP8 cache together: the quantized model's greedy tokens
    decoding alone over an FP8 cache."""
    import graphwrap

    model = graphwrap.quantize(_model(), weights)
    gm = GraphedModule(model, decode=FP8)
    _batch_against_fp8_alone(gm, model, _prompts([3, 11, 6, 20]), [25, 10, 30, 12])
    assert gm.__dict__["_gw_decode"].store.scales is not None
    gm.close()


def test_only_a_gpu_of_compute_capability_8_9_on_has_its_kernels_write_and_read_e4m3(monkeypatch):
    """Elsewhere (an A100, compute capability 8.0) an FP8 pool is written by indexed assignment
    and gathered for the model's attention, in torch: Triton does not convert E4M3 there."""
    monkeypatch.setattr(server_mod.paged_attention, "available", lambda: True)  # (Triton on a GPU, as if)
    model, gpu = _model(), torch.device("cuda", 0)
    for capability, want in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        step_write.writes_e4m3.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fp8.kernels_read(gpu) is want
        assert server_mod.reads_in_place(model, gpu, "fp8") is want
        assert server_mod.reads_in_place(model, gpu, "auto") is True  # (the model's dtype: any such GPU)
    step_write.writes_e4m3.cache_clear()
    assert not fp8.kernels_read(torch.device("cpu"))


def test_an_fp8_batch_under_inference_mode_serves_good_calls_beside_a_bad_one_and_a_cancel():
    """As users call it: under ``torch.inference_mode()``, a token outside the vocabulary gets its
    own clear error and a cancelled call frees its row, while the others get the model's tokens
    over an FP8 cache."""
    model = _model()
    gm = GraphedModule(model, decode={**FP8, "rows": 2})
    prompts = _prompts([5, 9, 4])
    with torch.inference_mode():
        with pytest.raises(GraphwrapError, match="token id 500 is outside"):
            gm.generate(torch.tensor([[5, 500]]), max_new_tokens=3)
        long = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=200)
        good = [gm.submit_generate(torch.tensor([p]), max_new_tokens=20) for p in prompts]
        assert long.cancel()
        outs = [f.result(timeout=60) for f in good]
    scales = gm.__dict__["_gw_decode"].store.scales
    for p, out in zip(prompts, outs):
        assert torch.equal(out, _fp8_alone(model, p, 20, scales))
    d = gm.stats()["decode"]
    assert d["cancelled"] == 1 and d["rows_busy"] == 0 and d["done"] == len(prompts)
    gm.close()
