"""Every request of the shared decode batch ends alone and right, whatever its neighbours send
or the model goes through: a bad request, a failing or slow streamer, a cancel, a full queue, a
model changed behind the wrapper, a dropped GraphedModule, a close racing calls, the process
exiting. Each test drives the public API on a CPU (eagerly: the batch's decisions are the same
with graphs) and compares tokens with ``model.generate`` alone. Needs transformers."""

import asyncio
import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.decoding.callers import settings as settings_mod
from graphwrap.decoding.callers.settings import CallPlan, plan_call

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
SHARED = "graphwrap's shared decode batch"


def _model(vocab=101, positions=128, eos=None, **kw):
    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=positions, bos_token_id=1,
                        eos_token_id=eos, pad_token_id=0, **kw)
    return tr.GPT2LMHeadModel(cfg).eval()


def _alone(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt]), do_sample=kw.pop("do_sample", False), **kw)


class Collect:
    """A streamer that keeps what it gets (and may wait or raise on a token)."""

    def __init__(self, wait=0.0, raise_at=None, error=None):
        self.got, self.ended, self.wait = [], 0, wait
        self.raise_at, self.error = raise_at, error
        self.done = threading.Event()

    def put(self, v):
        self.got.append(v.reshape(-1).tolist())
        if self.raise_at is not None and len(self.got) > self.raise_at:
            raise self.error
        time.sleep(self.wait)

    def end(self):
        self.ended += 1
        self.done.set()


# ------------------------------------------------------------------ 1. ids outside the vocabulary


def test_an_eos_id_outside_the_vocabulary_fails_nobody_and_is_never_made():
    model = _model()
    gm = GraphedModule(model, decode={"rows": 2})
    prompts = [[5, 6, 7], [9, 3], [4, 4, 8], [7]]
    bad = dict(eos_token_id=300, min_new_tokens=5, max_new_tokens=9)
    good = dict(max_new_tokens=9)
    kws = [bad, good, bad, good]
    got = thread_results(lambda i: gm.generate(torch.tensor([prompts[i]]), do_sample=False, **kws[i]), 4)
    for p, kw, out in zip(prompts, kws, got):
        assert torch.equal(out, _alone(model, p, **kw))
    # The rows the bad requests held serve the next ones with neutral settings.
    for p in prompts:
        assert torch.equal(gm.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False),
                           _alone(model, p, max_new_tokens=6))
    assert gm.stats()["generate"] == {SHARED: 8}


def test_a_config_whose_eos_is_outside_the_vocabulary_is_served_as_generate_serves_it():
    model = _model(vocab=100, eos=50256)  # GPT2Config's own eos with a small vocabulary
    model.generation_config.eos_token_id = 50256
    gm = GraphedModule(model)
    out = gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, min_new_tokens=3, do_sample=False)
    assert torch.equal(out, _alone(model, [5, 6, 7], max_new_tokens=8, min_new_tokens=3))
    assert gm.stats()["generate"] == {SHARED: 1}


# ------------------------------------------------------------------ 2. past the model's positions


def test_a_request_past_the_models_positions_fails_alone_with_the_sizes():
    model = _model(positions=64)
    gm = GraphedModule(model, decode={"max_len": 4096})  # more than the model has: held to 64
    good = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=40, do_sample=False)
    with pytest.raises(GraphwrapError, match="the model has 64 positions"):
        gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=70, do_sample=False)
    assert torch.equal(good.result(timeout=60), _alone(model, [5, 6, 7], max_new_tokens=40))
    assert gm.stats()["decode"]["max_len"] == 64
    # A checkpoint's max_length past the positions (no max_new_tokens given): the same clear error.
    model.generation_config.max_length = 4096
    with pytest.raises(GraphwrapError, match="need 4096 positions"):
        gm.generate(torch.tensor([[5, 6, 7]]), do_sample=False)
    assert torch.equal(gm.generate(torch.tensor([[5, 6]]), max_new_tokens=5, do_sample=False),
                       _alone(model, [5, 6], max_new_tokens=5))


