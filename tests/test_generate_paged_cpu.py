"""The shared batch's cache sized by memory: the layout plan, the paged pool's blocks, sequences
waiting for blocks, long prompts in pieces, and the whole context, on a CPU, eagerly, against
model.generate alone. Needs transformers (skipped with the reason without it)."""

import time

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule, GraphwrapError, _compat
from graphwrap.decoding.cache.pool import (
    BLOCK,
    PIECE_ALONE,
    Blocks,
    plan_cache,
    rows_for,
    rows_possible,
    scratch_blocks,
)
from graphwrap.decoding.callers.settings import SeqSettings
from graphwrap.decoding.engine import pieces as pieces_mod
from graphwrap.decoding.engine import server as server_mod
from graphwrap.decoding.engine.scheduler import Scheduler, Seq

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
SHARED = "graphwrap's shared decode batch"
TOKEN_BYTES = 2 * 2 * 64 * 4  # the tiny models' keys and values of one position: 2 layers, 64 wide, fp32


def _model(kind="gpt2", positions=128):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=positions, bos_token_id=1,
                            eos_token_id=None, pad_token_id=0)
    else:
        cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=101, max_position_embeddings=positions, bos_token_id=1,
                             eos_token_id=None, pad_token_id=0)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def _windowed(kind, window=4):
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=256, bos_token_id=1, eos_token_id=None,
                 pad_token_id=0, sliding_window=window)
    if kind == "mistral":
        cfg = tr.MistralConfig(**shape)
    else:  # layers with and without the window, scores capped (Gemma 2)
        cfg = tr.Gemma2Config(**shape, head_dim=16, attn_logit_softcapping=5.0, final_logit_softcapping=None)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def _alone(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt]), do_sample=False, **kw)


def _all_alike(gm, model, prompts, news):
    """Each prompt from a thread of its own, all at once: each gets ``model.generate``'s tokens alone."""
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i]), len(prompts))
    for p, n, out in zip(prompts, news, got):
        assert torch.equal(out, _alone(model, p, max_new_tokens=n))


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 101, (n,), generator=g).tolist() for n in lengths]


def _fixed_pool(monkeypatch, usable, rows=64):
    """The batch sized as on a GPU with just enough free memory for ``usable`` blocks beside the
    rows' scratch blocks and the capture blocks (a pool that cannot grow)."""
    free = int(((usable + scratch_blocks(rows, BLOCK)) * BLOCK * TOKEN_BYTES + 1) / server_mod.CACHE_MEMORY) + 1
    monkeypatch.setattr(server_mod, "_free_memory", lambda device: free)


# ------------------------------------------------------------------ the plan and the blocks

