"""Prefix caching in the shared batch (``decode={"prefix_caching": True}``), on a CPU, eagerly:
full blocks known by their content, kept when their sequences end and taken again least
recently used first, never written while shared; greedy tokens equal ``model.generate``'s alone
(and so caching off's) for shared system prompts, a conversation's turns, evicted and reused
blocks, preemption, a request cancelled mid-prefill, seeded sampling, sliding windows, a prompt
shorter than a block and one prompt 64 times at once."""

import threading
import time

import pytest
import torch
from helpers import thread_results
from test_generate_paged_cpu import _alone, _fixed_pool, _model, _prompts, _windowed

from graphwrap import GraphedModule
from graphwrap.decoding.cache.pool import BLOCK, Blocks, Prefixes
from graphwrap.decoding.callers.settings import SeqSettings
from graphwrap.decoding.engine import schedule
from graphwrap.decoding.engine.scheduler import Scheduler, Seq

ON = {"prefix_caching": True}


# ------------------------------------------------------------------ the blocks (plain Python)

def _pool(total=40, scratch=2):
    return Blocks(total, scratch, Prefixes(4))


def test_full_blocks_are_found_by_their_whole_prefix_and_only_so():
    pool = _pool()
    p = pool.prefixes
    a = pool.take(3)
    p.register(a, list(range(12)) + [99])  # 3 full blocks of 4 (and a token past them)
    assert p.match(list(range(12)), 3) == a and p.match(list(range(8)) + [0, 0, 0, 0], 3) == a[:2]
    assert p.match([1, 0, 2, 3], 3) == [], "a block's key holds every token of its prefix"
    assert p.match(list(range(12)), 1) == a[:1], "at most as many as asked"
    b = pool.take(2)
    p.register(b, [7, 7, 7, 7] + list(range(4, 8)))
    assert p.match([7, 7, 7, 7, 4, 5, 6, 7], 2) == b, "the same tokens after another prefix: another block"
    assert p.match(list(range(8)), 2) == a[:2]


def test_blocks_given_back_stay_cached_until_taken_least_recently_used_first_with_what_follows_them():
    pool = _pool(total=10, scratch=2)  # 8 usable
    p = pool.prefixes
    first, second = pool.take(2), pool.take(2)
    p.register(first, [1] * 8)
    p.register(second, [2] * 8)
    pool.give(first)
    pool.give(second)
    assert pool.available == 8 and pool.used == 0 and p.cached == 4 and len(pool.free) == 4
    again = p.match([1] * 8, 2)
    p.share(again)
    assert again == first and pool.available == 6, "taken again, the cached blocks are no longer available"
    got = pool.take(5)  # 4 free, then the least recently used idle block: second's last (given back first)
    assert got is not None and p.match([2] * 8, 2) == second[:1] and p.cached == 3, "the prefix outlives its tail"
    assert second[1] in got and not set(got) & set(first), "the shared ones are never taken"
    p.register(got[:1], [9] * 4)
    pool.give(got)
    assert p.match([9] * 4, 1) == got[:1]
    assert pool.take(6) is not None and p.cached == 2, "second's first went, and everything given back"
    assert pool.take(1) is None and pool.available == 0


def test_a_block_whose_content_is_cached_already_ends_what_a_sequence_registers():
    pool = _pool()
    p = pool.prefixes
    a, b = pool.take(2), pool.take(2)
    p.register(a, [5] * 8)
    p.register(b, [5] * 8)  # (two prompts written at once, before either was cached)
    assert p.match([5] * 8, 2) == a and p.cached == 2
    pool.give(b)
    assert len(pool.free) == 40 - 2 - 2, "the duplicates went back free, not cached"


# ------------------------------------------------------------------ the scheduler

def _seq(prompt, new=4):
    return Seq(None, 0, list(prompt), SeqSettings(max_new=new))