# ------------------------------------------------------------------ 3. and 4. streamers


class Boom(BaseException):
    """Not an Exception: what a streamer interrupted by the user raises."""


def test_a_streamer_raising_a_base_exception_fails_its_own_call_only():
    model = _model()
    gm = GraphedModule(model)
    s = Collect(raise_at=3, error=Boom("the consumer went away"))
    bad = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=30, do_sample=False, streamer=s)
    good = [gm.submit_generate(torch.tensor([[9, i + 2]]), max_new_tokens=20, do_sample=False) for i in range(3)]
    with pytest.raises(Boom):
        bad.result(timeout=60)
    for i, f in enumerate(good):
        assert torch.equal(f.result(timeout=60), _alone(model, [9, i + 2], max_new_tokens=20))
    assert len(s.got) == 4, "no token after the one whose put raised"
    assert s.done.wait(10) and s.ended == 1, "its streamer was ended all the same"
    assert torch.equal(gm.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False),
                       _alone(model, [5, 6], max_new_tokens=4))
    # A streamer that raises once its call has finished decoding (its tokens still on their way
    # to it): the call fails all the same.
    late = Collect()

    def put_after_the_decode(v):
        late.got.append(v.reshape(-1).tolist())
        if len(late.got) == 2:
            deadline = time.monotonic() + 10
            while gm.stats()["decode"]["rows_busy"] and time.monotonic() < deadline:
                time.sleep(0.005)
            raise Boom("the consumer went away late")

    late.put = put_after_the_decode
    with pytest.raises(Boom, match="late"):
        gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False, streamer=late)
    assert gm.stats()["decode"]["failed"] == 2


def test_a_slow_streamer_holds_up_only_its_own_call():
    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)  # the batch made
    gate = threading.Event()
    slow = Collect()
    slow.put = lambda v: (slow.got.append(v.reshape(-1).tolist()), len(slow.got) > 2 and gate.wait(60))
    slow_fut = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False, streamer=slow)
    while len(slow.got) < 3:  # its consumer is stuck on its second token
        time.sleep(0.005)
    try:
        quick = gm.submit_generate(torch.tensor([[9, 8]]), max_new_tokens=8, do_sample=False).result(timeout=30)
        assert not slow_fut.done()
    finally:
        gate.set()
    assert torch.equal(quick, _alone(model, [9, 8], max_new_tokens=8))
    out = slow_fut.result(timeout=60)
    assert [t for (t,) in slow.got[1:]] == out[0, 3:].tolist() and slow.ended == 1


def test_the_decode_thread_failing_ends_every_call_and_wakes_callers_waiting_for_room(monkeypatch):
    from graphwrap.decoding.engine import steps

    model = _model()
    gm = GraphedModule(model, decode={"rows": 1, "max_queue": 1})
    gm.generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)
    server = gm.__dict__["_gw_decode"]
    gate = threading.Event()
    step = steps.step

    def failing(server, live):
        gate.wait(10)
        raise Boom("a CUDA error at an event wait, say")

    monkeypatch.setattr(steps, "step", failing)
    results = []

    def call(i):
        try:
            results.append(gm.generate(torch.tensor([[5, i + 2]]), max_new_tokens=10, do_sample=False))
        except BaseException as e:  # noqa: BLE001
            results.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # one decoding, one queued, the others waiting for room
    gate.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a caller waiting for room was never woken"
    assert server.broken is not None and any(isinstance(r, Boom) for r in results)
    monkeypatch.setattr(steps, "step", step)
    # The next call gets a new batch.
    assert torch.equal(gm.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False),
                       _alone(model, [5, 6], max_new_tokens=4))
    assert gm.__dict__["_gw_decode"] is not server


# ------------------------------------------------------------------ 5. to 8. silent wrong answers