def test_the_plan_keeps_whole_rows_where_they_fit_the_budget_and_pages_where_not():
    fits = plan_cache(rows=64, max_len=1024, token_bytes=1000, free=10**9)
    assert not fits.paged and fits.budget == int(0.7 * 10**9)  # 65 x 1024 x 1000 = 66.6 MB
    tight = plan_cache(rows=64, max_len=4096, token_bytes=524288, free=64 * 2**30)  # a 7B's 0.5 MB a position
    assert tight.paged and tight.block == BLOCK
    assert tight.nbytes <= tight.budget, "the pool never takes more than its share"
    assert tight.nbytes > 0.95 * tight.budget
    assert plan_cache(64, 1024, 1000, 10**9, paged=True).paged
    assert not plan_cache(64, 4096, 524288, 64 * 2**30, paged=False).paged
    small = plan_cache(rows=4, max_len=64, token_bytes=1000, free=10**12)
    assert small.paged is False
    roomy = plan_cache(rows=4, max_len=64, token_bytes=1000, free=10**12, paged=True)
    # Never more blocks than every row whole, a scratch block each (and the padding prompts'), one
    # capture block per BLOCK of those 5, and the widest piece's capture blocks.
    assert roomy.blocks == 4 * (64 // BLOCK) + 5 + 1 + PIECE_ALONE // BLOCK, "never more blocks than every row whole and the scratch blocks"
    with pytest.raises(MemoryError, match="holds no block"):
        plan_cache(rows=4, max_len=64, token_bytes=10**6, free=10**6)


def test_the_rows_layout_is_probed_only_where_the_plan_may_choose_it():
    assert rows_possible(False, on_gpu=False, in_place=False) and rows_possible(False, on_gpu=True, in_place=True)
    assert not rows_possible(True, on_gpu=True, in_place=False)
    assert not rows_possible(None, on_gpu=False, in_place=False), "a CPU's cache is paged unless asked"
    assert not rows_possible(None, on_gpu=True, in_place=True), "paged where steps read the pool in place"
    assert rows_possible(None, on_gpu=True, in_place=False), "whole rows where they fit the budget"
    assert plan_cache(4, 64, 1000, None).paged, "(as the plan decides)"
    assert plan_cache(4, 64, 1000, 10**12, in_place=True).paged
    assert not plan_cache(4, 64, 1000, 10**12, in_place=False).paged


def test_a_cpu_pool_starts_with_a_few_blocks_and_may_grow_to_every_row_whole():
    p = plan_cache(rows=64, max_len=1024, token_bytes=1000, free=None)
    assert p.paged and p.budget is None
    scratch = 65 + 5 + PIECE_ALONE // BLOCK  # a block per row and the padding prompts', the capture blocks (65 positions), the widest piece's
    assert p.blocks == 512 // BLOCK + scratch and p.most == 64 * (1024 // BLOCK) + scratch
    assert p.scratch == scratch


def test_rows_by_default_follow_what_the_pool_holds():
    llama3 = 32 * 8 * 128 * 2 * 2  # a Llama-3-8B position's keys and values, fp16: 128 KiB
    assert rows_for(llama3, 124 * 2**30) == 1024, "an H200 after the weights: capped"
    assert rows_for(llama3, 60 * 2**30) == 640, "0.7 x 60 GiB / 128 KiB / 512 positions, in steps of 64"
    assert rows_for(llama3, 6 * 2**30) == 64, "a small card: no fewer than 64"
    assert rows_for(llama3, None) == 64, "a CPU"
    assert rows_for(llama3, 60 * 2**30, fraction=0.35) == 320


def test_a_batch_made_without_rows_holds_the_default_and_says_so():
    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    assert gm.stats()["decode"]["rows"] == 64, "a CPU's"
    gm.close()
    gm = GraphedModule(model, decode={"rows": 3})
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
    assert gm.stats()["decode"]["rows"] == 3
    gm.close()


def test_blocks_are_handed_out_lowest_first_and_the_scratch_blocks_never():
    b = Blocks(8, scratch=3)
    assert b.take(2) == [3, 4] and b.used == 2
    assert b.take(4) is None and b.used == 2, "all or nothing"
    got = b.take(3)
    assert got == [5, 6, 7] and not set(got) & {0, 1, 2}
    b.give([3, 4])
    b.grow(10)
    assert sorted(b.take(4)) == [3, 4, 8, 9] and b.used == 7


def _seq(prompt_len, max_new):
    return Seq(None, 0, [1] * prompt_len, SeqSettings(max_new=max_new))


def test_sequences_wait_in_order_for_the_blocks_their_prompts_need_and_give_them_back_with_their_row():
    sched = Scheduler(4, 64, [1, 2, 4], [64], Blocks(9, scratch=5), block=4)  # 4 blocks of 4 positions
    a, b, c = _seq(5, 3), _seq(10, 6), _seq(1, 1)  # whole lengths 2, 4 and 1 blocks; prompts 2, 3 and 1
    sched.enqueue([a, b, c])
    assert sched.admit() == [a] and len(a.blocks) == 2
    assert sched.short == 2, "b lacks one block for its prompt, and one is kept for a to grow into"
    assert list(sched.queue) == [b, c], "c does not pass b"
    a.done = True
    sched.retire()
    assert a.blocks == [] and sched.pool.used == 0
    assert sched.admit() == [b] and len(b.blocks) == 4, "room for its whole length: it takes it"
    assert sched.short == 2, "c would leave b no block to grow into"


def test_where_the_pool_lacks_room_for_a_whole_length_a_row_takes_blocks_as_it_grows():
    sched = Scheduler(4, 64, [1, 2, 4], [64], Blocks(12, scratch=5), block=4)  # 7 blocks
    a, b = _seq(3, 13), _seq(3, 40)  # whole lengths 4 and 11 blocks
    sched.enqueue([a, b])
    assert sched.admit() == [a, b] and len(a.blocks) == 4, "a: its whole length"
    assert len(b.blocks) == 1 and b.length == 3, "b: what its prompt and first token need"
    assert not sched.short_of(b), "position 3 is in its first block"
    sched.advanced([b])
    assert sched.short_of(b), "position 4 is not"
    assert sched.grant(b) == 1, "the pool has no room for more at once (a block kept for each running row)"
    a.done = True
    sched.retire()
    assert sched.grant(b) == 5, "now it has: what leaves a block for the running row (of 10 it may need, GRANT 8)"


def test_the_sequence_admitted_last_is_preempted_and_waits_first_with_its_tokens():
    sched = Scheduler(4, 64, [1, 2, 4], [64], Blocks(12, scratch=5), block=4)
    a, b, c = _seq(3, 60), _seq(2, 60), _seq(2, 60)  # none fits whole
    sched.enqueue([a, b])
    sched.admit()
    sched.enqueue([c])
    assert sched.admit() == [c]
    assert sched.newest() is c
    c.tokens, c.launched = [7, 8], 2
    row = sched.preempt(c)
    assert row == 2 and c.row is None and c.blocks == [] and sched.holders[2] is None
    assert c.feed == [1, 1, 7, 8] and c.preempted == 1 and list(sched.queue) == [c]
    assert sched.pool.used == 2, "its block back in the pool"
    assert sched.newest() is b
    assert sched.admit() == [c] and c.length == 4 and len(c.blocks) == 2, "its prompt and tokens, and the next position"
    assert c.order > b.order


# ------------------------------------------------------------------ served through the pool

@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_more_requests_than_the_pool_holds_at_once_all_get_generates_tokens(monkeypatch, kind):
    _fixed_pool(monkeypatch, 11, rows=8)  # 11 blocks to hand out: 176 positions
    peak = []
    take = Blocks.take

    def counted(self, n):
        got = take(self, n)
        peak.append(self.used)
        return got

    monkeypatch.setattr(Blocks, "take", counted)
    model = _model(kind)
    gm = GraphedModule(model, decode={"rows": 8})
    prompts = _prompts([5, 11, 3, 14, 9, 2, 13, 6, 8, 12, 4, 10])
    news = [10 + 5 * (i % 6) for i in range(len(prompts))]
    _all_alike(gm, model, prompts, news)
    d = gm.stats()["decode"]
    assert d["cache"] == "paged" and d["cache_bytes"] <= d["cache_budget_bytes"]
    assert d["cache_blocks"] == {"block": BLOCK, "used": 0, "free": 11}
    assert max(peak) <= 11 and d["done"] == len(prompts)
    assert gm.stats()["generate"] == {SHARED: len(prompts)}
    gm.close()


class _Collect:
    """A streamer that keeps what it is given (the prompt first, then each token)."""

    def __init__(self):
        self.got, self.ended = [], 0

    def put(self, value):
        self.got.extend(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_rows_that_cannot_grow_preempt_the_newest_which_is_recomputed_with_generates_tokens(monkeypatch, kind):
    _fixed_pool(monkeypatch, 12, rows=4)  # 192 positions; four rows each growing to 100-120 need more
    model = _model(kind)
    gm = GraphedModule(model, decode={"rows": 4, "paged": True})  # (whole rows would fit beside the capture blocks)
    prompts = _prompts([3, 7, 5, 9, 4, 6])
    news = [110, 105, 112, 100, 108, 111]
    streamers = [_Collect() for _ in prompts]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i],
                                               streamer=streamers[i]), len(prompts))
    for p, n, out, st in zip(prompts, news, got, streamers):
        assert torch.equal(out, _alone(model, p, max_new_tokens=n))
        assert st.got == out[0].tolist() and st.ended == 1, "each token streamed once, across preemptions"
    d = gm.stats()["decode"]
    assert d["preempted"] > 0, "the pool was too small for every row at once"
    assert d["cache_blocks"] == {"block": BLOCK, "used": 0, "free": 12} and d["done"] == len(prompts)
    assert gm.stats()["generate"] == {SHARED: len(prompts)}
    gm.close()