def test_admission_takes_the_cached_blocks_and_always_runs_the_last_prompt_token():
    pool = _pool()
    sched = Scheduler(4, 64, [1, 2, 4], [16, 32, 64], pool, 4)
    one = _seq(range(12))
    assert sched.admit() == [] or True
    sched.enqueue([one])
    (got,) = sched.admit()
    sched.written([got])
    assert got.cached == 0 and pool.prefixes.cached == 3
    two = _seq(range(12))  # the same 12 tokens: 2 blocks from the cache, the last block's tokens run
    three = _seq(list(range(8)) + [50, 51, 52])
    sched.enqueue([two, three])
    two, three = sched.admit()
    assert two.cached == 8 and two.blocks[:2] == one.blocks[:2] and two.blocks[2] not in one.blocks
    assert three.cached == 8 and three.blocks[:2] == one.blocks[:2]
    assert pool.prefixes.queries == 12 + 12 + 11 and pool.prefixes.hits == 16


def test_short_feeds_take_cached_blocks_only_where_no_other_goes_in_pieces():
    """A cached feed's rest goes in pieces, a prompt a turn: of short feeds (those prefilled whole
    in one batch otherwise) admitted together, only the first looks in the cache, and none while
    another prompt goes in pieces; long feeds always look."""
    pool = _pool()
    sched = Scheduler(8, 64, [1, 2, 4, 8], [16, 32, 64], pool, 4, whole=16)
    (first,) = _admit(sched, [_seq(range(12))])
    sched.written([first])
    a, b, c = _admit(sched, [_seq(range(12)), _seq(range(12)), _seq(list(range(12)) + [40] * 8)])
    assert a.cached == 8 and b.cached == 0 and c.cached == 12, "the first short one, and the long one"
    assert not set(b.blocks) & set(first.blocks), "b's own blocks: prefilled whole, with its batch"
    sched.chunking.append(c)  # (a long prompt going in pieces)
    (d,) = _admit(sched, [_seq(range(12))])
    assert d.cached == 0, "it would wait behind the long prompt's pieces: prefilled whole now"
    sched.chunking.clear()
    (e,) = _admit(sched, [_seq(range(12))])
    assert e.cached == 8
    sched.written([e])
    long, f = _admit(sched, [_seq([70] * 20), _seq(range(12))])
    assert long.cached == 0 and f.cached == 0, "a long prompt admitted before it goes in pieces: f is prefilled whole"


def test_short_feeds_never_wait_a_turn_for_blocks_another_writes():
    pool = _pool()
    sched = Scheduler(8, 64, [1, 2, 4, 8], [16, 32, 64], pool, 4, whole=16)
    got = _admit(sched, [_seq(range(12)) for _ in range(3)] + [_seq(range(20))])
    assert [s.cached for s in got] == [0, 0, 0], "the short ones together; the long one waits for their blocks"
    sched.written(got)
    (long,) = sched.admit()
    assert long.cached == 12, "the short ones' 3 full blocks"


def _admit(sched, seqs):
    sched.enqueue(seqs)
    return sched.admit()


# ------------------------------------------------------------------ the batch, against model.generate