def test_min_new_tokens_holds_back_every_eos_id_however_many():
    model = _model()
    probe = _alone(model, [5, 6, 7], max_new_tokens=24)[0, 3:].tolist()
    eos = list(dict.fromkeys([3, 4, 5, 6, 7] + probe[:3]))  # more than 4 ids, among them tokens it makes early
    kw = dict(eos_token_id=eos, min_new_tokens=7, max_new_tokens=24)
    want = _alone(model, [5, 6, 7], **kw)
    gm = GraphedModule(model)
    assert torch.equal(gm.generate(torch.tensor([[5, 6, 7]]), do_sample=False, **kw), want)
    assert gm.stats()["generate"] == {SHARED: 1}


@pytest.mark.parametrize("kw", [dict(no_repeat_ngram_size=1), dict(forced_eos_token_id=0),
                                dict(forced_eos_token_id=1), dict(min_p=1.0, do_sample=True, top_k=0)])
def test_settings_whose_value_is_0_1_or_true_are_not_taken_for_neutral(kw):
    model = _model()
    ids = torch.tensor([[5, 6, 7]])
    why = plan_call(model, (ids,), dict(max_new_tokens=12, **kw))
    assert isinstance(why, str) and next(iter(kw)) in why
    gm = GraphedModule(model)
    torch.manual_seed(3)
    got = gm.generate(ids, max_new_tokens=12, **dict(dict(do_sample=False), **kw))
    torch.manual_seed(3)
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=12, **dict(dict(do_sample=False), **kw))
    assert torch.equal(got, want)


def test_neutral_values_of_their_own_type_are_still_served():
    model = _model()
    ids = torch.tensor([[5, 6, 7]])
    for kw in (dict(no_repeat_ngram_size=0), dict(num_beams=1), dict(typical_p=1.0), dict(output_scores=False),
               dict(return_dict_in_generate=False), dict(max_new_tokens=5.0)):
        assert isinstance(plan_call(model, (ids,), dict(dict(max_new_tokens=5), **kw)), CallPlan), kw
    assert not settings_mod.neutral("num_beams", True), "True is not 1"


def test_returned_scores_and_dicts_are_generates_own():
    model = _model()
    gm = GraphedModule(model)
    ids = torch.tensor([[5, 6, 7]])
    kw = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True)
    got = gm.generate(ids, **kw)
    with torch.no_grad():
        want = model.generate(input_ids=ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert got.scores is not None and len(got.scores) == 20
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got.scores, want.scores))
    alone = gm.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert not isinstance(alone, torch.Tensor) and torch.equal(alone.sequences, _alone(model, [5, 6, 7],
                                                                                      max_new_tokens=5))


def test_the_callers_input_ids_are_copied_when_the_call_comes():
    model = _model()
    gm = GraphedModule(model)
    ids = torch.tensor([[5, 6, 7]])
    fut = gm.submit_generate(ids, max_new_tokens=30, do_sample=False)
    ids.fill_(9)  # the caller refills its buffer for the next request
    assert torch.equal(fut.result(timeout=60), _alone(model, [5, 6, 7], max_new_tokens=30))


# ------------------------------------------------------------------ 9. the model changed


def test_a_model_converted_after_a_call_gets_a_new_batch():
    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    first = gm.__dict__["_gw_decode"]
    model.double()  # the model itself, not gm.to(...)
    out = gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10, do_sample=False)
    assert torch.equal(out, _alone(model, [5, 6, 7], max_new_tokens=10))
    second = gm.__dict__["_gw_decode"]
    assert second is not first and first.closed
    assert second.store.keys[0].dtype == torch.float64
    model.float()
    assert torch.equal(gm.generate(torch.tensor([[5, 6]]), max_new_tokens=6, do_sample=False),
                       _alone(model, [5, 6], max_new_tokens=6))


# ------------------------------------------------------------------ 10. and 11. lifetime, close