def test_sampled_sequences_preempted_make_the_tokens_they_make_with_room(monkeypatch, gw_log):
    # The noise of a draw depends on the sequence's seed and the position, the penalty on every
    # token so far, the end-of-sequence hold on the tokens made: a recomputed sequence goes on
    # as if it had never stopped.
    model = _model("llama")
    prompts = _prompts([3, 7, 5, 9])
    kw = dict(max_new_tokens=110, do_sample=True, top_k=20, temperature=0.8, repetition_penalty=1.3,
              min_new_tokens=60, eos_token_id=5)
    roomy = GraphedModule(model, decode={"rows": 4})
    want = []
    for i, p in enumerate(prompts):
        torch.manual_seed(i)
        want.append(roomy.generate(torch.tensor([p]), **kw))
    assert roomy.stats()["decode"]["preempted"] == 0
    roomy.close()
    _fixed_pool(monkeypatch, 12, rows=4)
    gm = GraphedModule(model, decode={"rows": 4, "paged": True})
    futs = []
    for i, p in enumerate(prompts):
        torch.manual_seed(i)
        futs.append(gm.submit_generate(torch.tensor([p]), **kw))
    for f, w in zip(futs, want):
        assert torch.equal(f.result(timeout=120), w)
    assert gm.stats()["decode"]["preempted"] > 0
    assert "decode cache full: a sequence" in gw_log.text
    gm.close()