@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_shared_system_prompt_is_computed_once_and_every_answer_is_generates(kind):
    model = _model(kind)
    system = _prompts([40])[0]
    questions = _prompts([3, 7, 12, 1, 5], seed=2)
    gm = GraphedModule(model, decode=ON)
    for q in questions:  # (one after another: a burst of short prompts is prefilled together instead)
        out = gm.generate(torch.tensor([system + q]), max_new_tokens=10, do_sample=False)
        assert torch.equal(out, _alone(model, system + q, max_new_tokens=10))
    c = gm.stats()["decode"]["prefix_cache"]
    assert c["prefix_cache_hits"] == (len(questions) - 1) * (40 // BLOCK) * BLOCK, c
    assert c["prefix_cache_queries"] == sum(len(system) + len(q) for q in questions)
    got = thread_results(lambda i: gm.generate(torch.tensor([system + questions[i]]), max_new_tokens=12,
                                               do_sample=False), len(questions))
    for q, out in zip(questions, got):
        assert torch.equal(out, _alone(model, system + q, max_new_tokens=12))
    gm.close()


def test_caching_is_on_unless_turned_off_and_its_tokens_are_the_same():
    model = _model("llama")
    prompt = _prompts([37])[0]
    off = GraphedModule(model, decode={"prefix_caching": False})
    outs = [off.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False) for _ in range(2)]
    assert off.stats()["decode"]["prefix_cache"] is None
    on = GraphedModule(model)
    assert all(torch.equal(on.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False), o) for o in outs)
    assert on.stats()["decode"]["prefix_cache"]["prefix_cache_hits"] == 32, "the second call: its 2 full blocks"
    off.close()
    on.close()


def test_a_conversation_s_turns_reuse_what_came_before():
    model = _model("llama")
    gm = GraphedModule(model, decode=ON)
    history = _prompts([20])[0]
    for turn in range(4):
        out = gm.generate(torch.tensor([history]), max_new_tokens=6, do_sample=False)
        assert torch.equal(out, _alone(model, history, max_new_tokens=6))
        history = out[0].tolist() + _prompts([5], seed=turn + 10)[0]
    assert gm.stats()["decode"]["prefix_cache"]["prefix_cache_hits"] >= 3 * 16
    gm.close()


def test_the_next_turn_finds_the_answer_s_blocks_too():
    """The blocks a call's steps wrote are cached when it ends: the next turn (its prompt, its
    answer and a new question) prefills only the last block and the question."""
    model = _model("llama")
    gm = GraphedModule(model, decode=ON)
    prompt = _prompts([20])[0]
    out = gm.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)  # 60 tokens: 59 written
    assert gm.stats()["decode"]["prefix_cache"]["blocks"] == 3
    turn = out[0].tolist() + _prompts([5], seed=9)[0]
    assert torch.equal(gm.generate(torch.tensor([turn]), max_new_tokens=6, do_sample=False),
                       _alone(model, turn, max_new_tokens=6))
    assert gm.stats()["decode"]["prefix_cache"]["prefix_cache_hits"] == 48, "its prompt's block and two of its answer"
    gm.close()


def test_a_failed_call_s_written_blocks_are_not_cached():
    from graphwrap.decoding.engine.scheduler import Scheduler as Sched

    sched = Sched(4, 256, [4], [256], pool=_pool(), block=4)
    call = type("Call", (), {"error": None})()
    s = Seq(call, 0, list(range(3, 9)), SeqSettings(max_new=10))  # 6 tokens: one full block of 4
    sched.enqueue([s])
    sched.admit()
    sched.written([s])
    s.tokens = [20, 21, 22, 23, 24]
    sched.launched([s] * 4)
    for _ in range(4):
        sched.advanced([s])  # positions 6..9 written: 10 positions known, 2 full blocks
    call.error = RuntimeError("a step failed")
    s.done = True
    sched.retire()
    assert sched.pool.prefixes.cached == 1, "only the prompt's block, cached when its forward was queued"
    ok = Seq(type("Call", (), {"error": None})(), 0, list(range(3, 9)), SeqSettings(max_new=10))
    sched.enqueue([ok])
    sched.admit()
    sched.written([ok])
    ok.tokens = [20, 21, 22, 23, 24]
    for _ in range(4):
        sched.advanced([ok])
    ok.done = True
    sched.retire()
    assert sched.pool.prefixes.cached == 2, "the block of its prompt's last tokens and its first answers"


