"""The shared batch's paged cache on a GPU: steps replay graphs over rows whose blocks are
scattered through the pool, long prompts go in pieces, sequences wait for blocks, the pool keeps
to its share of the free memory and nothing grows over thousands of requests; greedy tokens
against model.generate alone (fp32, TF32 off: equal)."""

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule
from graphwrap.decoding.cache.pool import BLOCK, scratch_blocks
from graphwrap.decoding.engine import pieces
from graphwrap.decoding.engine import server as server_mod

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("fp32_exact")]
DEV = "cuda"
tr = pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")
SHARED = "graphwrap's shared decode batch"
LAYERS, KV_HEADS, HEAD = 4, 2, 64
TOKEN_BYTES = LAYERS * 2 * KV_HEADS * HEAD * 4


def _model(kind="llama", positions=512):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=LAYERS, n_embd=128, n_head=2, vocab_size=1000, n_positions=positions,
                            bos_token_id=1, eos_token_id=None, pad_token_id=0)
    else:
        cfg = tr.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                             num_key_value_heads=KV_HEADS, vocab_size=1000, max_position_embeddings=positions,
                             bos_token_id=1, eos_token_id=None, pad_token_id=0)
    return tr.AutoModelForCausalLM.from_config(cfg).to(DEV).eval()


def _requests(n, seed=0, lens=(3, 60), news=(5, 40)):
    g = torch.Generator().manual_seed(seed)
    ls = torch.randint(*lens, (n,), generator=g).tolist()
    ks = torch.randint(*news, (n,), generator=g).tolist()
    return [(torch.randint(2, 1000, (1, p), generator=g).to(DEV), k) for p, k in zip(ls, ks)]


@pytest.mark.parametrize("dtype,hq,hkv,d,window,softcap", [
    (torch.float16, 32, 8, 128, None, None), (torch.float16, 12, 12, 64, None, None),
    (torch.float32, 4, 2, 64, None, None), (torch.bfloat16, 8, 1, 80, None, None),
    (torch.float16, 32, 8, 128, 100, None), (torch.float32, 8, 4, 64, 17, 5.0), (torch.float16, 16, 8, 64, 64, 30.0),
    (torch.bfloat16, 8, 4, 256, 100, 50.0), (torch.float16, 16, 16, 256, None, None)])  # Gemma's 256-wide heads
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_the_paged_attention_kernel_reads_each_rows_own_blocks(dtype, hq, hkv, d, window, softcap, splits):
    """Each row over its own positions, in one program a row and key head or split between up
    to ``splits`` (rows of one tile to rows of 63), joined."""
    from graphwrap.decoding.kernels import paged_attention

    assert paged_attention.available(), "Triton comes with PyTorch's CUDA wheels"
    g = torch.Generator(device=DEV).manual_seed(0)
    blocks, block, n = 300, 16, 9
    k_pool = torch.randn((blocks, block, hkv, d), generator=g, device=DEV).to(dtype)
    v_pool = torch.randn((blocks, block, hkv, d), generator=g, device=DEV).to(dtype)
    lengths = torch.tensor([1, 15, 16, 17, 64, 65, 200, 513, 1000], device=DEV)
    table = torch.randint(1, blocks, (n, 64), generator=g, device=DEV)  # scattered, never block 0
    query = torch.randn((n, hq, 1, d), generator=g, device=DEV).to(dtype)
    got = paged_attention.attend(query, k_pool, v_pool, table, lengths, 0.1, window, softcap, splits)
    want = paged_attention.reference(query, k_pool, v_pool, table, lengths, 0.1, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == (n, 1, hq, d)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,hq,hkv,d,window,softcap", [
    (torch.float16, 32, 8, 128, None, None), (torch.float32, 8, 4, 64, 17, 5.0), (torch.bfloat16, 8, 1, 80, 100, None)])