def test_a_request_larger_than_the_whole_pool_fails_alone_with_the_sizes(monkeypatch):
    _fixed_pool(monkeypatch, 11)
    model = _model(positions=512)
    gm = GraphedModule(model)
    fine = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False)
    with pytest.raises(GraphwrapError, match=r"need 200 positions; the decode cache holds 176 in all"):
        gm.generate(torch.tensor([[5] * 100]), max_new_tokens=100, do_sample=False)
    assert torch.equal(fine.result(timeout=60), _alone(model, [5, 6, 7], max_new_tokens=20))
    gm.close()


def test_the_cpu_pool_grows_on_demand_and_keeps_what_rows_hold(monkeypatch, gw_log):
    monkeypatch.setattr("graphwrap.decoding.cache.pool.CPU_START", 16)  # one block at first
    model = _model()
    gm = GraphedModule(model, decode={"rows": 4})
    prompts = _prompts([3, 40, 7, 25])
    news = [60, 30, 45, 20]
    _all_alike(gm, model, prompts, news)
    d = gm.stats()["decode"]
    assert d["cache_blocks"]["free"] > 4, "the pool grew"
    assert "decode cache grew" in gw_log.text
    gm.close()


def test_whole_rows_asked_for_serve_the_same_tokens():
    model = _model("llama")
    gm = GraphedModule(model, decode={"paged": False})
    prompts = _prompts([5, 11, 3])
    _all_alike(gm, model, prompts, [12] * len(prompts))
    assert gm.stats()["decode"]["cache"] == "rows" and gm.stats()["decode"]["cache_blocks"] is None
    gm.close()


# ------------------------------------------------------------------ long prompts

@pytest.mark.parametrize("paged", [True, False])
def test_long_prompts_go_in_pieces_beside_rows_that_decode(monkeypatch, paged):
    from graphwrap.decoding.engine import pieces

    monkeypatch.setattr(pieces, "WHOLE", 0)  # (a long prompt that finds the batch empty: in pieces too)
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model("llama")
    gm = GraphedModule(model, decode={"paged": paged})
    prompts = _prompts([30, 4, 21, 6, 8, 9])
    news = [10, 40, 12, 35, 5, 7]
    _all_alike(gm, model, prompts, news)
    d = gm.stats()["decode"]
    assert d["prefill_pieces"] >= 4 + 3 + 2, "30, 21 and 9 tokens in pieces of 8"
    gm.close()


def test_no_piece_starts_while_the_last_one_runs(monkeypatch):
    """At most one piece on the device (IN_FLIGHT 1 here): a turn that finds the last piece
    still running (an event here that says so once per piece) steps the rows beside it alone,
    or waits for the piece where there is none; the tokens are model.generate's."""
    from graphwrap.decoding.engine import pieces

    class Running:
        def __init__(self):
            self.asked = self.waited = 0

        def query(self):
            self.asked += 1
            return self.asked > 1

        def synchronize(self):
            self.waited += 1

    events = []
    monkeypatch.setattr(pieces, "_ended", lambda server: events.append(Running()) or events[-1])
    monkeypatch.setattr(pieces, "IN_FLIGHT", 1)
    monkeypatch.setattr(pieces, "BUDGET", None)  # (one piece a turn)
    monkeypatch.setattr(pieces, "WHOLE", 0)  # (a long prompt that finds the batch empty: in pieces too)
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model("llama")
    gm = GraphedModule(model)
    _all_alike(gm, model, _prompts([40, 4, 5]), [6, 30, 25])
    d = gm.stats()["decode"]
    assert d["prefill_pieces"] == 5 and len(events) == 5, "40 positions in pieces of 8"
    busy = [e for e in events[:-1] if e.asked]
    assert len(busy) == 4, "each piece but the last found running once by the next"
    assert d["piece_turns_skipped"] + sum(e.waited for e in busy) == 4
    gm.close()


def test_pieces_on_the_device_never_pass_in_flight(monkeypatch):
    """Pieces that end only when waited for (events here): two start, then the turns step the
    short rows alone until none is left, then wait for the oldest piece; never more than
    IN_FLIGHT (2) at once, and the tokens are model.generate's."""
    from graphwrap.decoding.engine import pieces

    class Endless:
        def __init__(self):
            self.ended = False

        def query(self):
            return self.ended

        def synchronize(self):
            self.ended = True

    events, most = [], []

    def ended(server):
        events.append(Endless())
        most.append(sum(not e.ended for e in events))
        return events[-1]

    monkeypatch.setattr(pieces, "_ended", ended)
    monkeypatch.setattr(pieces, "IN_FLIGHT", 2)
    monkeypatch.setattr(pieces, "BUDGET", None)  # (one piece a turn)
    monkeypatch.setattr(pieces, "WHOLE", 0)  # (a long prompt that finds the batch empty: in pieces too)
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model("llama")
    gm = GraphedModule(model)
    _all_alike(gm, model, _prompts([40, 4, 5]), [6, 30, 25])
    assert len(events) == 5 and max(most) == 2 and most[:2] == [1, 2], most
    gm.close()