def test_a_dropped_cache_frees_its_idle_blocks_and_caches_nothing_written_before_the_drop():
    from graphwrap.decoding.engine.scheduler import Scheduler as Sched

    sched = Sched(4, 256, [4], [256], pool=_pool(), block=4)
    call = type("Call", (), {"error": None})()
    done = Seq(call, 0, list(range(3, 12)), SeqSettings(max_new=1))
    sched.enqueue([done])
    sched.admit()
    sched.written([done])
    done.done = True
    sched.retire()  # (its two full blocks idle, cached)
    old = Seq(call, 0, list(range(20, 29)), SeqSettings(max_new=5))
    sched.enqueue([old])
    sched.admit()  # (admitted before the drop, written after it)
    free = sched.pool.available
    sched.drop_prefixes()
    assert sched.pool.prefixes.cached == 0 and not sched.pool.prefixes.idle and sched.pool.available == free
    assert not sched.writing
    sched.written([old])
    assert sched.pool.prefixes.cached == 0, "keys the old values made are not cached"
    new = Seq(call, 0, list(range(3, 12)), SeqSettings(max_new=1))
    sched.enqueue([new])
    sched.admit()
    assert new.cached == 0
    sched.written([new])
    assert sched.pool.prefixes.cached == 2


def test_evicted_blocks_are_taken_for_other_prompts_and_a_prefix_found_again_is_right(monkeypatch):
    _fixed_pool(monkeypatch, 12)  # 12 blocks of 16: a few prompts' worth
    model = _model("llama")
    gm = GraphedModule(model, decode=ON)
    prompts = _prompts([50, 45, 60, 50], seed=3)
    for rnd in range(3):
        for p in prompts:
            assert torch.equal(gm.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False),
                               _alone(model, p, max_new_tokens=5)), (rnd, len(p))
    d = gm.stats()["decode"]
    assert d["cache_blocks"]["used"] == 0 and d["cache_blocks"]["free"] == 12
    assert 0 < d["prefix_cache"]["blocks"] <= 12
    gm.close()


def test_preempted_sequences_resume_from_cached_blocks_with_generates_tokens(monkeypatch):
    _fixed_pool(monkeypatch, 10)
    model = _model("llama")
    gm = GraphedModule(model, decode=ON)
    system = _prompts([33])[0]
    gm.generate(torch.tensor([system + [3]]), max_new_tokens=1, do_sample=False)  # (the system prompt cached)
    prompts = [system + q for q in _prompts([4, 6, 2, 5], seed=4)]
    futs = [gm.submit_generate(torch.tensor([p]), max_new_tokens=80, do_sample=False) for p in prompts]
    for p, f in zip(prompts, futs):  # (two rows of 8 blocks, 2 of them shared, outgrow 10)
        assert torch.equal(f.result(timeout=120), _alone(model, p, max_new_tokens=80))
    d = gm.stats()["decode"]
    assert d["preempted"] > 0 and d["cache_blocks"]["used"] == 0, d
    gm.close()


def test_a_call_cancelled_mid_prefill_leaves_nothing_wrong_behind(monkeypatch):
    from graphwrap.decoding.engine import pieces as pieces_mod
    from graphwrap.decoding.engine import server as server_mod

    monkeypatch.setattr(server_mod, "CHUNK", 8)  # its long prompt in pieces, a turn each
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model("llama")
    gm = GraphedModule(model, decode=ON)
    long = _prompts([100])[0]
    beside = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=60, do_sample=False)
    fut = gm.submit_generate(torch.tensor([long]), max_new_tokens=5, do_sample=False)
    time.sleep(0.05)
    fut.cancel()
    assert torch.equal(beside.result(timeout=60), _alone(model, [5, 6, 7], max_new_tokens=60))
    for _ in range(2):
        assert torch.equal(gm.generate(torch.tensor([long]), max_new_tokens=5, do_sample=False),
                           _alone(model, long, max_new_tokens=5))
    gm.close()


