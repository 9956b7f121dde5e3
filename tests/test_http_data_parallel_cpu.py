"""Several engine processes behind one server (``serve --data-parallel N``), on a CPU: the router
in front of them (a prompt that starts alike goes where its prefix was sent, others to the least
loaded; an engine that ended is passed over, and only all of them ended refuses requests; the
counts each engine's future ends), the arguments refused, the metrics labelled by engine; and
the command itself: two engine processes, every answer greedy generate's, a shared prompt served
from one engine's prefix cache, one engine killed and the other serving on, one SIGTERM ending
all."""

import argparse
import asyncio
import concurrent.futures
import json
import os
import signal
import sys
import time

import pytest
import torch

from graphwrap.errors import GraphwrapError
from graphwrap.serve.api import cli, fronts, loading, routed
from graphwrap.serve.api.engines import EngineGone, ModelInfo, QueueFull
from graphwrap.serve.api.metrics import Metrics


class FakeEngine:
    """An engine's interface, its sequences' futures left for the test to end."""

    def __init__(self, context=128, refuse=None):
        self.info, self.context, self.fronts = ModelInfo([0], None, 100), context, None
        self.dead, self.refuse = None, refuse
        self.queued, self.closed = [], None

    def gone(self):
        return self.dead

    async def queue(self, ids, kwargs, seed, feed):
        if self.dead is not None:
            raise EngineGone(self.dead)
        if self.refuse is not None:
            raise self.refuse
        fut = concurrent.futures.Future()
        self.queued.append((list(ids), fut))
        return fut

    def stats(self):
        return {"decode": {"rows_busy": len([f for _, f in self.queued if not f.done()]), "rows": 8}}

    def close(self, cancel=True, timeout=None):
        self.closed = (cancel, timeout)
        return True


def _queue(r, ids):
    return asyncio.run(r.queue(ids, {}, None, None))


SYSTEM = list(range(1, 49))  # (three full blocks of 16)


def test_a_prompt_that_starts_alike_goes_where_its_prefix_went_and_others_to_the_least_loaded():
    a, b = FakeEngine(), FakeEngine()
    r = routed.Routed([a, b])
    first = _queue(r, SYSTEM + [60, 61])
    (holder, other) = (a, b) if a.queued else (b, a)
    spread = _queue(r, [90 + i for i in range(40)])  # (nothing alike: the least loaded, the other)
    assert len(other.queued) == 1
    same = [_queue(r, SYSTEM + [70 + i]) for i in range(3)]  # (the holder busier, within the slack)
    assert len(holder.queued) == 4 and len(other.queued) == 1
    assert r.stats()["routed"]["by"] == {"prefix": 3, "load": 2}
    assert r.stats()["routed"]["inflight"] == ([4, 1] if holder is a else [1, 4])
    for f in [first, spread] + same:
        f.set_result(None)
    assert r.stats()["routed"]["inflight"] == [0, 0] and sorted(r.stats()["routed"]["sent"]) == [1, 4]


def test_load_routing_takes_the_least_loaded_whatever_the_prompt():
    a, b = FakeEngine(), FakeEngine()
    r = routed.Routed([a, b], "load")
    futures = [_queue(r, SYSTEM + [60 + i]) for i in range(4)]
    assert len(a.queued) == 2 and len(b.queued) == 2
    futures[0].cancel()  # (a cancelled sequence leaves its engine's count too)
    assert sum(r.stats()["routed"]["inflight"]) == 3
    with pytest.raises(ValueError, match="routing"):
        routed.Routed([a, b], "round-robin")


