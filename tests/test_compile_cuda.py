"""compile=True and the bucket policies on a GPU, every output compared with eager."""

import logging
import threading

import pytest
import torch
from helpers import MLP, assert_same, check_bert, eager_answer, num_graphs, small_bert

import graphwrap
from graphwrap import GraphedModule, GraphwrapError
from graphwrap.capture import tuning

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _buckets(gm, key=0):
    return gm.stats()["keys"][key]["buckets"]


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    # No per-size tuning unless a test asks for it: a tuner compiling in the background would
    # meet the dynamo reset below and the next test.
    monkeypatch.setattr(tuning, "HOT_CALLS", 10**9)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _assert_all_compiled(gm):
    for size, b in _buckets(gm).items():
        assert b["captured"] and b["compiled"] is True, (size, b)


def test_compiled_mlp_every_bucket_and_in_between():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8, 16], compile=True)
    for n in list(range(1, 18)) + [5, 1]:
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x), tol=1e-4)
    _assert_all_compiled(gm)
    s = gm.stats()
    assert s["eager_calls"] == {} and s["compile"]["off"] is None
    # One compile for the batch-dynamic buckets (24 above the largest among them), one for the
    # bucket of one row, which the list asks for (dynamo specializes size 1).
    assert s["compile"]["graphs"] == 2 and s["compile"]["compile_s"] > 0
    # After reset() the graphs are captured again from the kernels dynamo already holds.
    gm.reset()
    x = torch.randn(3, 32, device=DEV)
    assert_same(gm(x), eager_answer(model, x), tol=1e-4)
    b = _buckets(gm)[4]
    assert b["compiled"] is True and b["compiled_graphs"] == 0 and gm.stats()["compile"]["graphs"] == 2


def test_host_inputs_reuse_the_kernels_compiled_for_device_inputs(caplog):
    # gm(x) on device tensors, then the same shapes from the host: a second key whose static
    # inputs (on the device) look the same to torch.compile, so its warm-ups compile nothing
    # new and still run the compiled kernels. It must be reported compiled, not warned about.
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 4], compile=True)
    for n in (2, 3):
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x), tol=1e-4)
    with caplog.at_level(logging.INFO, logger="graphwrap"):
        for n in (2, 3, 1):
            x = torch.randn(n, 32)
            assert_same(gm(x), eager_answer(model, x.to(DEV)), tol=1e-4)
        outs = list(gm.pipeline([torch.randn(n, 32).pin_memory() for n in (4, 1, 3)]))
    assert len(outs) == 3 and "NOT compiled" not in caplog.text
    keys = gm.stats()["keys"]
    assert len(keys) == 2 and gm.stats()["compile"]["graphs"] == 1
    host = next(k for k in keys if "cpu" in k["key"])
    assert all(b["compiled"] is True and b["compiled_graphs"] == 0 for b in host["buckets"].values())


def test_more_buckets_than_the_recompile_limit_all_compile():
    import torch._dynamo.config as cfg

    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    model = MLP().to(DEV).eval()
    with cfg.patch({name: 2}):
        gm = GraphedModule(model, buckets="exact", max_batch_size=10, compile={"dynamic": False})
        gm.capture(torch.randn(10, 32, device=DEV))
        assert getattr(cfg, name) == 2
    # Each of the 10 buckets compiled a graph for its own shape in its warm-up: with a limit of
    # 2, plain torch.compile would have run 8 of them uncompiled.
    _assert_all_compiled(gm)
    assert len(_buckets(gm)) == 10 and gm.stats()["compile"]["graphs"] == 10
    for n in range(1, 11):
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x), tol=1e-4)


def test_compiled_resnet18():
    tv = pytest.importorskip("torchvision")
    model = tv.models.resnet18().to(DEV).half().eval()
    gm = GraphedModule(model, buckets=[1, 4], compile=True)
    for n in (1, 3, 4, 2):
        x = torch.randn(n, 3, 64, 64, device=DEV, dtype=torch.half)
        assert_same(gm(x), eager_answer(model, x), tol=3e-2)
    _assert_all_compiled(gm)
    assert gm.stats()["eager_calls"] == {}


def test_compiled_bert_from_config():
    model, cfg = small_bert(pytest.importorskip("transformers"), DEV)
    gm = GraphedModule(model, buckets=[2, 8], compile=True)
    check_bert(gm, model, cfg, (1, 2, 5, 8), DEV)
    _assert_all_compiled(gm)
    assert gm.stats()["eager_calls"] == {}


class _Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y.relu()