def test_a_split_step_balances_its_rows_by_the_steps_work(dtype, hq, hkv, d, window, softcap):
    """Past SPLIT_FROM, each row's programs take at least the step's share of its tiles
    (``work_of``): from the window's 16 parts a row down to one, every split gives the
    reference's attention, a row of uneven length beside short ones as well."""
    from graphwrap.decoding.kernels import paged_attention

    g = torch.Generator(device=DEV).manual_seed(2)
    blocks, block, n = 900, 16, 12
    k_pool = torch.randn((blocks, block, hkv, d), generator=g, device=DEV).to(dtype)
    v_pool = torch.randn((blocks, block, hkv, d), generator=g, device=DEV).to(dtype)
    lengths = torch.tensor([4000, 1, 15, 17, 64, 65, 200, 513, 1000, 1025, 2048, 3000], device=DEV)
    table = torch.randint(1, blocks, (n, 256), generator=g, device=DEV)
    query = torch.randn((n, hq, 1, d), generator=g, device=DEV).to(dtype)
    want = paged_attention.reference(query, k_pool, v_pool, table, lengths, 0.1, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    step = paged_attention.work_of(lengths, d, window)
    for work in (step, step * 64, torch.tensor(10 ** 9, device=DEV)):  # (the last: one program a row)
        got = paged_attention.attend(query, k_pool, v_pool, table, lengths, 0.1, window, softcap,
                                     paged_attention.SPLITS, work=work)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,hq,hkv,d,width,start,valid,window,softcap", [
    (torch.float16, 32, 8, 128, 128, 5000, 128, None, None), (torch.float16, 32, 8, 128, 128, 0, 77, None, None),
    (torch.float32, 4, 2, 64, 32, 300, 32, None, None), (torch.bfloat16, 8, 1, 80, 64, 130, 20, None, None),
    (torch.float16, 32, 8, 128, 128, 700, 128, 100, None), (torch.float32, 8, 4, 64, 16, 900, 9, 40, 5.0),
    (torch.float16, 12, 12, 64, 128, 260, 128, None, None),
    (torch.bfloat16, 8, 4, 256, 128, 700, 128, 100, 50.0), (torch.float16, 16, 16, 256, 128, 300, 90, None, None),
    (torch.float16, 32, 8, 128, 512, 3000, 400, None, None), (torch.float16, 32, 8, 128, 512, 5400, 512, None, 30.0)])
def test_the_piece_attention_kernel_reads_its_rows_blocks_up_to_each_querys_position(dtype, hq, hkv, d, width, start,
                                                                                      valid, window, softcap):
    from graphwrap.decoding.kernels import piece_attention

    g = torch.Generator(device=DEV).manual_seed(0)
    blocks, block = 500, 16
    k_pool = torch.randn((blocks, block, hkv, d), generator=g, device=DEV).to(dtype)
    v_pool = torch.randn((blocks, block, hkv, d), generator=g, device=DEV).to(dtype)
    line = torch.randperm(blocks - 1, generator=g, device=DEV)[:400] + 1  # scattered, never block 0
    at = torch.tensor([start, valid, 7], device=DEV)
    query = torch.randn((1, hq, width, d), generator=g, device=DEV).to(dtype)
    want = piece_attention.reference(query, k_pool, v_pool, line, at, 0.1, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = piece_attention.attend_piece(query, k_pool, v_pool, line, at, 0.1, window, softcap)
    assert got.shape == (1, width, hq, d)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for splits in (1, 2, 4):  # (the keys shared by one program or by several, whatever the default)
        alone = piece_attention._launch(query[0], k_pool, v_pool, line, at, 0.1, window or 0, softcap or 0.0,
                                        splits=splits)
        torch.testing.assert_close(alone[None].float(), want.float(), atol=tol, rtol=tol)


def _fixed_pool(monkeypatch, usable, rows=64):
    free = int(((usable + scratch_blocks(rows, BLOCK)) * BLOCK * TOKEN_BYTES + 1) / server_mod.CACHE_MEMORY) + 1
    monkeypatch.setattr(server_mod, "_free_memory", lambda device: free)


def _check(model, reqs, got):
    with torch.no_grad():
        for (ids, k), out in zip(reqs, got):
            assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=k, do_sample=False))