def test_a_sequence_its_engine_refused_goes_to_another_and_is_not_counted_in_flight_there():
    a, b = FakeEngine(refuse=QueueFull("the queue is full")), FakeEngine()
    r = routed.Routed([a, b])
    for _ in range(3):
        _queue(r, SYSTEM)  # (a full queue: the other engine takes it)
    assert len(b.queued) == 3 and r.stats()["routed"]["inflight"] == [0, 3]
    b.refuse = QueueFull("this one too")
    with pytest.raises(QueueFull, match="this one too"):
        _queue(r, SYSTEM)
    assert r.stats()["routed"]["inflight"] == [0, 3]
    # An engine that ended between the pick and its queue fails that sequence (it may have ended its
    # feed already: another engine feeding it again would lose its tokens behind that end).
    a.refuse, b.refuse = EngineGone("the engine process ended (exit code -9)"), None
    with pytest.raises(EngineGone):
        _queue(r, SYSTEM)
    assert len(b.queued) == 3 and r.stats()["routed"]["inflight"] == [0, 3]


def test_an_engine_that_ended_is_passed_over_and_all_ended_refuse_with_why(caplog):
    a, b = FakeEngine(), FakeEngine()
    r = routed.Routed([a, b])
    _queue(r, SYSTEM)
    holder = a if a.queued else b
    holder.dead = "the engine process ended (exit code -9)"
    for i in range(3):
        _queue(r, SYSTEM + [i])  # (its prefix went to the ended one: the other takes it)
    live = b if holder is a else a
    assert len(live.queued) == 3 and len(holder.queued) == 1
    assert r.gone() is None and r.failed() == {[a, b].index(holder): holder.dead}
    assert "the others take its share" in caplog.text
    assert r.stats()["engines"][[a, b].index(holder)] == {}
    live.dead = "the engine process ended (exit code 1)"
    with pytest.raises(EngineGone, match="every engine process ended"):
        _queue(r, [1, 2])
    assert "exit code -9" in r.gone() and "exit code 1" in r.gone()


def test_the_engines_are_closed_together_and_read_as_one():
    a, b = FakeEngine(context=128), FakeEngine(context=96)
    r = routed.Routed([a, b])
    assert r.context == 96 and r.info is a.info and r.fronts is None
    assert r.close(cancel=False, timeout=3) and a.closed == (False, 3) and b.closed == (False, 3)
    a.dead, a.close = "ended", lambda cancel=True, timeout=None: False  # (an ended engine closes at once, False)
    b.closed = None
    for _ in range(20):  # (every engine closed, whichever ends first)
        assert not r.close(cancel=True, timeout=1) and b.closed == (True, 1)
        b.closed = None
    a.fronts, b.fronts = ("addr0", b"k0"), ("addr1", b"k1")
    assert routed.Routed([a, b]).fronts == [a.fronts, b.fronts]


def test_starting_engines_that_fail_closes_those_made_and_raises_the_error():
    made = []

    def make(mine):
        if mine.engine_index == 1:
            raise GraphwrapError("no such device")
        made.append(FakeEngine())
        return made[-1]

    a = cli.parser().parse_args(["m", "--data-parallel", "3", "--device", "cpu"])
    with pytest.raises(GraphwrapError, match="no such device"):
        routed.start(a, make)
    assert len(made) == 2 and all(e.closed is not None for e in made)
    r = routed.start(a, lambda mine: FakeEngine())
    assert len(r.engines) == 3


@pytest.mark.parametrize("device, gpus, env, want", [
    ("cpu", 4, {}, [("cpu", None)] * 2),
    (None, 0, {}, [("cpu", None)] * 2),  # (no GPU here: the CPU, as one engine's default is)
    (None, 2, {}, [("cuda", "0"), ("cuda", "1")]),
    ("cuda", 3, {"CUDA_VISIBLE_DEVICES": "5, 2,7"}, [("cuda", "5"), ("cuda", "2")]),  # (the i-th of those shown)
], ids=["cpu", "default-without-gpus", "default-with-gpus", "gpu-some-shown"])
def test_each_engine_sees_its_own_gpu(device, gpus, env, want):
    a = argparse.Namespace(data_parallel=2, device=device, engine="process")
    args = routed.engine_args(a, gpus, env)
    assert [(m.device, m.cuda_visible) for m in args] == want and [m.engine_index for m in args] == [0, 1]
    assert a.device == device and not hasattr(a, "engine_index")