def test_a_dropped_graphed_module_lets_go_of_its_batch_thread_and_cache():
    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    fut = gm.submit_generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False)
    fut.result(timeout=60)
    server = weakref.ref(gm.__dict__["_gw_decode"])
    pool = weakref.ref(server().store.keys[0])
    thread = server().thread
    gc.disable()  # without the collector: a cycle through the batch would keep it (and its pool) until it ran
    try:
        del gm
        thread.join(10)
        assert not thread.is_alive(), "the decode thread outlived its GraphedModule"
        assert pool() is None, "the cache's pool outlived the batch's thread"
        assert server() is None, "the batch (its cache and the model) outlived its GraphedModule"
        assert torch.equal(fut.result(), _alone(model, [5, 6], max_new_tokens=4)), "a call's result outlives its batch"
    finally:
        gc.enable()


def test_a_closed_batch_gives_back_its_pool_when_its_thread_ends():
    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    server = gm.__dict__["_gw_decode"]
    pool = weakref.ref(server.store.keys[0])
    assert gm.close(timeout=10)
    assert pool() is None and server.store.nbytes() == 0
    assert torch.equal(gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False),
                       _alone(model, [5, 6, 7], max_new_tokens=4)), "the next call makes a new batch"


def test_a_call_racing_close_goes_to_the_next_batch(monkeypatch):
    from graphwrap.decoding.engine.server import DecodeServer

    model = _model()
    gm = GraphedModule(model)
    want = _alone(model, [5, 6, 7], max_new_tokens=6)
    assert torch.equal(gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False), want)
    first = gm.__dict__["_gw_decode"]
    check = DecodeServer.check

    def closing_first(self, plan):  # gm.close() from another thread, after the call took the batch
        if self is first:
            gm.close()
        return check(self, plan)

    monkeypatch.setattr(DecodeServer, "check", closing_first)
    assert torch.equal(gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False), want)
    assert gm.__dict__["_gw_decode"] is not first
    # And closes racing calls from threads: every call served.
    stop, errors, outs = threading.Event(), [], []

    def caller():
        while not stop.is_set():
            try:
                outs.append(gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False))
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    until = time.monotonic() + 2.0  # a tight loop of closes (3 at once had failed a call: "closed three times")
    while time.monotonic() < until:
        gm.close()
        time.sleep(0.001)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:1]
    assert outs and all(torch.equal(o, want) for o in outs)


def test_close_that_times_out_leaves_one_batch_at_a_time(monkeypatch):
    from graphwrap.decoding.callers import front

    model = _model()
    gm = GraphedModule(model)
    long = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=100, do_sample=False)
    old = gm.__dict__["_gw_decode"]
    assert not gm.close(timeout=0)
    make = front._make
    alive_when_made = []

    def watched(held, module):
        alive_when_made.append(old.thread.is_alive())
        return make(held, module)

    monkeypatch.setattr(front, "_make", watched)
    out = gm.generate(torch.tensor([[9, 8]]), max_new_tokens=5, do_sample=False)
    assert alive_when_made == [False], "a second batch was made while the first still ran"
    assert torch.equal(out, _alone(model, [9, 8], max_new_tokens=5))
    assert torch.equal(long.result(timeout=60), _alone(model, [5, 6, 7], max_new_tokens=100))


def test_close_from_a_callers_callback_does_not_wait_for_itself():
    model = _model()
    gm = GraphedModule(model)
    closed = threading.Event()
    fut = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False)
    fut.add_done_callback(lambda f: (gm.close(), closed.set()))
    assert torch.equal(fut.result(timeout=60), _alone(model, [5, 6, 7], max_new_tokens=5))
    assert closed.wait(30), "close() in a done-callback waited for the delivery it runs in"
    assert torch.equal(gm.generate(torch.tensor([[5, 6]]), max_new_tokens=4, do_sample=False),
                       _alone(model, [5, 6], max_new_tokens=4))


# ------------------------------------------------------------------ 12. and 13. asyncio, cancels


