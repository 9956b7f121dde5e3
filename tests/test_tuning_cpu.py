"""The tuner's choices on the CPU: which bucket next, when a per-size graph is kept, how the
two graphs are timed, and the ``static=`` option."""

import pytest

from graphwrap import GraphwrapError
from graphwrap.capture import tuning
from graphwrap.capture.compiled import compile_options, static_options


def test_the_hottest_bucket_is_the_one_with_most_rows_among_the_hot():
    cands = [(500, 10, "a"), (300, 40, "b"), (900, 15, "c"), (200, 16, "d")]
    assert tuning.hottest(cands, hot_calls=16) == "b"  # "c" has more rows but too few calls
    assert tuning.hottest(cands, hot_calls=10) == "c"
    assert tuning.hottest(cands, hot_calls=41) is None
    assert tuning.hottest([], hot_calls=1) is None


def test_a_per_size_graph_is_kept_only_when_clearly_faster():
    assert tuning.keep_new(100.0, 96.0, gain=0.97)
    assert tuning.keep_new(100.0, 97.0, gain=0.97)
    assert not tuning.keep_new(100.0, 98.0, gain=0.97)
    assert not tuning.keep_new(100.0, 120.0, gain=0.97)


def test_replays_are_timed_interleaved_and_reported_as_medians():
    order, old_calls, new_calls = [], [], []
    cost = {"old": [5.0, 1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0], "new": [4.0, 2.0, 2.0, 7.0, 2.0, 2.0, 2.0, 2.0]}

    def timed(run, k):
        before = len(old_calls)
        run(k)
        name = "old" if len(old_calls) > before else "new"
        order.append(name)
        return cost[name].pop(0)

    o, n = tuning.time_replays(lambda: old_calls.append(1), lambda: new_calls.append(1), timed,
                               rounds=7, round_s=1e-9)
    # A probe of each, then seven rounds that alternate: old, new, old, new...
    assert order == ["old", "new"] * 8
    assert o == 1.0 and n == 2.0  # medians of the seven rounds; the probes and outliers left out
    assert len(old_calls) == len(new_calls) == 8


def test_static_option_defaults_and_errors():
    assert compile_options(True)["static"] == "auto"
    assert compile_options({"static": False})["static"] is False
    assert compile_options({"dynamic": False})["static"] is False
    assert compile_options({"dynamic": True})["static"] is False
    with pytest.raises(GraphwrapError, match='static= must be "auto"'):
        compile_options({"static": "always"})
    with pytest.raises(GraphwrapError, match="tunes the shared kernels"):
        compile_options({"dynamic": False, "static": "auto"})
    per_size = static_options(compile_options({"mode": "max-autotune-no-cudagraphs"}))
    assert per_size["dynamic"] is False and per_size["static"] is False
    assert per_size["mode"] == "max-autotune-no-cudagraphs"


def _engine_with_buckets():
    """A compile=True engine on the CPU holding one key with made-up buckets and call counts."""
    from types import SimpleNamespace

    import torch

    from graphwrap import GraphedModule
    from graphwrap.core.records import Bucket, Key, Serves

    eng = GraphedModule(torch.nn.Linear(4, 4), compile=True).engine
    ks = Key("k", None, ((0, None, 0),), torch.device("cpu"), None, "k")
    eng.store.keys[("k",)] = ks

    def bucket(size, calls, rows, **attrs):
        b = Bucket(size, graphs=[SimpleNamespace(nbytes=lambda: 0)], compiled=True, kernels="shared",
                   serves=Serves.GRAPH)
        for name, value in attrs.items():
            setattr(b, name, value)
        ks.buckets[(size, None)] = b
        ks.plans[(rows, None)] = SimpleNamespace(bucket=b, eager=False, reason=None, calls=calls, n=rows, L=None)
        return b

    buckets = {
        "cold": bucket(2, 3, 2),
        "hot": bucket(8, 40, 7),
        "tuned": bucket(16, 100, 16, tuned=True),
        "per-size": bucket(32, 100, 32, kernels="per-size"),
        "eager": bucket(64, 100, 64, serves=Serves.EAGER),
        "failed": bucket(128, 100, 128, serves=Serves.FAILED, reason="out of memory"),
    }
    return eng, ks, buckets


def test_the_engine_offers_only_untuned_shared_graph_buckets_hottest_first(monkeypatch):
    monkeypatch.setattr(tuning, "HOT_CALLS", 16)
    eng, ks, b = _engine_with_buckets()
    cands = tuning.candidates(eng)
    assert sorted(bk.size for _, _, (_, bk) in cands) == [2, 8]
    assert {bk.size: (rows, calls) for rows, calls, (_, bk) in cands} == {2: (6, 3), 8: (280, 40)}
    assert tuning.hottest(cands)[1] is b["hot"] and tuning.pending(eng)
    monkeypatch.setattr(tuning, "HOT_CALLS", 41)
    assert not tuning.pending(eng)
    tuning.tune_next(eng)
    assert not b["hot"].tuned, "nothing compiled while none is hot"


def test_the_engine_has_nothing_to_tune_once_compile_is_off_or_the_key_failed(monkeypatch):
    monkeypatch.setattr(tuning, "HOT_CALLS", 1)
    eng, ks, b = _engine_with_buckets()
    ks.failed = "the forward cannot be captured"
    assert tuning.candidates(eng) == []
    ks.failed = None
    eng.capturer.compile_off = "Triton is not installed"
    assert not tuning.pending(eng)
    tuning.tune_next(eng)
    assert not any(bk.tuned for name, bk in b.items() if name != "tuned")


def test_per_size_kernels_that_win_are_swapped_in_and_the_compile_cache_saved(monkeypatch):
    """The branch where the per-size graph replays faster: the bucket is swapped, no tuning
    error is recorded and the compile cache is written."""
    from types import SimpleNamespace

    from graphwrap.capture import work as capturing

    monkeypatch.setattr(tuning, "HOT_CALLS", 16)
    eng, ks, b = _engine_with_buckets()
    eng.compile_opts = dict(eng.compile_opts, cache="/nonexistent/cache.bin")
    eng.capturer.static_forward = eng.capturer.compiled = object()  # never compiled here: capture_into is a stand-in
    old = b["hot"]
    old.graphs = [SimpleNamespace(static_inputs=[], nbytes=lambda: 0)]

    def fake_capture(engine, key, bucket, sample, n, L, forward=None, timed=True, **_):
        bucket.graphs = [SimpleNamespace(replay=lambda: None, nbytes=lambda: 0)]
        bucket.compiled, bucket.serves = True, capturing.Serves.GRAPH
        return bucket

    saved = []
    monkeypatch.setattr(tuning, "capture_into", fake_capture)
    monkeypatch.setattr(tuning, "time_replays", lambda *a, **k: (2e-3, 1e-3))  # per-size twice as fast
    monkeypatch.setattr(capturing, "save_cache", saved.append)
    tuning.tune_next(eng)
    assert eng.capturer.tuning_error is None
    new = ks.buckets[(8, None)]
    assert new is not old and new.tuned and new.per_size_us == 1e3 and new.shared_us == 2e3
    assert saved == ["/nonexistent/cache.bin"]