def test_failed_compile_captures_the_plain_forward(gw_log):
    model = _Breaks().to(DEV).eval()
    gm = GraphedModule(model, buckets=[4], compile={"fullgraph": True})
    x = torch.randn(3, 16, device=DEV)
    assert_same(gm(x), eager_answer(model, x))
    s = gm.stats()
    assert "compiled forward failed" in s["compile"]["off"]
    assert _buckets(gm)[4]["captured"] and _buckets(gm)[4]["compiled"] is False
    assert s["eager_calls"] == {}
    assert any("compile= given up" in r.message for r in gw_log.records if r.levelno == logging.WARNING)
    with pytest.raises(GraphwrapError, match="compile= given up"):
        GraphedModule(model, buckets=[4], compile={"fullgraph": True}, fallback="raise")(x)


def test_exact_policy_pads_nothing():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets="exact", max_batch_size=8)
    for n in (1, 5, 8, 3, 5, 12):
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
    s = gm.stats()
    # 12 rows, above the largest bucket, get a graph of the grid continued (16)
    assert sorted(_buckets(gm)) == [1, 3, 5, 8, 16] and s["eager_calls"] == {}
    assert s["padded_rows"] == 4


def test_adaptive_policy_counts_then_captures_the_fitted_buckets(gw_log):
    model = MLP().to(DEV).eval()
    sizes = [1, 1, 2, 1, 30, 32, 1, 2, 31, 1]
    gm = GraphedModule(model, buckets=graphwrap.Adaptive(k=2, warmup_calls=len(sizes)))
    for n in sizes:
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
    assert num_graphs(gm) == 0 and sum(gm.stats()["eager_calls"].values()) == len(sizes)
    want = graphwrap.fit_buckets({1: 5, 2: 2, 30: 1, 31: 1, 32: 1}, 2)
    assert gm.buckets == tuple(want) == (2, 32)
    assert any("adaptive buckets [2, 32]" in r.message for r in gw_log.records)
    for n in (1, 2, 17, 32, 40):
        x = torch.randn(n, 32, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
    assert sorted(_buckets(gm)) == [2, 32, 40] and sum(gm.stats()["eager_calls"].values()) == len(sizes)


def test_pool_budget_holds_and_smaller_batches_use_larger_buckets():
    model = MLP(d_in=1024, hidden=4096, d_out=1024).to(DEV).eval()
    x = torch.randn(256, 1024, device=DEV)
    # A budget too large to bind gives each bucket's estimate and real growth of the pool.
    probe = GraphedModule(model, buckets=[8, 64, 256], max_pool_bytes=1 << 40)
    probe.capture(x)
    pb = _buckets(probe)
    assert all(0 < b["pool_bytes"] <= b["pool_estimate"] for b in pb.values() if b["pool_bytes"]), pb
    p256, e64, e8 = pb[256]["pool_bytes"], pb[64]["pool_estimate"], pb[8]["pool_estimate"]
    assert pb[256]["pool_bytes"] > 0 and e8 < e64
    del probe
    torch.cuda.empty_cache()

    budget = p256 + (e8 + e64) // 2  # after 256 (captured first), room for 8 but not for 64
    # Chunks, not the eager forward, for the batch of 300: what goes to which bucket is the point here.
    gm = GraphedModule(model, buckets=[8, 64, 256], max_pool_bytes=budget, eager_if_faster=False)
    gm.capture(x)
    b = _buckets(gm)
    assert b[256]["captured"] and b[8]["captured"]
    assert b[64]["over_budget"] and not b[64]["captured"] and "max_pool_bytes" in b[64]["failed"]
    assert gm.stats()["graph_pool_bytes"] <= budget
    for n in (3, 40, 256, 300):
        xi = torch.randn(n, 1024, device=DEV)
        assert_same(gm(xi), eager_answer(model, xi), tol=1e-4)
    s = gm.stats()
    b = _buckets(gm)
    assert s["eager_calls"] == {} and b[8]["replays"] == 1
    assert b[256]["replays"] == 4  # 40 rows, 256 rows, and 300 = 256 + 44 (44 goes to 256, not 64)
    assert s["graph_pool_bytes"] <= budget

    # Too small for any bucket: eager, with the reason; or an error under fallback="raise".
    tiny = GraphedModule(model, buckets=[8], max_pool_bytes=e8 // 2)
    xi = torch.randn(5, 1024, device=DEV)
    assert_same(tiny(xi), eager_answer(model, xi))
    assert any("max_pool_bytes" in r for r in tiny.stats()["eager_calls"])
    assert tiny.stats()["graph_pool_bytes"] == 0
    strict = GraphedModule(model, buckets=[8], max_pool_bytes=e8 // 2, fallback="raise")
    with pytest.raises(GraphwrapError, match="max_pool_bytes"):
        strict(xi)


def test_one_compile_serves_every_default_bucket():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, max_batch_size=64, compile=True)
    x = torch.randn(5, 32, device=DEV)
    gm.capture(x)
    assert gm.stats()["compile"]["graphs"] == 1, "counted by the backend: one compile for all buckets"
    assert 1 not in _buckets(gm) and _buckets(gm)[2]["captured"]
    _assert_all_compiled(gm)
    for n in list(range(1, 70)) + [1, 2]:
        xi = torch.randn(n, 32, device=DEV)
        assert_same(gm(xi), eager_answer(model, xi), tol=1e-4)
    s = gm.stats()
    assert s["eager_calls"] == {} and s["compile"]["graphs"] == 1


def test_background_start_answers_at_once_and_switches_to_compiled_graphs():
    import threading
    import time

    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, max_batch_size=32, compile=True)
    errors, calls, stop = [], [0], threading.Event()

    def caller():
        g = torch.Generator(device=DEV).manual_seed(1)
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                while not stop.is_set():
                    n = int(torch.randint(1, 40, (1,)))
                    xi = torch.randn(n, 32, device=DEV, generator=g)
                    got = gm(xi)
                    torch.testing.assert_close(got, eager_answer(model, xi), rtol=1e-4, atol=1e-4)
                    calls[0] += 1
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    t0 = time.perf_counter()
    gm.capture(torch.randn(4, 32, device=DEV), background=True)
    first = gm(torch.randn(3, 32, device=DEV))
    first_s = time.perf_counter() - t0
    th = threading.Thread(target=caller)
    th.start()
    assert gm.wait(300)
    time.sleep(0.2)
    stop.set()
    th.join(60)
    s = gm.stats()
    print(f"\nbackground start: first answer after {first_s * 1e3:.1f} ms; {calls[0]} calls during the switch-over; "
          f"{s['compile']['buckets_compiled']} buckets compiled, {s['compile']['graphs']} compile(s)")
    assert first.shape == (3, 16) and not errors, errors[:2]
    assert s["compile"]["background"] == "done" and s["compile"]["background_error"] is None
    assert s["compile"]["graphs"] == 1
    _assert_all_compiled(gm)


def test_saved_compile_cache_loads_in_a_fresh_process(tmp_path):
    import os
    import subprocess
    import sys

    if graphwrap.capture.compiled.cache_unavailable_reason() is not None:
        pytest.skip(graphwrap.capture.compiled.cache_unavailable_reason())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = (
        "import sys, time, torch\n"
        f"sys.path[:0] = [{root!r}, {os.path.join(root, 'tests')!r}]\n"
        "import graphwrap\nfrom helpers import MLP\n"
        "from torch._dynamo.utils import counters\n"
        "torch.manual_seed(0)\n"
        "m = MLP().cuda().eval()\n"
        f"gm = graphwrap.GraphedModule(m, max_batch_size=16, compile={{'cache': {str(tmp_path / 'mlp.bin')!r}}})\n"
        "t0 = time.perf_counter(); gm.capture(torch.randn(3, 32, device='cuda'))\n"
        "s = gm.stats()['compile']\n"
        "print('RESULT', time.perf_counter() - t0, counters['inductor']['fxgraph_cache_hit'], s['graphs'], "
        "s['buckets_compiled'])\n"
    )
    out = []
    for run in ("first", "second"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{run}"))
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
        out.append([float(v) for v in line.split()[1:]])
    (t1, hits1, graphs1, compiled1), (t2, hits2, graphs2, compiled2) = out
    print(f"\ncompile cache: first process {t1:.1f} s ({hits1:.0f} cache hits), second process with the saved "
          f"cache and a fresh Inductor cache dir {t2:.1f} s ({hits2:.0f} cache hits)")
    assert (tmp_path / "mlp.bin").stat().st_size > 0
    assert hits1 == 0 and hits2 >= 1 and graphs2 == graphs1 == 1 and compiled2 == compiled1


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))

    def forward(self, x):
        return self.body(x)


