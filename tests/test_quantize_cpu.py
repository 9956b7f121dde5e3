"""``graphwrap.quantize(model, "fp8")`` on a CPU: each Linear's product from FP8 weights scaled
per output channel and activations scaled per row, against the same arithmetic written out and
against the full-precision product; which layers it takes and leaves; its refusals; and the
shared decode batch over a quantized model gives that model's own greedy tokens."""

import pytest
import torch
import torch.nn as nn

import graphwrap
from graphwrap import GraphedModule, GraphwrapError
from graphwrap.quantized import FP8, FP8_MAX, Fp8Linear, fp8_supported

NO_FP8 = fp8_supported(torch.device("cpu"))
needs_fp8 = pytest.mark.skipif(NO_FP8 is not None, reason=str(NO_FP8))
tr = pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")


def _by_hand(x, linear):
    """The FP8 product written out: per-channel weight scales, per-row input scales."""
    w = linear.weight.detach().float()
    ws = w.abs().amax(dim=1) / FP8_MAX
    wq = (w / ws[:, None]).to(FP8).float() * ws[:, None]
    xs = x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX
    xq = (x.float() / xs).to(FP8).float() * xs
    out = xq @ wq.t()
    return out + linear.bias.float() if linear.bias is not None else out


@needs_fp8
@pytest.mark.parametrize("bias", [False, True])
def test_an_fp8_linear_is_the_fp8_product_and_near_the_full_one(bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias)
    x = torch.randn(3, 5, 64)
    q = Fp8Linear(linear)
    got = q(x)
    assert got.shape == (3, 5, 48) and got.dtype == x.dtype
    assert q.weight_fp8.dtype == FP8 and q.weight_fp8.shape == (48, 64) and q.weight_scale.shape == (1, 48)
    torch.testing.assert_close(got, _by_hand(x, linear), atol=1e-4, rtol=1e-4)
    full = linear(x)
    rel = (got - full).norm() / full.norm()
    assert 0 < rel < 0.06, rel  # (E4M3 keeps 3 bits of mantissa: a few percent)
    zero = q(torch.zeros(2, 64))  # (a row of zeros: no division by zero)
    assert torch.isfinite(zero).all()


@needs_fp8
def test_quantize_takes_the_linear_layers_but_the_head_and_odd_sizes_in_place(gw_log):
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32)), nn.Linear(32, 10))
    model.lm_head = nn.Linear(16, 16)
    same = graphwrap.quantize(model, "fp8")
    assert same is model
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2][0], Fp8Linear)
    assert type(model[3]) is nn.Linear, "10 outputs: not a multiple of 16"
    assert type(model.lm_head) is nn.Linear, "the output head stays in its dtype"
    assert "2 linear layers in FP8 (sharing a buffer: 0 groups of q_proj/k_proj/v_proj, 0 groups of " \
        "gate_proj/up_proj; 0 norms scale their rows for them); 1 left as they are by name (lm_head), 1 whose sizes" in gw_log.text
    assert model[0].training, "a training model's layers stay in training"
    model.eval()
    model[2][0] = nn.Linear(64, 32).eval()
    graphwrap.quantize(model, "fp8")  # (again: only what is left to take)
    assert isinstance(model[2][0], Fp8Linear) and not model[2][0].training, "an eval layer stays in eval (else: eager)"
    assert isinstance(model[0], Fp8Linear) and type(model[0].weight_fp8) is torch.Tensor


def test_quantize_refuses_what_it_cannot_serve(monkeypatch):
    with pytest.raises(GraphwrapError, match="kind must be one of 'fp8'"):
        graphwrap.quantize(nn.Linear(16, 16), "int3")
    from graphwrap import quantized as q

    monkeypatch.setattr(q, "fp8_supported", lambda device: "FP8 products need compute capability 8.9 or later")
    model = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(GraphwrapError, match="compute capability 8.9"):
        graphwrap.quantize(model, "fp8")
    assert type(model[0]) is nn.Linear, "refused: nothing changed"


def _llama(hidden=64, intermediate=128):
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=None, pad_token_id=0)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def own_tokens(model, lengths, new: int, seed: int, device="cpu", rounds: int = 1):
    """A GraphedModule over ``model`` (returned, open) whose shared batch, given random prompts of
    ``lengths`` at once (each round again: the second replays what the first captured), gives
    each ``model.generate``'s greedy tokens."""
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 101, (1, n), generator=g).to(device) for n in lengths]
    for _ in range(rounds):
        futs = [gm.submit_generate(p, max_new_tokens=new, do_sample=False) for p in prompts]
        for p, f in zip(prompts, futs):
            with torch.no_grad():
                want = model.generate(input_ids=p, max_new_tokens=new, do_sample=False)
            assert torch.equal(f.result(timeout=300), want)
    return gm


