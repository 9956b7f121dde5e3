"""A sequence's record (graphwrap/decoding/engine/scheduler.py, ``Seq``) takes its row once per
admission and lets go of it once (``Scheduler.release``), on every path by which a request ends:
its last token, a preemption, a cancel while queued or running, a streamer that raises, a
settings write that fails, a model that raises, a long prompt's pieces, a closed batch. Checked
by the scheduler's counts (admissions against releases), its rows and the pool's blocks, on a
CPU, eagerly; the tokens of the requests that end well are ``model.generate``'s. And the
turn's three parts (graphwrap/decoding/engine/loop.py) run in their order. Needs transformers
(skipped with the reason without it)."""

import time

import pytest
import torch
from test_generate_alone_cpu import Collect
from test_generate_paged_cpu import _alone, _fixed_pool, _model, _prompts

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.decoding.callers.settings import SeqSettings
from graphwrap.decoding.engine import loop, outputs, pieces
from graphwrap.decoding.engine import server as server_mod
from graphwrap.decoding.engine.sampling import RowSettings
from graphwrap.decoding.engine.scheduler import Scheduler, Seq

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")


def _settled(gm, timeout=30.0):
    """The batch's scheduler once no row is held (a sequence's row goes back at the turn after its
    end), with every admission released."""
    sched = gm.__dict__["_gw_decode"].sched
    deadline = time.monotonic() + timeout
    while (any(h is not None for h in sched.holders) or sched.admitted != sched.released) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    return sched


def test_a_release_is_once_per_admission():
    sched = Scheduler(2, 64, [1, 2], [64])
    a, b = (Seq(None, i, [1, 2, 3], SeqSettings(max_new=4)) for i in range(2))
    sched.enqueue([a, b])
    assert sched.admit() == [a, b] and sched.admitted == 2
    a.done = True
    assert sched.retire() == [0] and sched.released == 1 and a.row is None and a.blocks == []
    with pytest.raises(AssertionError, match="released twice"):
        sched.release(a)
    assert sched.preempt(b) == 1 and sched.released == 2 and list(sched.queue) == [b], "preempted: back at the head"
    assert sched.admit() == [b] and sched.admitted == 3 and b.preempted == 1
    b.done = True
    sched.retire()
    assert sched.released == sched.admitted == 3 and sorted(sched.free) == [0, 1]