def test_a_hot_bucket_gets_per_size_kernels_kept_only_where_faster(monkeypatch, gw_log):
    monkeypatch.setattr(tuning, "HOT_CALLS", 8)
    torch.manual_seed(0)
    model = _ConvNet().to(DEV).eval()
    gm = GraphedModule(model, compile=True, max_batch_size=8)
    x = torch.randn(4, 3, 32, 32, device=DEV)
    ref = eager_answer(model, x)
    errors, stop = [], threading.Event()

    def caller():  # calls all through the per-size compile, capture, timing and swap
        try:
            while not stop.is_set():
                assert_same(gm(x), ref, tol=1e-3)
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    for _ in range(10):
        assert_same(gm(x), ref, tol=1e-3)
    th = threading.Thread(target=caller)
    th.start()
    try:
        assert gm.wait(timeout=600)
    finally:
        stop.set()
        th.join(60)
    assert not errors, errors[:1]
    s = gm.stats()
    assert s["compile"]["tuning_error"] is None
    assert s["compile"]["per_size_graphs"] == 1  # one compile, for the shape of bucket 4
    b = _buckets(gm)[4]
    assert b["shared_us"] > 0 and b["per_size_us"] > 0
    assert b["kernels"] == ("per-size" if tuning.keep_new(b["shared_us"], b["per_size_us"]) else "shared")
    assert b["compiled"] is True
    for n in (4, 3, 7, 1):
        xn = torch.randn(n, 3, 32, 32, device=DEV)
        assert_same(gm(xn), eager_answer(model, xn), tol=1e-3)
    others = {size: o for size, o in _buckets(gm).items() if size != 4}
    assert others and all(o["shared_us"] is None and o["kernels"] == "shared" for o in others.values())
    assert any("per-size kernels replay in" in r.message for r in gw_log.records)
    print(f"\nper-size tuning, bucket 4: shared {b['shared_us']:.1f} us, per-size {b['per_size_us']:.1f} us, "
          f"kept {b['kernels']}")