@pytest.mark.parametrize("paged", [True, False])
def test_a_failing_piece_fails_its_call_alone(monkeypatch, paged):
    from graphwrap.decoding.engine.step import ChunkStep, PieceStep

    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    chunk, piece = ChunkStep.forward, PieceStep.forward

    def chunk_fails_on_start_8(self, input_ids, start, rows):
        if start == 8:
            raise RuntimeError("a piece failed")
        return chunk(self, input_ids, start, rows)

    def piece_fails_on_start_8(self, input_ids, at, rows):
        if int(at[0]) == 8:
            raise RuntimeError("a piece failed")
        return piece(self, input_ids, at, rows)

    monkeypatch.setattr(ChunkStep, "forward", chunk_fails_on_start_8)
    monkeypatch.setattr(PieceStep, "forward", piece_fails_on_start_8)
    model = _model()
    gm = GraphedModule(model, decode={"paged": paged})
    ok = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=30, do_sample=False)
    with pytest.raises(RuntimeError, match="a piece failed"):
        gm.generate(torch.tensor([list(range(2, 22))]), max_new_tokens=5, do_sample=False)
    assert torch.equal(ok.result(timeout=60), _alone(model, [5, 6, 7], max_new_tokens=30))
    assert gm.stats()["decode"]["cache"] == ("paged" if paged else "rows")
    if paged:
        assert gm.stats()["decode"]["cache_blocks"]["used"] == 0
    gm.close()


def test_a_prompt_past_2048_tokens_on_a_model_of_4096_positions_is_served():
    model = _model("llama", positions=4096)
    gm = GraphedModule(model, decode={"prefill_whole": 0})  # (in pieces, were it admitted alone)
    prompt = _prompts([2500])[0]
    short = _prompts([6], seed=2)[0]
    got = thread_results(lambda i: gm.generate(torch.tensor([[prompt, short][i]]), max_new_tokens=[6, 20][i]), 2)
    assert torch.equal(got[0], _alone(model, prompt, max_new_tokens=6))
    assert torch.equal(got[1], _alone(model, short, max_new_tokens=20))
    d = gm.stats()["decode"]
    assert d["max_len"] == 4096 and 5 <= d["prefill_pieces"] <= 20, "2,500 positions in pieces of 512 or 128"
    gm.close()


@pytest.mark.parametrize("budget,pieces_beside", [(None, 20), (2048, 7)], ids=["a-piece-a-turn", "budget-2048"])
def test_a_long_prompt_goes_in_wide_pieces_alone_and_in_narrow_ones_beside_decoding_rows(monkeypatch, budget, pieces_beside):
    """Its weights read a quarter as often where no row waits on its pieces (pool.PIECE_ALONE),
    and pieces of pool.PIECE between the steps of rows that decode: one a turn, or with the
    budget (pieces.BUDGET), one of 128 and then pieces of 512 up to 2,048 positions a turn
    (128 + 3 x 512, then 128 + 512 + the last 196)."""
    from graphwrap.decoding.engine import pieces

    monkeypatch.setattr(pieces, "BUDGET", budget)
    model = _model("llama", positions=4096)
    gm = GraphedModule(model, decode={"prefill_whole": 0})  # (alone too: in pieces)
    prompt = _prompts([2500])[0]
    assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=4), _alone(model, prompt, max_new_tokens=4))
    assert gm.stats()["decode"]["prefill_pieces"] == 5, "2,500 positions alone: pieces of 512"
    short, seen = _prompts([6], seed=2)[0], _Collect()
    beside = gm.submit_generate(torch.tensor([short]), max_new_tokens=300, streamer=seen)
    deadline = time.monotonic() + 60
    while len(seen.got) < len(short) + 2:  # (decoding: its first tokens out)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    other = _prompts([2500], seed=5)[0]  # (not the first: its blocks are cached)
    assert torch.equal(gm.generate(torch.tensor([other]), max_new_tokens=4), _alone(model, other, max_new_tokens=4))
    assert gm.stats()["decode"]["prefill_pieces"] == 5 + pieces_beside, "beside a decoding row"
    assert torch.equal(beside.result(timeout=120), _alone(model, short, max_new_tokens=300))
    gm.close()