def test_every_way_a_request_ends_gives_its_row_and_blocks_back_once(monkeypatch):
    """Beside preemptions in a pool too small for every row at once and a long prompt in pieces:
    a streamer that raises, a cancel while queued and one while running, a request whose
    settings cannot be written, one whose prompt makes the model raise, and a token id past the
    vocabulary (refused at once). The others get model.generate's tokens."""
    _fixed_pool(monkeypatch, 12, rows=4)  # 192 positions for four rows growing past 100 each
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces, "WHOLE", 0)  # (the long prompt in pieces)
    write = RowSettings.write

    def refuse(self, rows, settings, *a, **kw):  # (a request with this seed's settings cannot be written)
        if any(s.min_new == 3 for s in settings):
            raise ValueError("these settings cannot be written")
        return write(self, rows, settings, *a, **kw)

    monkeypatch.setattr(RowSettings, "write", refuse)
    model = _model("llama")
    gm = GraphedModule(model, decode={"rows": 4, "paged": True})
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    server = gm.__dict__["_gw_decode"]
    embed = model.model.embed_tokens
    forward = embed.forward

    def raising(ids):  # (a prompt holding 4, 99, 6 makes the model raise)
        if ids.shape[-1] >= 3 and bool(((ids[..., :-2] == 4) & (ids[..., 1:-1] == 99) & (ids[..., 2:] == 6)).any()):
            raise RuntimeError("the model refused this prompt")
        return forward(ids)

    monkeypatch.setattr(embed, "forward", raising)
    long_one, *shorts = _prompts([30, 3, 7, 5, 9], seed=3)
    news = [105, 110, 100, 108]
    loud = Collect(raise_at=4, error=ValueError("the streamer's own error"))
    running = Collect()
    with server.cond:  # (queued together: admitted in the same turns)
        good = [gm.submit_generate(torch.tensor([p]), max_new_tokens=n) for p, n in zip(shorts, news)]
        long_call = gm.submit_generate(torch.tensor([long_one]), max_new_tokens=20)
        failing = gm.submit_generate(torch.tensor([[4, 5, 6]]), max_new_tokens=30, streamer=loud)
        unwritable = gm.submit_generate(torch.tensor([[4, 7]]), max_new_tokens=5, min_new_tokens=3)
        refused = gm.submit_generate(torch.tensor([[4, 99, 6]]), max_new_tokens=5)
        to_cancel = gm.submit_generate(torch.tensor([[8, 9, 10]]), max_new_tokens=100, streamer=running)
        queued = gm.submit_generate(torch.tensor([[3, 4]]), max_new_tokens=5)
        assert queued.cancel()
    with pytest.raises(GraphwrapError, match="vocabulary|token id"):
        gm.generate(torch.tensor([[5, 6, 5000]]), max_new_tokens=4)
    deadline = time.monotonic() + 60
    while len(running.got) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert to_cancel.cancel(), "cancelled while running"
    for p, n, fut in zip(shorts, news, good):
        assert torch.equal(fut.result(timeout=120), _alone(model, p, max_new_tokens=n))
    assert torch.equal(long_call.result(timeout=120), _alone(model, long_one, max_new_tokens=20))
    with pytest.raises(ValueError, match="the streamer's own error"):
        failing.result(timeout=60)
    with pytest.raises(ValueError, match="cannot be written"):
        unwritable.result(timeout=60)
    with pytest.raises(RuntimeError, match="refused this prompt"):
        refused.result(timeout=60)
    sched = _settled(gm)
    d = gm.stats()["decode"]
    assert d["preempted"] > 0 and d["prefill_pieces"] > 0, d
    assert sched.admitted == sched.released and all(h is None for h in sched.holders), (sched.admitted, sched.released)
    assert sorted(sched.free) == [0, 1, 2, 3] and d["cache_blocks"] == {"block": 16, "used": 0, "free": 12}, d
    gm.close()


def test_a_closed_batch_lets_go_of_every_row_it_held(monkeypatch):
    """``stop`` mid-generation (as the process's exit does): every call fails with the reason,
    and every row admitted is released by the turn that ends the thread, or was before."""
    model = _model("llama")
    gm = GraphedModule(model, decode={"rows": 4})
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=1)
    server = gm.__dict__["_gw_decode"]
    streams = [Collect() for _ in range(3)]
    futs = [gm.submit_generate(torch.tensor([[3 + i, 4]]), max_new_tokens=100, streamer=s) for i, s in enumerate(streams)]
    deadline = time.monotonic() + 60
    while not all(len(s.got) > 3 for s in streams) and time.monotonic() < deadline:
        time.sleep(0.01)
    server.stop(GraphwrapError("stopped by the test"))
    for f in futs:
        with pytest.raises(GraphwrapError, match="stopped by the test"):
            f.result(timeout=60)
    server.thread.join(30)
    assert not server.thread.is_alive() and not server.sched.queue
    sched = server.sched
    assert sched.admitted == sched.released and all(h is None for h in sched.holders), (sched.admitted, sched.released)


def test_a_turn_runs_schedule_then_run_then_process(monkeypatch):
    """Each working turn schedules, runs the admitted prompts and the step, then reads the tokens
    of all but the last steps queued and gives rows back, in that order."""
    seen = []
    for mod, name in ((loop, "schedule"), (loop, "run"), (outputs, "read"), (outputs, "retire")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, (lambda f, n: lambda *a, **kw: seen.append(n) or f(*a, **kw))(fn, name))
    model = _model("llama")
    gm = GraphedModule(model, decode={"rows": 4})
    prompt = _prompts([4], seed=8)[0]
    assert torch.equal(gm.generate(torch.tensor([prompt]), max_new_tokens=6), _alone(model, prompt, max_new_tokens=6))
    turns = [seen[i:i + 4] for i, n in enumerate(seen) if n == "run"]
    assert turns and all(t == ["run", "read", "retire", "schedule"] or t == ["run", "read", "retire"] for t in turns), seen
    assert seen.index("schedule") < seen.index("run")
    gm.close()