def _replayed(d):
    step = d["step"]
    graphed = [k for k in step["keys"] if k["status"] == "graphed"]
    assert graphed and not step["eager_calls"], (step["keys"], step["eager_calls"])
    # (a step with a long prompt's piece inside it replays the mixed engine's graph)
    engines = [step] + ([d["mixed"]] if d.get("mixed") else [])
    assert not any(e["eager_calls"] for e in engines), [e["eager_calls"] for e in engines]
    replays = sum(b["replays"] for e in engines for k in e["keys"] for b in k["buckets"].values())
    assert replays >= d["steps"] // 2, (replays, d["steps"])


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_steps_replay_over_a_pool_too_small_for_every_row_and_give_generates_tokens(monkeypatch, kind):
    _fixed_pool(monkeypatch, 39)  # 39 blocks: 624 positions for 32 requests of up to 99
    model = _model(kind)
    gm = GraphedModule(model)
    reqs = _requests(32)
    for _ in range(2):  # the second pass replays what the first captured, over other blocks
        got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1],
                                                   do_sample=False), 32)
    _check(model, reqs, got)
    d = gm.stats()["decode"]
    assert d["cache"] == "paged" and d["cache_blocks"]["used"] == 0 and d["cache_blocks"]["free"] == 39
    assert gm.__dict__["_gw_decode"].store.kernel, "the steps attend straight from the pool"
    assert d["rows_per_step"] > 2 and gm.stats()["generate"] == {SHARED: 64}
    _replayed(d)
    gm.close()


def test_rows_that_cannot_grow_preempt_the_newest_while_steps_replay(monkeypatch):
    # 20 blocks (320 positions) for 8 sequences each growing to 95-160: rows take blocks as they
    # grow, the newest gives its back when an older one cannot grow, and is recomputed later.
    _fixed_pool(monkeypatch, 20)
    model = _model()
    gm = GraphedModule(model)
    reqs = _requests(8, seed=4, lens=(3, 20), news=(90, 140))
    got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 8)
    _check(model, reqs, got)
    kw = dict(do_sample=True, top_k=50, repetition_penalty=1.2, max_new_tokens=120)
    futs = []
    for i in range(8):  # sampled: each the tokens it makes alone, preempted or not
        torch.manual_seed(i)
        futs.append(gm.submit_generate(reqs[i][0], **kw))
    sampled = [f.result(timeout=300) for f in futs]
    d = gm.stats()["decode"]
    assert d["preempted"] > 0 and d["cache_blocks"] == {"block": BLOCK, "used": 0, "free": 20}
    _replayed(d)
    gm.close()
    roomy = GraphedModule(model)
    for i in range(8):
        torch.manual_seed(i)
        assert torch.equal(roomy.generate(reqs[i][0], **kw), sampled[i])
    assert roomy.stats()["decode"]["preempted"] == 0
    roomy.close()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral"])
def test_a_long_prompt_alone_goes_in_one_forward_and_steps_replay_over_its_blocks(monkeypatch, kind):
    """Prompts of 300 and 450 positions (past the chunk of 32, and a window of 64), each alone:
    one eager forward writes its keys into the pool, then its row's steps replay over them; the
    tokens are model.generate's."""
    monkeypatch.setattr(server_mod, "CHUNK", 32)
    monkeypatch.setattr(pieces, "WHOLE_FROM", 0)  # (a small model's prompt, whole: its host time outweighs its pieces')
    if kind == "mistral":
        torch.manual_seed(0)
        cfg = tr.MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                               num_key_value_heads=KV_HEADS, vocab_size=1000, max_position_embeddings=512,
                               sliding_window=64, bos_token_id=1, eos_token_id=None, pad_token_id=0)
        model = tr.AutoModelForCausalLM.from_config(cfg).to(DEV).eval()
    else:
        model = _model(kind)
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(3)
    for n in (300, 450):
        ids = torch.randint(2, 1000, (1, n), generator=g).to(DEV)
        got = gm.generate(input_ids=ids, max_new_tokens=30, do_sample=False)
        _check(model, [(ids, 30)], [got])
    d = gm.stats()["decode"]
    assert d["whole_prefills"] == 2 and d["prefill_pieces"] == 0, d
    assert gm.__dict__["_gw_decode"].store.kernel, "steps read the pool in place"
    _replayed(d)
    gm.close()