def test_decode_options_are_checked():
    model = _model()
    for bad in ({"cache_memory": 0}, {"cache_memory": 1.5}, {"cache_memory": True}, {"paged": "yes"}, {"pages": 1},
                {"prefill_budget": -1}, {"prefill_budget": True}, {"prefill_budget": 512.0},
                {"prefill_whole": -1}, {"prefill_whole": False}, {"prefill_whole": 8192.0},
                {"prefill_beside": -1}, {"prefill_beside": True}, {"prefill_beside": 8192.0}):
        with pytest.raises(GraphwrapError, match="decode"):
            GraphedModule(model, decode=bad)
    GraphedModule(model, decode={"cache_memory": 0.5, "paged": None, "prefill_budget": 0, "prefill_beside": 0})


def test_a_capture_puts_back_the_rows_lengths_and_leaves_the_cache_itself():
    from graphwrap.core.state import Saved, StateRef

    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False)
    server = gm.__dict__["_gw_decode"]
    for window in (server.store.window(64), server.store.prompt_window(16)):
        saved = Saved(server.engine.module, [StateRef(window)])
        kept = [t for _, t, _, _ in saved.items]
        assert any(t is server.store.lengths for t in kept)
        assert not any(t is k for t in kept for k in server.store.keys + server.store.values)
    gm.close()


def test_each_row_writes_its_own_scratch_block_until_it_takes_blocks_and_after():
    from graphwrap.decoding.cache.pages import PagedStore

    store = PagedStore(4, 64, "cpu", BLOCK, 20)
    assert store.table.tolist() == [[r] * 4 for r in range(5)]
    store.assign([2, 0], [[7, 9], [12]])
    assert store.table[2].tolist() == [7, 9, 2, 2] and store.table[0].tolist() == [12, 0, 0, 0]
    store.release(torch.tensor([2]))
    assert store.table[2].tolist() == [2, 2, 2, 2]
    assert store.step_span(40) == 40, "a window per span bucket where steps gather"
    direct = PagedStore(4, 64, "cpu", BLOCK, 20, kernel=True)
    assert direct.step_span(40) == direct.step_span(17) == 64, "one window where rows are read in place"


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
@pytest.mark.parametrize("paged", [True, False])
def test_sliding_windows_share_the_batch_with_generates_tokens(monkeypatch, kind, paged):
    monkeypatch.setattr(server_mod, "CHUNK", 8)  # pieces of 8 beside windows of 4
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _windowed(kind)
    gm = GraphedModule(model, decode={"paged": paged})
    prompts = _prompts([3, 11, 6, 20, 2, 9])
    news = [25, 10, 30, 12, 40, 18]
    _all_alike(gm, model, prompts, news)
    st = gm.stats()
    assert st["generate"] == {SHARED: len(prompts)}, st["decode"].get("off")
    assert st["decode"]["rows_per_step"] > 1 and st["decode"]["prefill_pieces"] > 0
    gm.close()


def test_the_masks_follow_each_kind_of_layer():
    from graphwrap.decoding.cache.rows import row_mask
    from graphwrap.decoding.engine.step import Masks, layer_windows

    assert layer_windows(_windowed("mistral")) == [4, 4]
    assert layer_windows(_windowed("gemma2")) == [4, None]
    assert layer_windows(_model("llama")) == [None, None]
    lengths = torch.tensor([0, 6])
    one = Masks([4, 4])(row_mask, lengths, 8, torch.float32)
    assert (one[1, 0, 0] == 0).tolist() == [False, False, False, True, True, True, True, False]
    both = Masks([4, None])(row_mask, lengths, 8, torch.float32)
    assert set(both) == {"full_attention", "sliding_attention"}
    assert (both["full_attention"][1, 0, 0] == 0).tolist() == [True] * 7 + [False]
    with pytest.raises(ValueError, match="different sliding windows"):
        Masks([4, 8])