@needs_fp8
def test_the_shared_batch_over_a_quantized_model_gives_its_own_greedy_tokens():
    model = graphwrap.quantize(_llama(), "fp8")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].mlp.gate_proj, Fp8Linear) and type(model.lm_head) is nn.Linear
    gm = own_tokens(model, (5, 17, 40), new=12, seed=1)
    assert gm.stats()["generate"] == {"graphwrap's shared decode batch": 3}
    gm.close()


@pytest.mark.parametrize("kind", [pytest.param("fp8", marks=needs_fp8), "int8", "int4"])
def test_serve_quantization_serves_the_quantized_models_greedy_text(tmp_path, kind):
    """GPT-2's Conv1D layers (their weight [in, out]) in FP8, int8 or int4 behind the server: its
    greedy text is the quantized model's own."""
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    import tiny_lm
    from test_http_cpu import Running, _args, greedy, post

    from graphwrap.quantized import Int4Linear, Int8Linear, QuantizedLinear
    from graphwrap.serve.api import cli

    cls = {"fp8": Fp8Linear, "int8": Int8Linear, "int4": Int4Linear}[kind]
    d = tiny_lm.make(str(tmp_path), width=128)  # (int4's groups: inputs a multiple of 128)
    r = Running(cli.load(_args(d, served_model_name="tiny", quantization=kind)))
    try:
        layers = [m for m in r.served.gm.module.modules() if isinstance(m, QuantizedLinear)]
        assert len(layers) == 8 and all(type(m) is cls for m in layers)
        ids = r.served.tokenizer("the quick brown fox")["input_ids"]
        status, body, _ = post(r.port, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 8,
                                                           "temperature": 0})
        assert status == 200 and body["choices"][0]["text"] == greedy(r, ids, 8)[1], body
    finally:
        r.stop()
    assert cli.parser().parse_args([d, "--quantization", kind]).quantization == kind


@pytest.mark.parametrize("kind", [pytest.param("fp8", marks=needs_fp8), "int8", "int4"])
def test_a_model_quantized_behind_its_wrapper_is_served_quantized(monkeypatch, kind):
    """quantize after the wrap (the batch made over the full model), the next call under
    inference_mode: its forwards run the new layers (counted: on this random model the
    quantized tokens may be the full model's) and give the quantized model's tokens."""
    from graphwrap import quantized

    cls = {"fp8": quantized.Fp8Linear, "int8": quantized.Int8Linear, "int4": quantized.Int4Linear}[kind]
    model = _llama(hidden=128, intermediate=256)
    gm = GraphedModule(model)
    prompt = torch.randint(2, 101, (1, 20), generator=torch.Generator().manual_seed(3))
    before = gm.generate(prompt, max_new_tokens=10, do_sample=False)
    graphwrap.quantize(model, kind)
    with torch.inference_mode():
        want = model.generate(input_ids=prompt, max_new_tokens=10, do_sample=False)
        calls = []
        real = cls.rows
        monkeypatch.setattr(cls, "rows", staticmethod(lambda *a: calls.append(1) or real(*a)))
        got = gm.generate(prompt, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want) and calls, "the batch's forwards ran the quantized layers"
    assert gm.stats()["generate"] == {"graphwrap's shared decode batch": 2}
    assert before.shape == got.shape
    gm.close()


@needs_fp8
def test_the_batchs_check_of_a_quantized_model_runs_its_products_unrounded(monkeypatch):
    """The shared batch's check compares its rows with the model's own cache; FP8 rounding of
    activations would magnify attention's rounding-level differences past its tolerance (random
    8B and 1.1B shapes were refused so), so it runs under exact_products: the FP8 weight in the
    input's dtype, on that thread only."""
    import threading

    from graphwrap.decoding.engine import probe as probe_mod
    from graphwrap.quantized import exact_products

    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q = Fp8Linear(linear)
    x = torch.randn(5, 64)
    with exact_products():
        w = q.weight_fp8.float() * q.weight_scale.t()
        torch.testing.assert_close(q(x), x @ w.t() + linear.bias.detach(), atol=1e-5, rtol=1e-5)
        other = []
        t = threading.Thread(target=lambda: other.append(q(x)))
        t.start()
        t.join()
        assert torch.equal(other[0], _plain(q, x)), "another thread's products stay FP8's"
    assert torch.equal(q(x), _plain(q, x))
    seen = []
    real = probe_mod.probe

    def probe(model, *a, **k):
        seen.append(not torch.equal(model.model.layers[0].mlp.up_proj(torch.ones(1, 64)),
                                    _plain(model.model.layers[0].mlp.up_proj, torch.ones(1, 64))))
        return real(model, *a, **k)

    monkeypatch.setattr(probe_mod, "probe", probe)
    model = graphwrap.quantize(_llama(), "fp8")
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    assert seen == [True] and gm.stats()["generate"] == {"graphwrap's shared decode batch": 1}
    gm.close()