def test_seeded_sampling_draws_the_same_tokens_with_a_cached_prefix():
    model = _model("llama")
    prompt = _prompts([45])[0]
    kw = dict(max_new_tokens=12, do_sample=True, top_k=20, temperature=0.9)
    off = GraphedModule(model)
    on = GraphedModule(model, decode=ON)
    torch.manual_seed(3)
    want = off.generate(torch.tensor([prompt]), **kw)
    on.generate(torch.tensor([prompt]), max_new_tokens=1, do_sample=False)  # (its blocks cached)
    torch.manual_seed(3)
    got = on.generate(torch.tensor([prompt]), **kw)
    assert on.stats()["decode"]["prefix_cache"]["prefix_cache_hits"] > 0
    assert torch.equal(got, want)
    off.close()
    on.close()


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_sliding_window_models_reuse_blocks_for_the_same_positions(kind):
    model = _windowed(kind)
    gm = GraphedModule(model, decode=ON)
    system = _prompts([35])[0]
    for q in _prompts([3, 9], seed=5):
        assert torch.equal(gm.generate(torch.tensor([system + q]), max_new_tokens=10, do_sample=False),
                           _alone(model, system + q, max_new_tokens=10))
    assert gm.stats()["decode"]["prefix_cache"]["prefix_cache_hits"] == 32
    gm.close()


def test_a_prompt_shorter_than_a_block_and_one_prompt_64_times_at_once():
    model = _model("gpt2")
    gm = GraphedModule(model, decode=ON)
    short = [5, 6, 7]
    for _ in range(2):
        assert torch.equal(gm.generate(torch.tensor([short]), max_new_tokens=4, do_sample=False),
                           _alone(model, short, max_new_tokens=4))
    assert gm.stats()["decode"]["prefix_cache"]["prefix_cache_hits"] == 0
    same = _prompts([40])[0]
    want = _alone(model, same, max_new_tokens=8)
    for _ in range(2):  # (at once: the first time none finds the others' blocks, then one does, alone)
        got = thread_results(lambda i: gm.generate(torch.tensor([same]), max_new_tokens=8, do_sample=False), 64)
        assert all(torch.equal(g, want) for g in got)
    d = gm.stats()["decode"]
    assert d["prefix_cache"]["prefix_cache_hits"] >= 32 and d["cache_blocks"]["used"] == 0
    assert d["prefill_pieces"] < 64, "the second burst prefilled together, not each prompt found cached, a piece a turn"
    gm.close()


@pytest.mark.parametrize("system_len", [40, 300], ids=["prefilled-whole", "in-pieces"])
def test_requests_sent_at_once_share_a_prefix_being_written_as_their_lengths_suit(monkeypatch, system_len):
    """A burst of prompts sharing a system prompt, all at once. Long ones: the first writes it
    a piece a turn (its blocks cached piece by piece), the others wait for the blocks it writes
    instead of writing them again, then take them. Short ones are prefilled together, none
    waiting. Every answer is generate's."""
    from graphwrap.decoding.engine import pieces as pieces_mod
    from graphwrap.decoding.engine import server as server_mod

    monkeypatch.setattr(server_mod, "CHUNK", 64)  # (300 tokens: pieces)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model("llama", positions=512)
    gm = GraphedModule(model, decode=ON)
    gm.generate(torch.tensor([[3, 4]]), max_new_tokens=1, do_sample=False)  # (the batch made: its check ran)
    # The decode thread held inside a forward while the burst is queued, so that one turn admits it all
    gate, held = threading.Event(), threading.Event()

    def hold(module, args):
        if not held.is_set():
            held.set()
            gate.wait(60)

    hook = model.register_forward_pre_hook(hold)
    blocker = gm.submit_generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)
    assert held.wait(60)
    system = _prompts([system_len])[0]
    prompts = [system + q for q in _prompts([3, 5, 7, 9, 11, 13], seed=8)]
    futs = [gm.submit_generate(torch.tensor([p]), max_new_tokens=6, do_sample=False) for p in prompts]
    gate.set()
    blocker.result(timeout=60)
    hook.remove()
    for p, f in zip(prompts, futs):
        assert torch.equal(f.result(timeout=120), _alone(model, p, max_new_tokens=6))
    c = gm.stats()["decode"]["prefix_cache"]
    assert c["prefix_cache_hits"] == (5 * (system_len // BLOCK) * BLOCK if system_len > 64 else 0), c
    assert not gm.__dict__["_gw_decode"].sched.writing, "nothing is left waited on"
    gm.close()


def test_whole_rows_asked_for_say_that_prefixes_are_not_cached(gw_log):
    model = _model("llama")
    gm = GraphedModule(model, decode={"prefix_caching": True, "paged": False})
    prompt = _prompts([40])[0]
    for _ in range(2):
        assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False),
                           _alone(model, prompt, max_new_tokens=4))
    assert gm.stats()["decode"]["prefix_cache"] is None
    assert "prefix caching needs the paged cache" in gw_log.text
    gm.close()
    gw_log.clear()
    quiet = GraphedModule(model, decode={"paged": False})  # (on by default: where it cannot be, nothing is said)
    quiet.generate(torch.tensor([prompt]), max_new_tokens=2, do_sample=False)
    assert quiet.stats()["decode"]["prefix_cache"] is None and "prefix caching" not in gw_log.text
    quiet.close()