def test_agenerate_under_a_full_queue_streams_the_prompt_once_keeps_its_seed_and_honours_cancel(monkeypatch):
    from graphwrap.decoding.engine.step import DecodeStep

    model = _model()
    gm = GraphedModule(model, decode={"rows": 1, "max_queue": 1})
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.8)
    torch.manual_seed(11)
    with_room = gm.generate(torch.tensor([[5, 6, 7]]), **kw)
    step = DecodeStep.forward

    def slow_step(self, *args, **kwargs):  # (the first blocker still decodes while the tasks queue: 120 steps >= 0.6 s)
        time.sleep(0.005)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(DecodeStep, "forward", slow_step)

    async def main():
        blockers = [gm.submit_generate(torch.tensor([[9, i + 2]]), max_new_tokens=120, do_sample=False)
                    for i in range(2)]  # one decoding, one queued: the queue is full
        s = Collect()
        torch.manual_seed(11)
        task = asyncio.ensure_future(gm.agenerate(torch.tensor([[5, 6, 7]]), streamer=s, **kw))
        cancelled = asyncio.ensure_future(gm.agenerate(torch.tensor([[4, 4]]), max_new_tokens=30, do_sample=False))
        await asyncio.sleep(0.01)
        assert not blockers[0].done()  # (the queue is still full)
        cancelled.cancel()
        out = await task
        for b in blockers:
            b.result(timeout=60)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return out, s

    calls_before = gm.stats()["decode"]["calls"]
    out, s = asyncio.run(main())
    assert torch.equal(out, with_room), "the same seed gives the same tokens whether the queue had room"
    assert s.got[0] == [5, 6, 7] and sum(1 for g in s.got if len(g) > 1) == 1, "the prompt was streamed once"
    assert gm.stats()["decode"]["calls"] == calls_before + 3, "the cancelled task's call was never queued"


def test_agenerate_waiting_for_room_when_the_batch_closes_goes_to_the_next_batch():
    model = _model()
    gm = GraphedModule(model, decode={"rows": 1, "max_queue": 1})

    async def main():
        blockers = [gm.submit_generate(torch.tensor([[9, i + 2]]), max_new_tokens=60, do_sample=False)
                    for i in range(2)]
        task = asyncio.ensure_future(gm.agenerate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, do_sample=False))
        await asyncio.sleep(0.01)
        assert not blockers[0].done() and not task.done()  # (it waits for room)
        await asyncio.get_running_loop().run_in_executor(None, gm.close)
        for b in blockers:
            b.result(timeout=60)
        return await task

    assert torch.equal(asyncio.run(main()), _alone(model, [5, 6, 7], max_new_tokens=6))