def test_the_paged_kernel_is_an_operator_of_torch_with_its_output_shape_for_tracing():
    """torch.compile calls the kernel as torch's operator (Inductor failed on its source): the
    shape of its output, without running it, is what the kernel makes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphwrap.decoding.kernels import paged_attention

    assert torch.ops.graphwrap.paged_attend.default is not None
    with FakeTensorMode():
        query = torch.empty(5, 8, 1, 64)
        pool = torch.empty(40, BLOCK, 2, 64)
        out = paged_attention.attend(query, pool, pool, torch.zeros(5, 4, dtype=torch.long),
                                     torch.ones(5, dtype=torch.long), None, 16, 5.0)
    assert out.shape == (5, 1, 8, 64) and out.dtype == query.dtype


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_joined_prompt_forward_and_a_piece_run_the_head_over_the_positions_they_keep(kind):
    """The joined forward of prompts runs the model's head over each prompt's last position (in
    every row: k x k, not k x width), and a piece over its last valid one; each logit is the
    model's own for that prompt alone."""
    from graphwrap.decoding.cache.pages import PagedStore
    from graphwrap.decoding.engine.step import PieceStep, PrefillStep, Prompts, cache_layout

    model = _model(kind)
    head = model.get_output_embeddings()
    keys, values = cache_layout(model, "cpu")
    seen = []
    hook = head.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape[:-1])))
    store = PagedStore(4, 64, "cpu", BLOCK, scratch_blocks(4, BLOCK) + 16)
    store.allocate(keys, values)
    store.assign([0, 1, 2], [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    prompts = _prompts((3, 11, 6))
    try:
        with torch.no_grad():
            got = PrefillStep(model)(*Prompts(4, 64, store.scratch).inputs(prompts, [0, 1, 2], (4, 16), "cpu"),
                                     store.prompt_window(16))
            assert seen == [(4, 4)], f"the head ran over {seen}, not each prompt's last position in every row"
            for i, p in enumerate(prompts):
                want = model(input_ids=torch.tensor([p])).logits[0, -1]
                torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
            seen.clear()
            ids = torch.zeros((1, 8), dtype=torch.long)
            ids[0, :5] = torch.tensor(prompts[1][:5])
            piece = PieceStep(model)(ids, torch.tensor([0, 5, 3]), store.piece_window(8, 64))
            assert seen == [(1, 1)], f"the piece's head ran over {seen}"
            torch.testing.assert_close(piece[0], model(input_ids=torch.tensor([prompts[1][:5]])).logits[0, -1],
                                       rtol=1e-4, atol=1e-4)
    finally:
        hook.remove()


@pytest.mark.parametrize("caching", [False, True], ids=["caching-off", "caching-on"])
def test_a_turns_piece_budget_takes_pieces_of_several_long_prompts(monkeypatch, caching):
    """``pieces.BUDGET``, or the batch's ``decode={"prefill_budget": N}`` where given: beyond a
    turn's first piece, the waiting long prompts' pieces, oldest first, up to the budget's
    positions; every answer is generate's (decoding rows beside them, cached prefixes too), and
    without a budget (or with 0) none is taken."""
    from graphwrap.decoding.engine import pieces

    monkeypatch.setattr(server_mod, "CHUNK", 32)  # pieces of 32
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model("llama", positions=512)
    system = _prompts([70], seed=11)[0]
    prompts = [system + q for q in _prompts([60, 90, 120, 150, 45, 30], seed=12)] + _prompts([5, 9], seed=13)
    news = [6, 8, 5, 7, 9, 4, 60, 70]  # (the short two decode beside the pieces)
    # (pieces.BUDGET, the batch's decode={"prefill_budget": ...}: it rules where given, 0 is none)
    for default, given in ((None, None), (128, None), (128, 0), (None, 128)):
        monkeypatch.setattr(pieces, "BUDGET", default)
        budget = default if given is None else given or None
        opts = {"prefix_caching": caching} if given is None else {"prefix_caching": caching, "prefill_budget": given}
        gm = GraphedModule(model, decode=opts)
        got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), max_new_tokens=news[i],
                                                   do_sample=False), len(prompts))
        for p, n, out in zip(prompts, news, got):
            assert torch.equal(out, _alone(model, p, max_new_tokens=n)), (budget, len(p))
        d = gm.stats()["decode"]
        assert d["prefill_budget"] == (budget or 0)
        assert (d["budget_pieces"] > 0) == (budget is not None), d["budget_pieces"]
        assert d["cache_blocks"]["used"] == 0
        gm.close()


def test_the_piece_kernels_shape_of_work_follows_how_many_tiles_of_query_rows_a_piece_makes(monkeypatch):
    """Pieces of 512 alone on a Llama-3-8B shape fill an H200's 132 multiprocessors with tiles of
    64 query rows: one program a tile of 128 rows, no splits (heads of 128 at most; wider heads
    keep 64 rows); pieces of 128 beside decoding rows make 64 tiles: four programs share each."""
    from graphwrap.decoding.kernels import piece_attention as pa

    monkeypatch.setattr(_compat, "multiprocessors", lambda device: 132)

    def shape(hq, hkv, width, d):
        return pa._shape_of_work(torch.empty(1, hq, width, d, device="meta"), torch.empty(8, 16, hkv, d, device="meta"))

    assert shape(32, 8, 512, 128) == pa.WIDE == {"rows": 128, "warps": 8, "stages": 4, "splits": 1}
    assert shape(32, 8, 128, 128) == {"splits": pa.SPLITS}  # 8 key heads x 512 rows / 64: 64 tiles
    assert shape(16, 8, 512, 256) == {"splits": pa.SPLITS}  # 8 x 1,024 / 64 = 128 tiles: fewer than 132
    assert shape(32, 8, 512, 256) == {"splits": 1}  # 256 tiles, heads of 256
    assert shape(4, 2, 512, 64) == {"splits": pa.SPLITS}  # a small model's piece: 32 tiles