def test_weights_changed_in_place_drop_the_cached_prefixes(gw_log):
    """``load_state_dict`` copies new values into the same tensors: the graphs read them, but the
    blocks cached for a prompt hold keys the old values made. The next call finds the cache
    dropped (its tokens are the new model's), and caches again."""
    model = _model("llama")
    gm = GraphedModule(model)
    prompt = _prompts([50])[0]
    gm.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    torch.manual_seed(5)
    model.load_state_dict({k: v + 0.5 * torch.randn_like(v) for k, v in model.state_dict().items()})
    hits = gm.stats()["decode"]["prefix_cache"]["prefix_cache_hits"]
    for _ in range(2):  # (the first computes the prompt again; the second finds it, made by the new values)
        assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False),
                           _alone(model, prompt, max_new_tokens=6))
    c = gm.stats()["decode"]["prefix_cache"]
    assert c["prefix_cache_hits"] == hits + 48, c
    assert "weights changed in place since the last call: the prefix cache is dropped" in gw_log.text
    gm.close()


def test_pieces_are_never_wider_than_a_row():
    """A cached prompt's rest goes in a piece whatever the model's positions; a piece's graph is
    captured writing and reading its whole width, so no piece is wider than a row (a GPT-2 of
    256 positions had met an illegal memory access on the GPU capturing a piece of 512)."""
    for positions in (40, 128, 1024):
        gm = GraphedModule(_model("gpt2", positions=positions))
        gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
        server = gm.__dict__["_gw_decode"]
        assert server.piece <= positions and server.piece_alone <= positions, (positions, server.piece_alone)
        assert server.piece_alone == min(512, positions)
        gm.close()


def test_the_decode_option_is_checked():
    from graphwrap import GraphwrapError

    with pytest.raises(GraphwrapError, match="prefix_caching"):
        GraphedModule(_model(), decode={"prefix_caching": "yes"})


def test_threads_calling_with_caching_on_all_get_generates_tokens():
    model = _model("llama")
    gm = GraphedModule(model, decode=ON)
    systems = _prompts([20, 34], seed=6)
    prompts = [systems[i % 2] + q for i, q in enumerate(_prompts([1, 2, 3, 4, 5, 6, 7, 8], seed=7))]
    errors = []

    def caller(i):
        try:
            for _ in range(3):
                out = gm.generate(torch.tensor([prompts[i]]), max_new_tokens=6, do_sample=False)
                assert torch.equal(out, _alone(model, prompts[i], max_new_tokens=6))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:1]
    gm.close()


# ------------------------------------------------------------------ over HTTP