def test_tuning_never_touches_outputs_a_caller_holds_and_the_swap_serves(monkeypatch):
    monkeypatch.setattr(tuning, "HOT_CALLS", 4)
    monkeypatch.setattr(tuning, "GAIN", 100.0)  # keep the per-size graph whatever its speed
    torch.manual_seed(0)
    model = _ConvNet().to(DEV).eval()
    gm = GraphedModule(model, compile=True, max_batch_size=8, outputs="view")
    xs = [torch.randn(6, 3, 32, 32, device=DEV) for _ in range(5)]
    for xi in xs[:-1]:
        gm(xi)
    held = gm(xs[-1])  # a view of bucket 8's static outputs: valid until the next call
    ref = eager_answer(model, xs[-1])
    assert gm.wait(timeout=600)
    torch.cuda.synchronize()
    assert_same(held, ref, tol=1e-3)  # the tuner replayed graphs of its own, never this one
    b = _buckets(gm)[8]
    assert b["kernels"] == "per-size" and b["compiled"] is True and b["replays"] == 5
    for n in (6, 8, 5):
        xn = torch.randn(n, 3, 32, 32, device=DEV)
        assert_same(gm(xn).clone(), eager_answer(model, xn), tol=1e-3)
    assert _buckets(gm)[8]["replays"] == 8
    # Pipelines lease more graphs of the bucket: they capture the per-size kernels too.
    outs = list(gm.pipeline([torch.randn(8, 3, 32, 32, device=DEV) for _ in range(3)]))
    assert len(outs) == 3 and gm.stats()["compile"]["per_size_graphs"] == 1


def test_static_false_keeps_the_shared_kernels(monkeypatch):
    monkeypatch.setattr(tuning, "HOT_CALLS", 2)
    model = _ConvNet().to(DEV).eval()
    gm = GraphedModule(model, compile={"static": False}, max_batch_size=8)
    x = torch.randn(4, 3, 32, 32, device=DEV)
    for _ in range(6):
        assert_same(gm(x), eager_answer(model, x), tol=1e-3)
    assert gm.wait(timeout=60)
    s = gm.stats()
    assert s["compile"]["per_size_graphs"] == 0 and _buckets(gm)[4]["kernels"] == "shared"


def test_compiled_sequence_buckets_one_compile_for_the_grid_every_length_eagers_answer():
    tr = pytest.importorskip("transformers")
    model, cfg = small_bert(tr, DEV)
    gm = GraphedModule(model, seq_dim=1, max_batch_size=8, seq_buckets=[16, 32, 64, 128], compile=True)
    ids = torch.randint(1, cfg.vocab_size, (3, 40), device=DEV)
    s = gm.capture(input_ids=ids, attention_mask=torch.ones_like(ids))
    points = [b for b in s["buckets"].values() if b["captured"]]
    assert len(points) >= 12, s["buckets"].keys()
    assert all(b["compiled"] is True for b in points), s["buckets"]
    assert gm.stats()["compile"]["graphs"] == 1, "one compile with batch and length dynamic serves the grid"
    g = torch.Generator(device=DEV).manual_seed(0)
    for L in range(1, 129):
        n = 1 + L % 8
        ids = torch.randint(1, cfg.vocab_size, (n, L), device=DEV, generator=g)
        mask = torch.ones_like(ids)
        if L % 3 == 0:
            mask[:, L - L // 5:] = 0
        got = gm(input_ids=ids, attention_mask=mask)
        want = eager_answer(model, input_ids=ids, attention_mask=mask)
        assert got.last_hidden_state.shape == (n, L, cfg.hidden_size)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=2e-3, atol=2e-3)
    s = gm.stats()
    assert s["eager_calls"] == {} and s["compile"]["graphs"] == 1
    assert s["keys"][0]["lengths"] == "padded"