def test_a_long_prompt_admitted_with_short_ones_goes_first_in_one_forward(monkeypatch):
    """Queued together (the batch's lock held meanwhile): the long prompt's forward, then the
    shorts' joined prompt forward, then replayed steps; every answer model.generate's."""
    monkeypatch.setattr(server_mod, "CHUNK", 32)
    monkeypatch.setattr(pieces, "WHOLE_FROM", 0)
    model = _model()
    gm = GraphedModule(model)
    gm.generate(input_ids=torch.tensor([[5, 6, 7]], device=DEV), max_new_tokens=2, do_sample=False)
    server = gm.__dict__["_gw_decode"]
    g = torch.Generator().manual_seed(5)
    reqs = [(torch.randint(2, 1000, (1, n), generator=g).to(DEV), 20) for n in (400, 5, 9, 17)]
    with server.cond:
        futures = [gm.submit_generate(input_ids=ids, max_new_tokens=k, do_sample=False) for ids, k in reqs]
    _check(model, reqs, [f.result(timeout=300) for f in futures])
    d = gm.stats()["decode"]
    assert d["whole_prefills"] == 1 and d["prefill_pieces"] == 0, d
    gm.close()


@pytest.mark.parametrize("paged", [True, False])
def test_long_prompts_in_pieces_beside_replayed_steps(monkeypatch, paged):
    monkeypatch.setattr(pieces, "WHOLE", 0)  # (a long prompt that finds the batch empty: in pieces too)
    monkeypatch.setattr(server_mod, "CHUNK", 32)
    model = _model()
    gm = GraphedModule(model, decode={"paged": paged})
    reqs = _requests(16, seed=1, lens=(3, 200))
    got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 16)
    _check(model, reqs, got)
    d = gm.stats()["decode"]
    assert d["cache"] == ("paged" if paged else "rows") and d["prefill_pieces"] > 0
    _replayed(d)
    gm.close()


def test_pieces_and_shapes_not_yet_captured_run_without_cudnn_attention(monkeypatch):
    """The batch's eager forwards (a long prompt's pieces, here) run with torch's cuDNN attention
    off (a cuDNN graph built per new shape cost 40-45 ms each on an H200), and the switch is
    back on once the batch is idle."""
    from graphwrap.decoding.engine.step import ChunkStep, PieceStep

    monkeypatch.setattr(server_mod, "CHUNK", 32)
    seen = []
    chunk, piece = ChunkStep.forward, PieceStep.forward

    def noted(self, input_ids, start, rows):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return chunk(self, input_ids, start, rows)

    def noted_piece(self, input_ids, at, rows):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return piece(self, input_ids, at, rows)

    monkeypatch.setattr(ChunkStep, "forward", noted)
    monkeypatch.setattr(PieceStep, "forward", noted_piece)
    model = _model()
    gm = GraphedModule(model)
    reqs = _requests(4, seed=2, lens=(70, 100))
    got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 4)
    _check(model, reqs, got)
    assert seen and not any(seen), seen
    gm.close()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_long_prompts_pieces_replay_their_graphs_beside_replayed_steps(monkeypatch):
    """Every shape captured ahead (pieces of 32 positions here, a graph per span bucket), then
    long prompts beside short ones: the pieces replay, the tokens are model.generate's."""
    monkeypatch.setattr(server_mod, "CHUNK", 32)
    model = _model()
    gm = GraphedModule(model)
    assert gm.capture_generate(timeout=300)
    d = gm.stats()["decode"]
    assert any(s[0] == "piece" for s in d["shapes"]), d["shapes"]
    reqs = _requests(12, seed=4, lens=(3, 300))
    got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 12)
    _check(model, reqs, got)
    server = gm.__dict__["_gw_decode"]
    # (beside decoding rows a piece goes inside their step: the mixed engine's graph replays)
    engines = [server.piece_engine] + ([server.mixed_engine] if server.mixed_engine is not None else [])
    replays = sum(b["replays"] for e in engines for k in e.stats()["keys"] for b in k["buckets"].values())
    d = gm.stats()["decode"]
    assert d["prefill_pieces"] > 0 and replays > 0 and d["capture_failed"] == {}
    assert d["eager_forwards"].get("piece", 0) == 0, "every piece served by a graph"
    gm.close()