@pytest.mark.parametrize("engine", ["thread", "process"])
def test_the_server_reports_the_prompt_tokens_found_cached(tmp_path, engine):
    """``serve`` (prefix caching on by default): a prompt sent again reports its cached full blocks
    in the usage's ``prompt_tokens_details.cached_tokens``, whole and streamed, with the same text;
    with ``--no-prefix-caching``, none."""
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    import tiny_lm
    from test_http_cpu import Running, _args, events, post
    from test_http_engine_cpu import Running as InProcess

    d = tiny_lm.make(str(tmp_path))
    from graphwrap.serve.api import cli

    assert cli.parser().parse_args([d]).prefix_caching is None  # (the batch's default: on)
    assert cli.parser().parse_args([d, "--no-prefix-caching"]).prefix_caching is False
    assert cli.parser().parse_args([d]).prefill_budget is None  # (the batch's default: pieces.BUDGET)
    assert cli.parser().parse_args([d, "--prefill-budget", "0"]).prefill_budget == 0
    start = (lambda **kw: Running(_load(_args(d, served_model_name="tiny", **kw)))) if engine == "thread" else \
        (lambda **kw: InProcess(d, **kw))
    body = {"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog " * 6, "max_tokens": 8,
            "temperature": 0}
    r = start()
    try:
        status, first, _ = post(r.port, "/v1/completions", body)
        assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first
        prompt = first["usage"]["prompt_tokens"]
        status, again, _ = post(r.port, "/v1/completions", body)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt - 1) // BLOCK * BLOCK and cached > 0, again["usage"]
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        metrics = _metrics(r.port)  # (counters, as vLLM names them, and the blocks kept)
        assert metrics["graphwrap_prefix_cache_hits"] >= cached and metrics["graphwrap_prefix_cache_blocks"] > 0
        assert metrics["graphwrap_prefix_cache_queries"] >= 2 * prompt, metrics
        status, evs = events(r.port, "/v1/completions", dict(body, stream_options={"include_usage": True}))
        assert evs[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
        assert "".join(e["choices"][0]["text"] for e in evs[:-2] if e["choices"]) == first["choices"][0]["text"]
    finally:
        r.stop()
    if engine == "thread":
        r = start(prefix_caching=False)
        try:
            for _ in range(2):
                status, got, _ = post(r.port, "/v1/completions", body)
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert "graphwrap_prefix_cache_hits" not in _metrics(r.port)
        finally:
            r.stop()


def _metrics(port) -> dict:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_serve_prefill_budget_whole_and_beside_reach_the_batch(tmp_path):
    """``serve --prefill-budget N`` is the batch's ``decode={"prefill_budget": N}``,
    ``--prefill-whole N`` its ``prefill_whole`` and ``--prefill-beside N`` its ``prefill_beside``;
    without them the batch takes pieces.BUDGET, pieces.WHOLE and schedule.PREFILL_BESIDE."""
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    import tiny_lm
    from test_http_cpu import _args

    from graphwrap.serve.api import cli

    d = tiny_lm.make(str(tmp_path))
    assert cli.parser().parse_args([d]).prefill_whole is None
    assert cli.parser().parse_args([d, "--prefill-whole", "0"]).prefill_whole == 0
    assert cli.parser().parse_args([d, "--prefill-beside", "0"]).prefill_beside == 0
    for budget, whole, beside in ((None, None, None), (0, 0, 0), (256, 4096, 1024)):
        served = _load(_args(d, prefill_budget=budget, prefill_whole=whole, prefill_beside=beside))
        try:
            server = served.gm.__dict__["_gw_decode"]
            assert server.budget == budget and server.whole_limit == whole and server.beside == beside
            want = schedule.PREFILL_BESIDE if beside is None else beside
            assert served.gm.stats()["decode"]["prefill_beside"] == want
        finally:
            served.engine.close(cancel=True, timeout=30)


def _load(args):
    from graphwrap.serve.api import cli

    return cli.load(args)