def test_a_steps_attention_splits_each_rows_positions_where_its_rows_leave_sms_idle(monkeypatch):
    """splits_at: a window that splits keeps its splits; else 8 programs a row where the rows'
    programs (a row and key head each) are a quarter of the SMs at most, 4 where they are as
    many at most, none past that; and never off a GPU."""
    from graphwrap.decoding.kernels import paged_attention as pa

    monkeypatch.setattr(_compat, "multiprocessors", lambda device: 132)
    gpu = torch.device("cuda", 0)
    assert [pa.splits_at(1, rows, 8, gpu) for rows in (1, 4, 5, 16, 17, 256)] == [8, 8, 4, 4, 1, 1]
    assert pa.splits_at(pa.SPLITS, 1, 8, gpu) == pa.SPLITS and pa.splits_at(pa.SPLITS, 256, 8, gpu) == pa.SPLITS
    assert pa.splits_at(1, 8, 4, gpu) == 8, "a small model's 4 key heads: 32 programs at 8 rows"
    assert pa.splits_at(1, 1, 8, torch.device("cpu")) == 1


def test_a_split_steps_work_is_every_rows_tiles_made_once_a_forward(monkeypatch):
    """work_of: each row's tiles of positions (the kernel's tile for the heads' width, a sliding
    window's first tile on) summed; found by a forward's first attention whose window splits,
    handed to the rest, dropped by its first layer; none where the window does not split."""
    from graphwrap.decoding.cache.layers import StepSlots
    from graphwrap.decoding.cache.pages import PagedStore
    from graphwrap.decoding.kernels import attention
    from graphwrap.decoding.kernels import paged_attention as pa

    seen = torch.tensor([1, 64, 65, 1000, 4097])
    tile = pa.shape_of_work(128)[0]
    assert int(pa.work_of(seen, 128)) == sum(max(1, -(-s // tile)) for s in seen.tolist())
    firsts = [max(0, s - 300) // tile * tile for s in seen.tolist()]
    assert int(pa.work_of(seen, 128, 300)) == sum(max(1, -(-(s - f) // tile)) for s, f in zip(seen.tolist(), firsts))
    assert pa.shape_of_work(64)[0] != tile and int(pa.work_of(seen, 64)) < int(pa.work_of(seen, 128))

    monkeypatch.setattr(_compat, "multiprocessors", lambda device: 132)
    gpu = torch.device("cuda", 0)
    assert [pa.balances(rows, 8, gpu) for rows in (1, 4, 5, 256)] == [False, False, True, True]
    slots = StepSlots()
    slots.splits = pa.SPLITS
    assert attention._work(slots, seen, 128, None, 8) is None, "the CPU's own attention: none"
    made = []
    monkeypatch.setattr(pa, "work_of", lambda s, d, w: made.append((d, w)) or torch.tensor(len(made)))

    def gpu_seen(rows):  # (what the GPU's seen of so many rows tells _work)
        return type("Seen", (), {"is_cuda": True, "shape": (rows,), "device": gpu})()
    first = attention._work(slots, gpu_seen(64), 128, None, 8)
    assert attention._work(slots, gpu_seen(64), 128, None, 8) is first
    assert int(attention._work(slots, gpu_seen(64), 128, 300, 8)) == 2
    assert made == [(128, None), (128, 300)], "once a head width and window in a forward"
    assert attention._work(StepSlots(), gpu_seen(64), 128, None, 8) is None, "a window that does not split"
    one = StepSlots()
    one.splits = pa.SPLITS
    assert attention._work(one, gpu_seen(1), 128, None, 8) is None and not one.work, "one row keeps the window's split"
    store = PagedStore(4, 64, "cpu", 16, 40, kernel=True)
    store.allocate([torch.zeros(1, 2, 1, 8)] * 2, [torch.zeros(1, 2, 1, 8)] * 2)
    layers, states = store.step_layers(32), torch.ones(3, 2, 1, 8)
    layers[0].update(states, states)
    layers[0].slots.work = {(128, None): first}
    layers[1].update(states, states)
    assert layers[1].slots.work, "a later layer keeps the forward's"
    layers[0].update(states, states)
    assert layers[0].slots.work is None, "a forward's first layer drops the last forward's"