def _device_waits(fn) -> list:
    """``fn()`` with torch's sync debug mode warning: the stacks of the decode thread's calls
    that waited for the device."""
    import traceback
    import warnings

    stacks = []

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        if "decoding/engine/server.py" in stack:
            stacks.append(f"{message}\n{stack}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return stacks


def test_the_decode_thread_waits_for_no_copy_while_long_prompts_replay_beside_steps(monkeypatch):
    """Every shape captured ahead, long prompts beside short ones (their ids on the host) once
    to warm up, then again under torch's sync debug mode: no call of the decode thread waits for
    the device (a wait there holds the next step's launch behind the whole piece), and the
    tokens are model.generate's."""
    monkeypatch.setattr(server_mod, "CHUNK", 32)
    model = _model()
    gm = GraphedModule(model)
    assert gm.capture_generate(timeout=300)
    reqs = [(ids.cpu(), k) for ids, k in _requests(10, seed=6, lens=(20, 300))]

    def run():
        return thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False),
                              len(reqs))

    run()
    pieces = gm.stats()["decode"]["prefill_pieces"]
    got = []
    waits = _device_waits(lambda: got.extend(run()))
    assert gm.stats()["decode"]["prefill_pieces"] > pieces
    assert not waits, waits[:3]
    _check(model, [(ids.to(DEV), k) for ids, k in reqs], [out.to(DEV) for out in got])
    gm.close()


def test_the_pool_keeps_to_its_share_of_the_free_memory():
    model = _model(positions=4096)
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    gm = GraphedModule(model, decode={"cache_memory": 0.001})
    reqs = _requests(8, seed=2)
    got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 8)
    _check(model, reqs, got)
    d = gm.stats()["decode"]
    assert d["cache"] == "paged" and d["max_len"] == 4096
    assert d["cache_bytes"] <= d["cache_budget_bytes"] <= 0.0011 * free
    gm.close()


def test_thousands_of_requests_through_a_small_pool_leave_nothing_held(monkeypatch):
    _fixed_pool(monkeypatch, 23)
    model = _model("gpt2")
    gm = GraphedModule(model)
    reqs = _requests(64, seed=3, lens=(2, 30), news=(1, 12))
    thread_results(lambda i: gm.generate(input_ids=reqs[i % 64][0], max_new_tokens=reqs[i % 64][1],
                                         do_sample=False), 64)  # warm: the shapes captured
    torch.cuda.synchronize()
    before, graphs = torch.cuda.memory_allocated(), _graph_bytes(gm)
    futs = [gm.submit_generate(reqs[i % 64][0], max_new_tokens=reqs[i % 64][1], do_sample=False)
            for i in range(3000)]
    outs = [f.result(timeout=300) for f in futs]
    _check(model, reqs, outs[:64])
    torch.cuda.synchronize()
    d = gm.stats()["decode"]
    assert d["done"] == 3064 and d["cache_blocks"]["used"] == 0 and d["rows_busy"] == 0
    del outs, futs
    # (a prompt join of a shape the warm-up did not make is captured meanwhile: its graph's memory
    # is the batch's to keep, not a request's)
    grown = torch.cuda.memory_allocated() - before - (_graph_bytes(gm) - graphs)
    assert grown <= 2**20, f"memory grew by {grown} bytes over 3,000 requests, besides graphs captured"
    gm.close()