def test_a_cancelled_calls_streamer_is_ended_and_gets_no_token_after():
    model = _model()
    gm = GraphedModule(model)
    s = Collect(wait=0.02)
    fut = gm.submit_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=100, do_sample=False, streamer=s)
    while len(s.got) < 3:
        time.sleep(0.005)
    assert fut.cancel()
    at_cancel = len(s.got)
    assert s.done.wait(10), "a consumer of the streamer would wait forever"
    assert len(s.got) <= at_cancel + 1, "tokens kept coming after the cancel"
    assert s.ended == 1
    deadline = time.monotonic() + 10
    while gm.stats()["decode"]["rows_busy"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gm.stats()["decode"]["rows_busy"] == 0


# ------------------------------------------------------------------ 14. to 16.


def test_the_process_exits_at_once_with_requests_decoding():
    script = textwrap.dedent("""
        import time, torch, transformers, graphwrap
        torch.manual_seed(0)
        futs = []
        for _ in range(2):
            cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=1024,
                                          bos_token_id=1, eos_token_id=None, pad_token_id=0)
            gm = graphwrap.GraphedModule(transformers.GPT2LMHeadModel(cfg).eval())
            futs += [gm.submit_generate(torch.tensor([[5, 6, i + 2]]), max_new_tokens=1000, do_sample=False)
                     for i in range(40)]
        time.sleep(1.0)
        assert not any(f.done() for f in futs)
        print(time.time(), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    exited = time.time()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
    took = exited - float(done.stdout.split()[-1])
    assert took < 4.0, f"{took:.1f} s from the script's end to the process's exit"


def test_merged_settings_are_safe_from_many_threads(monkeypatch):
    monkeypatch.setattr(settings_mod, "KEEP_MERGED", 1)  # cleared on nearly every call
    sys.setswitchinterval(1e-6)  # threads switch often: the check and the read of an entry part
    monkeypatch.setattr(settings_mod, "_same", lambda a, b: (time.sleep(0.0005), a == vars(b))[1])
    model = _model()
    ids = torch.tensor([[5, 6, 7]])
    errors = []

    def plans(i):
        try:
            for k in range(60):
                p = plan_call(model, (ids,), dict(max_new_tokens=2 + (i * 7 + k) % 11, temperature=0.5 + k % 5 / 10))
                assert isinstance(p, CallPlan)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        thread_results(plans, 8)
    finally:
        sys.setswitchinterval(0.005)
    assert not errors, errors[:1]


def test_a_cache_that_cannot_be_allocated_sends_calls_to_the_one_call_loop_once_decided(monkeypatch, gw_log):
    from graphwrap.decoding.cache.pages import PagedStore

    tries = []

    allocate = PagedStore.allocate  # (the layout of a CPU's cache)

    def no_memory(self, keys, values):
        if self.rows < 64:  # the probe's small store
            return allocate(self, keys, values)
        tries.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 69.8 GiB")

    monkeypatch.setattr(PagedStore, "allocate", no_memory)
    model = _model()
    gm = GraphedModule(model)
    for _ in range(3):
        assert torch.equal(gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, do_sample=False),
                           _alone(model, [5, 6, 7], max_new_tokens=5))
    assert len(tries) == 1, "the allocation was tried again on every call"
    assert "could not be made (OutOfMemoryError" in gm.stats()["decode"]["off"]
    assert "could not be made" in gw_log.text


# ------------------------------------------------------------------ what the log says


def test_the_log_names_graphwrap_once_whoever_set_logging_up():
    body = textwrap.dedent("""
        import torch, transformers, graphwrap
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=101, n_positions=64,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
        gm = graphwrap.GraphedModule(transformers.GPT2LMHeadModel(cfg).eval())
        gm(input_ids=torch.tensor([[1, 2]]))
        gm.generate(torch.tensor([[5, 6]]), max_new_tokens=3)
    """)
    configured = "import logging; logging.basicConfig(format='%(name)s: %(message)s')\n" + body
    for script in (body, configured):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = [ln for ln in r.stderr.splitlines() if "running eagerly" in ln]
        # One GraphedModule, its forward and its decode batch's engines: told once.
        assert lines == ["graphwrap: running eagerly: CUDA is not available"], r.stderr[-2000:]
        assert "graphwrap: graphwrap:" not in r.stderr


def test_a_call_the_batch_declines_says_why_in_stats(gw_log):
    model = _model()
    gm = GraphedModule(model)
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=5, no_repeat_ngram_size=2, do_sample=False)
    (how,) = gm.stats()["generate"]
    assert "no_repeat_ngram_size=2" in how, how


def test_under_inference_mode_a_bad_request_beside_good_ones_fails_alone():
    model = _model(positions=64)
    gm = GraphedModule(model)
    prompts = [[5, 6, 7], [9, 3], [4, 4, 8]]

    def call(i):
        with torch.inference_mode():
            if i == 1:
                try:
                    return gm.generate(torch.tensor([prompts[i]]), max_new_tokens=90, do_sample=False)
                except GraphwrapError as e:
                    return e
            return gm.generate(torch.tensor([prompts[i]]), max_new_tokens=9, eos_token_id=300, min_new_tokens=4,
                               do_sample=False)

    got = thread_results(call, 3)
    assert isinstance(got[1], GraphwrapError) and "the model has 64 positions" in str(got[1])
    for i in (0, 2):
        assert torch.equal(got[i], _alone(model, prompts[i], max_new_tokens=9, eos_token_id=300, min_new_tokens=4))