@pytest.mark.parametrize("device", ["cuda", None], ids=["gpu", "default"])  # (an id "cuda" marks a GPU test)
def test_fewer_gpus_than_engines_is_refused(device):
    with pytest.raises(GraphwrapError, match="--data-parallel 2 puts an engine on each of 2 GPUs: this machine shows 1"):
        routed.engine_args(argparse.Namespace(data_parallel=2, device=device, engine="process"), 1, {})


def test_an_engine_process_sees_only_its_gpu(monkeypatch):
    from graphwrap.serve.api import engine_process

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    engine_process.own_gpu(argparse.Namespace(cuda_visible="2"))
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    engine_process.own_gpu(argparse.Namespace(device="cpu"))  # (one engine, or the CPU: left as it is)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"


def test_an_engine_finds_its_device_or_says_it_is_not_here():
    if torch.cuda.is_available():
        pytest.skip("the CPU case: this machine has a GPU")
    assert loading.device_of(argparse.Namespace(device=None)).type == "cpu"
    with pytest.raises(GraphwrapError, match=r"the device cuda is not here: this process sees 0 CUDA devices "
                                             r"\(engine 1 of --data-parallel sees GPU 1 alone\)"):
        loading.device_of(argparse.Namespace(device="cuda", engine_index=1, cuda_visible="1"))
    with pytest.raises(GraphwrapError, match="the device cuda:1 is not here"):
        loading.device_of(argparse.Namespace(device="cuda:1"))


@pytest.mark.parametrize("argv, words", [
    (["--data-parallel", "0"], "at least 1"),
    (["--data-parallel", "2", "--engine", "thread"], "--engine process"),
    (["--data-parallel", "2", "--device", "cuda:1"], "engine i the i-th GPU"),
])
def test_data_parallel_is_refused_where_it_cannot_run(argv, words, capsys):
    pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[http]"')
    assert cli.main(["some-model"] + argv) == 2
    assert words in capsys.readouterr().err
    assert routed.refused(cli.parser().parse_args(["m", "--data-parallel", "2", "--device", "cpu"])) is None


def test_metrics_label_each_engines_figures_and_name_each_family_once():
    stats = {"engines": [{"decode": {"rows_busy": 3, "rows": 8, "prefix_cache": {"prefix_cache_hits": 32}}},
                         {"decode": {"rows_busy": 1, "rows": 8, "prefix_cache": {"prefix_cache_hits": 0}}}],
             "routed": {"sent": [5, 2], "inflight": [3, 1], "by": {"prefix": 4, "load": 3}}}
    text = Metrics().render(stats, 4)
    lines = text.splitlines()
    assert 'graphwrap_sequences_running{engine="0"} 3' in lines and 'graphwrap_sequences_running{engine="1"} 1' in lines
    assert 'graphwrap_prefix_cache_hits{engine="0"} 32' in lines
    assert 'graphwrap_engine_sequences_total{engine="1"} 2' in lines
    assert 'graphwrap_routed_sequences_total{by="prefix"} 4' in lines
    helps = [line.split()[2] for line in lines if line.startswith("# HELP")]
    assert len(helps) == len(set(helps)), "a family's HELP twice"
    assert [line.split()[3] for line in lines if line.startswith("# TYPE graphwrap_prefix_cache_hits ")] == ["counter"]
    one = Metrics().render(stats["engines"][0], 0).splitlines()  # (one engine: no label, as before)
    assert "graphwrap_sequences_running 3" in one and "graphwrap_prefix_cache_hits 32" in one


# ---------------------------------------------------------------------------- the command itself


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[http]"')
    pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[http]"')
    import tiny_lm

    return tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm")))