def _graph_bytes(gm) -> int:
    d = gm.stats()["decode"]
    return sum(d[e]["graph_pool_bytes"] + d[e]["static_input_bytes"] for e in ("step", "prefill", "mixed") if d.get(e))


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_steps_over_long_rows_replay_a_graph_whose_kernel_splits_each_rows_positions(monkeypatch, kind):
    """Past ``SPLIT_FROM`` positions (made 64 here) the step's graph is the whole row's, its
    attention split between programs; tokens as ``model.generate``'s both sides of it."""
    from graphwrap.decoding.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "SPLIT_FROM", 64)
    monkeypatch.setattr(server_mod, "CHUNK", 32)
    torch.manual_seed(0)
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                 num_key_value_heads=KV_HEADS, vocab_size=1000, max_position_embeddings=512, bos_token_id=1,
                 eos_token_id=None, pad_token_id=0)
    cfg = tr.MistralConfig(**shape, sliding_window=48) if kind == "mistral" else tr.LlamaConfig(**shape)
    model = tr.AutoModelForCausalLM.from_config(cfg).to(DEV).eval()
    gm = GraphedModule(model)
    reqs = _requests(16, seed=5, lens=(3, 120), news=(8, 100))
    got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), 16)
    _check(model, reqs, got)
    server = gm.__dict__["_gw_decode"]
    whole = server.store.per_row * server.store.block
    spans = {shape[2] for shape in server.shapes.ready if shape[0] == "step"}
    assert spans == {64, whole}, spans
    assert server.store.window(whole).layers[0].slots.splits == paged_attention.SPLITS
    assert server.store.window(64).layers[0].slots.splits == 1
    _replayed(gm.stats()["decode"])
    gm.close()


def test_a_step_of_few_rows_splits_each_rows_positions_and_gives_generates_tokens(monkeypatch):
    """Below SPLIT_FROM a step of few rows leaves most SMs idle at one program a row and key
    head: its attention splits each row's positions (splits_at's 8 or 4), the parts joined;
    tokens as ``model.generate``'s, one request alone and four at once."""
    from graphwrap.decoding.kernels import paged_attention

    seen, attend = [], paged_attention.attend
    monkeypatch.setattr(paged_attention, "attend", lambda *a: seen.append((a[0].shape[0], a[8])) or attend(*a))
    model = _model()
    gm = GraphedModule(model)
    for n in (1, 4):
        reqs = _requests(n, seed=7 + n, lens=(20, 90), news=(30, 60))
        got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1], do_sample=False), n)
        _check(model, reqs, got)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    steps = {(rows, splits) for rows, splits in seen if splits != paged_attention.SPLITS}
    assert steps and all(splits == paged_attention.splits_at(1, rows, KV_HEADS, torch.device(DEV)) for rows, splits in steps)
    assert any(splits > 1 for _, splits in steps) and (sms < 4 * KV_HEADS or (1, 8) in steps), steps
    _replayed(gm.stats()["decode"])
    gm.close()


def test_a_sliding_window_model_shares_replayed_steps_read_in_place(monkeypatch):
    monkeypatch.setattr(server_mod, "CHUNK", 16)
    torch.manual_seed(0)
    cfg = tr.MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                           num_key_value_heads=KV_HEADS, vocab_size=1000, max_position_embeddings=512,
                           sliding_window=8, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = tr.AutoModelForCausalLM.from_config(cfg).to(DEV).eval()
    gm = GraphedModule(model)
    reqs = _requests(24, seed=4, lens=(3, 40))
    for _ in range(2):
        got = thread_results(lambda i: gm.generate(input_ids=reqs[i][0], max_new_tokens=reqs[i][1],
                                                   do_sample=False), 24)
    _check(model, reqs, got)
    d = gm.stats()["decode"]
    assert gm.stats()["generate"] == {SHARED: 48} and d["prefill_pieces"] > 0
    assert gm.__dict__["_gw_decode"].store.kernel, "windows read in place"
    _replayed(d)
    gm.close()