@needs_fp8
def test_an_attention_layers_query_key_and_value_share_one_buffer_and_make_one_product(gw_log):
    """quantize lays each attention layer's q, k and v FP8 weights and scales out in one buffer,
    the layers' views of it; together() scales the input once and makes one product, each part
    the layer's own output; a layer whose weight no longer lies in the buffer (moved, replaced),
    a layer with a hook, and exact products on this thread make their own products again."""
    from graphwrap.quantized import _joined, exact_products, together

    model = graphwrap.quantize(_llama(), "fp8")
    assert "(sharing a buffer: 2 groups of q_proj/k_proj/v_proj, 2 groups of gate_proj/up_proj; 4 norms scale " \
        "their rows for them)" in gw_log.text
    attn = model.model.layers[1].self_attn
    layers = [attn.q_proj, attn.k_proj, attn.v_proj]
    joined = _joined([m.weight_fp8 for m in layers], 0)
    assert joined is not None and joined.shape == (64 + 32 + 32, 64)
    assert _joined([m.weight_scale for m in layers], 1) is not None
    assert attn.q_proj.weight_scale.untyped_storage().data_ptr() == attn.v_proj.weight_scale.untyped_storage().data_ptr()
    mlp = model.model.layers[1].mlp
    assert _joined([mlp.gate_proj.weight_fp8, mlp.up_proj.weight_fp8], 0).shape == (2 * 128, 64), "gate and up too"
    x = torch.randn(2, 7, 64)
    outs = together(x, layers)
    assert outs is not None and [o.shape for o in outs] == [(2, 7, 64), (2, 7, 32), (2, 7, 32)]
    for m, o in zip(layers, outs):
        torch.testing.assert_close(o, m(x), atol=1e-5, rtol=1e-5)
    assert not any(torch.equal(outs[0][..., :32], o) for o in outs[1:]), "each layer's own part"
    with exact_products():
        assert together(x, layers) is None
    hook = attn.k_proj.register_forward_hook(lambda *a: None)
    assert together(x, layers) is None, "a hook sees its layer's own call"
    hook.remove()
    assert together(x, [model.model.layers[0].self_attn.q_proj, attn.k_proj, attn.v_proj]) is None, "two layers' views"
    import copy

    twin = copy.deepcopy(model).model.layers[1].self_attn  # (a deep copy keeps the sharing)
    assert _joined([twin.q_proj.weight_fp8, twin.k_proj.weight_fp8, twin.v_proj.weight_fp8], 0) is not None
    attn.v_proj._buffers["weight_fp8"] = attn.v_proj.weight_fp8.clone()
    assert together(x, layers) is None, "a weight moved out of the buffer"
    graphwrap.quantize(model, "fp8")  # (again: the group is laid out anew)
    assert _joined([m.weight_fp8 for m in layers], 0) is not None
    torch.testing.assert_close(together(x, layers)[2], attn.v_proj(x), atol=1e-5, rtol=1e-5)


@needs_fp8
def test_the_norms_before_fp8_layers_are_marked_and_their_scaled_rows_are_found_only_for_their_own_output():
    """quantize marks the RMSNorms whose output goes to FP8 layers (before the attention and the
    MLP, not the final one before the head); the rows a marked norm scaled (normed, on a GPU)
    are found for that very output only, while it is unwritten, on its own thread, until
    forget()."""
    import threading

    from graphwrap import quantized as qz

    model = graphwrap.quantize(_llama(), "fp8")
    layer = model.model.layers[0]
    assert getattr(layer.input_layernorm, qz.NORMED) and getattr(layer.post_attention_layernorm, qz.NORMED)
    assert not getattr(model.model.norm, qz.NORMED, False), "the head stays in its dtype"
    y = torch.randn(2, 3, 64)
    q, s = qz.rows_to_fp8(y.reshape(-1, 64))
    qz._HERE.scaled = (y, y._version, q, s)
    assert qz._scaled(y, 64) == (q, s)
    assert qz._scaled(y.clone(), 64) is None, "another tensor of the same values"
    assert qz._scaled(y, 32) is None, "another width"
    seen = []
    other = threading.Thread(target=lambda: seen.append(qz._scaled(y, 64)))
    other.start()
    other.join()
    assert seen == [None], "another thread's"
    ref = layer.self_attn.q_proj(y)
    qz._HERE.scaled = (y, y._version, torch.zeros_like(q), s)
    assert torch.equal(layer.self_attn.q_proj(y), torch.zeros_like(ref)), "a layer takes the rows found"
    y.mul_(2)
    assert qz._scaled(y, 64) is None, "written since"
    qz._HERE.scaled = (y, y._version, q, s)
    qz.forget()
    assert qz._scaled(y, 64) is None