def _engines(pid):
    """The server's engine processes (its spawned children, the resource tracker left out)."""
    children = [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    return [c for c in children if b"resource_tracker" not in open(f"/proc/{c}/cmdline", "rb").read()]


def _serve(model_dir, *more):
    """``serve --data-parallel 2`` on the CPU, once ``/health`` answers 200."""
    from helpers import Served

    return Served(model_dir, "--data-parallel", "2", "--device", "cpu", "--rows", "8", "--capture", "lazy",
                  "--log-level", "info", *more)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's children from /proc (Linux)")
def test_two_engine_processes_serve_one_port_route_by_prefix_and_outlive_one_of_them(model_dir):
    import transformers as tr

    srv = _serve(model_dir)
    model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = tr.AutoTokenizer.from_pretrained(model_dir)

    def check(ids, answer=None):
        status, body = answer or srv.complete(ids, 6)
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  pad_token_id=0)
        assert status == 200 and body["choices"][0]["text"] == tok.decode(want[0, len(ids):]), (ids, body)

    try:
        system = [(7 * i) % 300 + 5 for i in range(48)]
        for i in range(4):  # (one after another: every one after the first goes where the first went)
            check(system + [10 + i, 11 + i])
        sent = srv.metric("graphwrap_engine_sequences_total")
        assert sorted(sent.values()) == [0.0, 4.0], sent
        hits = srv.metric("graphwrap_prefix_cache_hits")
        assert max(hits.values()) >= 3 * 48, hits  # (the system prompt from one engine's cache, three times)
        assert srv.metric("graphwrap_routed_sequences_total")['{by="prefix"}'] == 3
        others = [[(13 * i + 3 * j) % 300 + 5 for j in range(20)] for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda ids: srv.complete(ids, 6), others))
        for ids, answer in zip(others, got):
            check(ids, answer)
        sent = srv.metric("graphwrap_engine_sequences_total")
        assert len(sent) == 2 and min(sent.values()) > 0, sent  # (at once: spread over both)
        status, body = srv.complete([5, 10 ** 6], 2)  # (a stranger's bad input: its own 400, the engines serve on)
        assert status == 400 and "vocabulary" in body["error"]["message"], body

        engines = _engines(srv.proc.pid)
        assert len(engines) == 2, engines
        os.kill(engines[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while json.loads(srv.get("/health")[1])["status"] != "degraded":
            assert time.monotonic() < deadline, srv.get("/health")
            time.sleep(0.1)
        status, body = srv.get("/health")
        assert status == 200 and list(json.loads(body)["failed_engines"]) in (["0"], ["1"]), body
        for ids in others[:4]:  # (the engine left serves every new request)
            check(ids)
    finally:
        log = srv.stop()
    assert "over 2 engine processes (prefix routing)" in log
    assert "[engine 0]" in log and "[engine 1]" in log
    assert "the others take its share of new requests" in log, log[-3000:]
    with pytest.raises(OSError):
        srv.get("/health")


@pytest.mark.skipif(fronts.refused(cli.parser().parse_args([".", "--api-servers", "2"])) is not None,
                    reason="--api-servers above 1 needs Linux")
def test_two_http_processes_over_two_engines_each_route_their_own_requests(model_dir):
    import transformers as tr

    srv = _serve(model_dir, "--api-servers", "2")
    try:
        tok = tr.AutoTokenizer.from_pretrained(model_dir)
        model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        prompts = [[(11 * i + 5 * j) % 300 + 5 for j in range(12)] for i in range(24)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda ids: srv.complete(ids, 6), prompts))
        for ids, (status, body) in zip(prompts, got):
            with torch.no_grad():
                want = model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                      pad_token_id=0)
            assert status == 200 and body["choices"][0]["text"] == tok.decode(want[0, len(ids):]), body
        shares = srv.metric("graphwrap_engine_requests_total")  # (by engine and HTTP process)
        assert len(shares) == 4 and sum(shares.values()) == len(prompts) and min(shares.values()) > 0, shares
    finally:
        srv.stop()