@needs_fp8
def test_a_dtype_change_after_quantize_keeps_the_fp8_weights_and_their_scales():
    """``model.half()`` (or ``.to(dtype)``) after quantize: E4M3 counts as a floating dtype, so
    the weight became fp16 and its scales fp16, rounded, and the product refused them. They stay
    E4M3 and float32; the bias follows the model's dtype; q/k/v keep their shared buffer; the
    product is the one before, in the new dtype; a move to the meta device and back (to_empty)
    still reaches them."""
    from graphwrap.quantized import _joined, together

    model = graphwrap.quantize(_llama(), "fp8")
    attn = model.model.layers[0].self_attn
    x = torch.randn(3, 64)
    before = attn.q_proj(x)
    scale = attn.q_proj.weight_scale.clone()
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        model.to(dtype)
        for m in (attn.q_proj, model.model.layers[1].mlp.down_proj):
            assert m.weight_fp8.dtype == FP8 and m.weight_scale.dtype == torch.float32
        assert torch.equal(attn.q_proj.weight_scale, scale), "the scales not rounded"
        assert _joined([attn.q_proj.weight_fp8, attn.k_proj.weight_fp8, attn.v_proj.weight_fp8], 0) is not None
        got = attn.q_proj(x.to(dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), before, atol=3e-2 if dtype != torch.float64 else 1e-5, rtol=2e-2)
        assert together(x.to(dtype), [attn.q_proj, attn.k_proj, attn.v_proj]) is not None
    model.float()
    layer = Fp8Linear(nn.Linear(32, 16)).to("meta")
    assert layer.weight_fp8.is_meta and layer.weight_fp8.dtype == FP8
    layer.to_empty(device="cpu")
    assert layer.weight_fp8.device.type == "cpu" and layer.weight_fp8.dtype == FP8
    assert layer.weight_scale.dtype == torch.float32


def test_the_few_rows_products_shape_of_work_follows_the_outputs_and_the_chips_sms():
    """What fp8_products.py --tune found fastest at one row on an H200 (132 SMs) for the
    Llama-3-8B shape's widths (q/k/v as one, o, gate and up as one, down, k or v), and the rule's
    ends on smaller and larger chips."""
    from graphwrap.quantized import ROWS, shape_of_work

    shapes = [shape_of_work(n, k, 132) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                                    (1024, 4096))]
    assert shapes == [(64, 256, 1), (32, 256, 1), (64, 128, 1), (32, 256, 4), (16, 256, 1)]
    assert shape_of_work(4096, 4096, 60)[0] == 64 and shape_of_work(4096, 4096, 200)[0] == 32
    assert shape_of_work(4096, 4096, 600)[0] == 16 and shape_of_work(16, 16, 132) == (16, 256, 1)
    assert shape_of_work(28672, 4096, 240)[1] == 256, "not more programs than twice the SMs"
    assert shape_of_work(4096, 14336, 60)[2] == 1, "as many programs as SMs (64 of 64 outputs): not split"
    assert ROWS == 16, "at 64 rows torch's product was the faster (fp8_products.py)"


def test_e4m3_tiles_take_the_products_torchs_tiles_leave_sms_idle_in():
    """fp8_tile_shape: graphwrap's E4M3 tiles where torch's tiles of 128 x 128 would fill less than
    two thirds of the SMs (the Llama-3-8B shape's output and down projections up to 256 rows on
    132 SMs), torch's product elsewhere; by 64 outputs where that makes one wave of programs at
    most, else by 128 where that does, else torch's; every shape divides its product."""
    from graphwrap.quantized import fp8_tile_shape

    widths = {"qkv": (6144, 4096), "o": (4096, 4096), "gate-up": (28672, 4096), "down": (4096, 14336)}
    at = {rows: {w: fp8_tile_shape(rows, n, k, 132) for w, (n, k) in widths.items()} for rows in (17, 64, 128, 256, 512)}
    assert at[256] == {"qkv": None, "o": (64, 128, 256, 4, 4), "gate-up": None, "down": (64, 128, 256, 4, 4)}
    assert at[64] == {"qkv": (64, 64, 256, 4, 4), "o": (64, 64, 256, 4, 4), "gate-up": None, "down": (64, 64, 256, 4, 4)}
    assert at[128]["qkv"] == (64, 128, 256, 4, 4) and at[128]["o"] == (64, 64, 256, 4, 4), "96 and 64 programs of 128"
    assert all(s is None for s in at[512].values()), "four tiles of rows: torch's fill the SMs"
    assert all(at[r]["gate-up"] is None for r in at), "224 of torch's tiles at 128 rows already"
    for rows in range(17, 600, 7):
        for sms in (78, 114, 132, 170):
            for n, k in list(widths.values()) + [(2560, 2048), (64, 128), (4160, 4224)]:
                shape = fp8_tile_shape(rows, n, k, sms)
                if shape is None:
                    continue
                assert -(-rows // 128) * -(-n // 128) * 3 < 2 * sms
                bm, bn, bk, warps, stages = shape
                assert n % bn == 0 and k % bk == 0 and -(-rows // bm) * (n // bn) <= sms
                assert bn == 64 or -(-rows // bm) * (n // 64) > sms, "64 outputs where they make one wave"
    assert fp8_tile_shape(256, 2560, 2048, 132)[1] == 128 and fp8_tile_shape(512, 2560, 2048, 132) is None, \
        "160 programs of 64 outputs: 128; 160 of 128 too: torch's (the 1.1B shape's q, k and v)"
    assert fp8_tile_shape(64, 4096, 4096 + 128, 132)[2] == 128, "no multiple of 256: 128 a step"
    assert fp8_tile_shape(64, 4096, 4096 + 64, 132) is None and fp8_tile_shape(64, 4096 + 32, 4096, 132) is None


def test_one_row_takes_the_cuda_cores_at_every_width_but_fp8s_widest():
    """What the forms timed at one row on an H200 found: the CUDA cores' kernel (one_row) for
    int8 at every width and for FP8 up to 8,192 outputs (the gate or up projection, 14,336, and
    both as one, 28,672, are faster in tiles); four outputs a program; 512 inputs a step between
    4,096 and 16,384 outputs, else 1,024."""
    from graphwrap.quantized import row_shape

    assert row_shape(6144, 4096, fp8=True) == (4, 512, 4)
    assert row_shape(4096, 4096, fp8=True) == (4, 1024, 4)
    assert row_shape(4096, 14336, fp8=True) == (4, 1024, 4)
    assert row_shape(28672, 4096, fp8=True) is None
    assert row_shape(28672, 4096, fp8=False) == (4, 1024, 4)
    assert row_shape(14336, 4096, fp8=True) is None and row_shape(14336, 4096, fp8=False) == (4, 512, 4)
    assert row_shape(8192, 4096, fp8=True) == (4, 512, 4) and row_shape(8193, 4096, fp8=True) is None


def test_int8_layers_past_64_rows_take_tiles_of_128_by_128():
    """few_rows' tiles past ROWS (int8 weight-only layers whose widths int8_tiles does not take):
    64 rows by 64 outputs on 4 warps up to 64 rows, as before; past them 128 by 128 on 8 warps
    (256 at once 0.58x fp16 against 0.52x on an H200, when every int8 layer took them)."""
    from graphwrap.quantized import ROWS, tiles

    assert tiles(ROWS + 1) == tiles(64) == (64, 64, 64, 1, 4, 4)
    assert tiles(65) == tiles(256) == tiles(4096) == (128, 128, 64, 1, 8, 3)


def test_int8_layers_past_16_rows_take_tiles_with_the_weights_as_the_left_operand():
    """int8_tile_shape: past ROWS rows, where the widths divide, graphwrap's tiles that hand the
    weights to the tensor cores from registers; up to 1,024 rows 64 outputs and 128 inputs a step,
    rows a program the fewest of 32, 64 and 128 that make one wave (else that hold every row, at
    most 128), 4 stages in one wave, else 3; past 1,024 rows tiles of 128 by 128 on 8 warps;
    widths that do not divide keep few_rows' tiles."""
    from graphwrap.quantized import ROWS, int8_tile_shape

    assert int8_tile_shape(ROWS, 4096, 4096, 132) is None
    assert int8_tile_shape(64, 4096, 4096, 132) == (32, 64, 128, 4, 4), "64 x 2 programs: one wave"
    assert int8_tile_shape(64, 6144, 4096, 132) == (64, 64, 128, 4, 4), "96 x 2 of 32 rows: 96 of 64"
    assert int8_tile_shape(64, 28672, 4096, 132) == (64, 64, 128, 4, 3), "448 programs: three stages"
    assert int8_tile_shape(256, 4096, 14336, 132) == (128, 64, 128, 4, 4)
    assert int8_tile_shape(256, 6144, 4096, 132) == (128, 64, 128, 4, 3)
    assert int8_tile_shape(20, 28672, 4096, 132)[0] == 32, "every row in one tile of 32"
    assert int8_tile_shape(128, 6144, 4096, 132) == (128, 64, 128, 4, 4), "96 programs of 128 rows"
    assert int8_tile_shape(128, 4096, 4096, 132) == (64, 64, 128, 4, 4), "128 programs of 64 rows"
    assert int8_tile_shape(2048, 4096, 14336, 132) == (128, 128, 64, 8, 3)
    assert int8_tile_shape(2048, 4160, 4096, 132)[:2] == (128, 64), "no multiple of 128 outputs"
    assert int8_tile_shape(64, 4096, 200, 132) is None and int8_tile_shape(64, 40, 4096, 132) is None
    for m in range(ROWS + 1, 3000, 37):
        for k, n in ((4096, 6144), (14336, 4096), (2048, 2560), (128, 64)):
            bm, bn, bk, warps, stages = int8_tile_shape(m, n, k, 132)
            assert n % bn == 0 and k % bk == 0 and bm in (32, 64, 128) and stages in (3, 4)
            assert bm >= min(m, 32) and (bm == 32 or m > bm // 2), "no tile of rows past the rows"


def test_int4_layers_of_up_to_64_rows_take_tiles_with_the_weights_as_the_left_operand():
    """weight_only.tile_shape: more than SWAPPED rows keep int4_product's tiles; up to them, 128
    outputs a program (64 where 128 does not divide); 16 rows a program up to ROWS rows, 32 up
    to 32, past them 64 where four parts of a tile of rows outnumber the SMs, else 32; the
    groups in the fewest parts of 1, 2, 4 (8 up to 16 rows, 4 past them) that make six programs
    an SM; widths it does not divide: None."""
    from graphwrap.weight_only import ROWS, SWAPPED, tile_shape

    assert tile_shape(SWAPPED + 1, 4096, 4096, 132) is None and SWAPPED == 64
    at = {m: [tile_shape(m, n, k, 132) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
          for m in (1, 16, 17, 64)}
    assert at[1] == at[16] == [(16, 128, 8, 4, 3), (16, 128, 8, 4, 3), (16, 128, 4, 4, 3), (16, 128, 8, 4, 3)]
    assert at[17] == [(32, 128, 4, 4, 3)] * 4, "past 16 rows, four parts at most"
    assert at[64] == [(64, 128, 4, 4, 3), (32, 128, 4, 4, 3), (64, 128, 4, 4, 3), (32, 128, 4, 4, 3)], \
        "64 rows a program where 4 parts of a tile of rows outnumber the SMs (48 and 224 outputs' tiles, not 32)"
    assert tile_shape(33, 4096, 4096, 100)[0] == 64 and tile_shape(32, 6144, 4096, 132)[0] == 32
    assert tile_shape(16, 28672, 4096, 264)[2] == 8, "224 programs on twice the SMs: eight parts"
    assert tile_shape(16, 28672, 4096, 30)[2] == 1, "224 programs: six an SM of 30 already"
    assert tile_shape(4, 4160, 4096, 132)[1] == 64 and tile_shape(4, 4160 + 32, 4096, 132) is None
    assert tile_shape(4, 4096, 4096 + 64, 132) is None, "no whole group"
    assert tile_shape(4, 192, 256, 132) == (16, 64, 2, 4, 3), "two groups: two parts at most"
    for m in range(1, SWAPPED + 1):
        for n, k in ((6144, 4096), (4096, 14336), (2560, 2048), (64, 128)):
            bm, bn, split, warps, stages = tile_shape(m, n, k, 132)
            assert bm == 16 if m <= ROWS else bm in (32, 64) and (bm == 32 or m > 32) and n % bn == 0
            assert 1 <= split <= min(8 if m <= ROWS else 4, k // 128)


def _plain(q, x):
    from graphwrap.quantized import rows_to_fp8

    a, s = rows_to_fp8(x.reshape(-1, q.in_features))
    out = torch._scaled_mm(a, q.weight_fp8.t(), scale_a=s, scale_b=q.weight_scale, out_dtype=x.dtype)
    return out + q.bias if q.bias is not None else out


# ------------------------------------------------------------------ int8 and int4 weight-only

def _torchao():
    return pytest.importorskip("torchao", reason="needs torchao, which graphwrap does not install: pip install torchao")


def _its_product_through_a_dtype_change(layer, linear, weight, within, stored, scales):
    """``layer``'s output is ``x @ weight.T`` (+ the bias), within ``within`` of ``linear``'s
    (relative); after ``half()`` its quantized weight stays ``stored`` and its scales ``scales``,
    and it answers in fp16."""
    x = torch.randn(3, 5, linear.in_features)
    want = x @ weight.t() + (linear.bias.detach() if linear.bias is not None else 0)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    rel = (layer(x) - linear(x)).norm() / linear(x).norm()
    assert 0 < rel < within, rel
    layer.half()
    assert getattr(layer, layer.QUANTIZED).dtype == stored and layer.weight_scale.dtype == scales
    assert layer(x.half()).dtype == torch.float16


@pytest.mark.parametrize("bias", [False, True])
def test_an_int8_layer_is_its_weight_rounded_per_channel_and_near_the_full_product(bias):
    """Int8Linear: the weight rounded to int8 with a scale per output channel (its largest
    magnitude over 127), the input as it is; a dtype change keeps the int8 weight and float32
    scales; a layer of any size is taken (no multiple of 16 asked)."""
    from graphwrap.quantized import Int8Linear

    torch.manual_seed(1)
    linear = nn.Linear(40, 24, bias=bias)
    layer = Int8Linear(linear)
    w = linear.weight.detach()
    scale = w.abs().amax(dim=1) / 127
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.shape == (24, 40)
    assert torch.equal(layer.weight_int8, (w / scale[:, None]).round().to(torch.int8))
    assert layer.weight_int8.abs().amax(dim=1).eq(127).all(), "each channel's largest magnitude is 127"
    _its_product_through_a_dtype_change(layer, linear, (layer.weight_int8.float() * scale[:, None]), 0.01,
                                        torch.int8, torch.float32)


def test_a_model_quantized_by_torchao_itself_wraps_and_decodes_in_the_shared_batch():
    _torchao()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = _llama()
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))  # (torchao's default sets Inductor's options)
    gm = GraphedModule(model)
    prompt = torch.randint(2, 101, (1, 13), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(gm.generate(prompt, max_new_tokens=12, do_sample=False), want)
    assert gm.stats()["generate"] == {"graphwrap's shared decode batch": 1}
    gm.close()


def test_int4_and_int8_need_no_torchao_and_an_unknown_kind_is_refused(monkeypatch):
    from graphwrap.quantized import Int4Linear, Int8Linear

    monkeypatch.setitem(__import__("sys").modules, "torchao", None)  # (an import of it now fails)
    model = graphwrap.quantize(_llama(hidden=128, intermediate=256), "int4")
    assert type(model.model.layers[0].self_attn.q_proj) is Int4Linear
    graphwrap.quantize(model, "int8")  # (what int4 took is quantized already: left as it is)
    assert type(model.model.layers[0].self_attn.q_proj) is Int4Linear
    model = graphwrap.quantize(_llama(), "int8")
    assert type(model.model.layers[0].self_attn.q_proj) is Int8Linear
    with pytest.raises(GraphwrapError, match="kind must be one of 'fp8', 'int8', 'int4'"):
        graphwrap.quantize(model, "int2")


@pytest.mark.parametrize("bias", [False, True])
def test_an_int4_layer_packs_groups_of_128_two_values_a_byte_and_is_its_unpacked_weights_product(bias):
    """Int4Linear: each group of 128 inputs as values 0-15 on the grid of its scale and offset
    (fp16: the group's range over 15 and its smallest weight), byte j holding input j low and
    input 64 + j high; the product is the unpacked weight's; a dtype change keeps the bytes and
    the fp16 scales."""
    from graphwrap.quantized import Int4Linear
    from graphwrap.weight_only import unpack

    torch.manual_seed(2)
    linear = nn.Linear(256, 24, bias=bias)
    with torch.no_grad():
        linear.weight[3, :128] = 0.25  # (a group of one value: kept as its offset, exactly)
    layer = Int4Linear(linear)
    w = linear.weight.detach()
    assert layer.weight_int4.dtype == torch.uint8 and layer.weight_int4.shape == (24, 128)
    assert layer.weight_scale.dtype == torch.float16 and layer.weight_scale.shape == (24, 2, 2)
    assert (layer.in_features, layer.out_features) == (256, 24)
    groups = w.reshape(24, 2, 128)
    scale, offset = layer.weight_scale[..., 0].float(), layer.weight_scale[..., 1].float()
    assert torch.equal(offset, groups.amin(dim=2).half().float())
    assert torch.equal(scale, ((groups.amax(dim=2) - groups.amin(dim=2)) / 15).half().float())
    b = layer.weight_int4[5, 64:128]  # (row 5's second group)
    values = ((groups[5, 1] - offset[5, 1]) / scale[5, 1]).round().clamp(0, 15).to(torch.uint8)
    assert torch.equal(b & 0xF, values[:64]) and torch.equal(b >> 4, values[64:])
    back = unpack(layer.weight_int4, layer.weight_scale)
    assert torch.equal(back[3, :128], torch.full((128,), 0.25))
    assert ((back - w).abs().reshape(24, 2, 128) <= scale[..., None] / 2 + 1e-3 * scale[..., None] + 1e-7).all(), \
        "each weight within half a step of its group's grid"
    _its_product_through_a_dtype_change(layer, linear, back, 0.1, torch.uint8, torch.float16)


def test_an_int4_layer_from_gpt2s_conv1d_takes_its_weight_the_right_way_round():
    """transformers' Conv1D holds its weight [in, out]: the int4 layer packs it as [out, in], so
    its output is near the Conv1D's own."""
    from transformers.pytorch_utils import Conv1D

    from graphwrap.quantized import Int4Linear

    torch.manual_seed(3)
    conv = Conv1D(384, 128)  # (384 outputs of 128 inputs)
    layer = Int4Linear(conv)
    assert (layer.in_features, layer.out_features) == (128, 384)
    x = torch.randn(4, 128)
    rel = (layer(x) - conv(x)).norm() / conv(x).norm()
    assert rel < 0.1, rel


def test_int4_leaves_layers_whose_inputs_are_not_a_multiple_of_128_and_says_so(gw_log):
    from graphwrap.quantized import Int4Linear

    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 128), nn.Linear(128, 10))
    graphwrap.quantize(model, "int4")
    assert type(model[0]) is Int4Linear and type(model[2]) is nn.Linear and type(model[3]) is Int4Linear
    assert "quantize int4: 2 linear layers in int4 weight-only (sharing a buffer: 0 groups of q_proj/k_proj/v_proj, " \
        "0 groups of gate_proj/up_proj); 0 left as they are by name (lm_head), 1 whose inputs are not a multiple of " \
        "128, 0 past fp16's range" in gw_log.text
    big = nn.Linear(128, 16)
    with torch.no_grad():
        big.weight[0, 0] = 1e6  # (a group's range over 15 past fp16's largest)
    wrapped = nn.Sequential(big)
    graphwrap.quantize(wrapped, "int4")
    assert type(wrapped[0]) is nn.Linear and "1 past fp16's range" in gw_log.text


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_weight_only_layers_give_the_shared_batch_the_quantized_models_own_tokens(gw_log, kind):
    """graphwrap's own int8 and int4 layers (no torchao): every linear but the head, q/k/v and
    gate/up in one buffer each (together makes q/k/v as one product and gated gate/up as one,
    each the layers' own output); the shared batch gives the quantized model's own greedy
    tokens, and the wrapper's forward its logits."""
    from graphwrap.quantized import Int4Linear, Int8Linear, gated, together

    cls = Int8Linear if kind == "int8" else Int4Linear
    model = graphwrap.quantize(_llama(hidden=128, intermediate=256), kind)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
    assert type(attn.q_proj) is cls and type(mlp.down_proj) is cls
    assert type(model.lm_head) is nn.Linear, "the head stays in its dtype"
    assert f"quantize {kind}: 14 linear layers in {kind} weight-only (sharing a buffer: 2 groups of " \
        "q_proj/k_proj/v_proj, 2 groups of gate_proj/up_proj); 1 left as they are by name (lm_head)" in gw_log.text
    x = torch.randn(2, 3, 128)
    outs = together(x, [attn.q_proj, attn.k_proj, attn.v_proj])
    assert outs is not None
    for m, o in zip((attn.q_proj, attn.k_proj, attn.v_proj), outs):
        torch.testing.assert_close(o, m(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gated(x, mlp.gate_proj, mlp.up_proj, mlp.down_proj), mlp(x), atol=1e-6, rtol=1e-6)
    gm = own_tokens(model, (4, 11, 23), new=10, seed=4)
    assert gm.stats()["generate"] == {"graphwrap's shared decode batch": 3}
    x = torch.randint(2, 101, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(gm(x).logits, model(x).logits)
    gm.close()
