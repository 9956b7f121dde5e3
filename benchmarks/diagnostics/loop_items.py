"""Where the host time of one item goes in ``gm.pipeline`` and the ``gm(x)`` loop, beside loops
written by hand, in one process.

``python benchmarks/diagnostics/loop_items.py [--batch-sizes 1,16] [--old DIR]``

The seed MLP (fp32), 1,280 batches in pinned host memory, outputs left on the GPU; µs per item
(the loop's time over 1,280), medians of interleaved rounds with min and max.

1. What single calls cost the host: each of the torch calls a loop is made of, timed alone.
2. Designs written by hand, each keeping more of what graphwrap promises: the two-graph loop
   with no host wait (the floor graphwrap's loops are measured against), with a wait for each
   copy (the caller's pinned memory safe once an item is yielded), with the caller's memory
   copied by the host into pinned buffers of the loop's own (no wait for the device), with a
   clone of the output; and one graph with a copy the host waits for (the seed's loop), with
   its copy from pinned buffers of its own, and through a device staging buffer.
3. graphwrap's loops (and, with ``--old``, an earlier copy importable as ``graphwrap_before``
   from DIR), then each loop once more with its functions timed: µs per item in each.
"""

import argparse
import importlib
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ".")
from workloads import SeedMLP, capture  # noqa: E402

import graphwrap  # noqa: E402

DEV = torch.device("cuda")
ITEMS = 1280


def _median(xs):
    return statistics.median(xs), min(xs), max(xs)


def _show(title, rows):
    print(f"\n{title}")
    width = max(len(k) for k in rows)
    for name, (med, lo, hi) in rows.items():
        print(f"  {name:<{width}}  {med:8.2f}  [{lo:.2f} .. {hi:.2f}]")


def time_loops(loops, rounds=9, per=ITEMS):
    """µs per item of each loop, rounds interleaved; the first run of each apart (not timed)."""
    for f in loops.values():
        f()
    torch.cuda.synchronize()
    times = defaultdict(list)
    for _ in range(rounds):
        for name, f in loops.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e6 / per)
    return {k: _median(v) for k, v in times.items()}


# ---------------------------------------------------------------------------- 1. single calls

def primitives(bs):
    x_pin = torch.randn(bs, 1024).pin_memory()
    x_page = torch.randn(bs, 1024)
    host_dst = torch.empty(bs, 1024).pin_memory()
    dst = torch.empty(bs, 1024, device=DEV)
    src = torch.randn(bs, 1024, device=DEV)
    s = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    lin = torch.nn.Linear(1024, 1024, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        lin(src)
    compute.wait_stream(side)
    with torch.cuda.graph(g):
        lin(src)
    lock = threading.RLock()
    base = torch._C._CudaEventBase
    set_c = torch._C._cuda_setStream

    def n(fn, k=200):
        def run():
            for _ in range(k):
                fn()
        return run

    def with_stream():
        with torch.cuda.stream(s):
            pass

    def set_pair():
        set_c(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        set_c(stream_id=compute.stream_id, device_index=compute.device_index, device_type=compute.device_type)

    def locked():
        with lock:
            pass

    calls = {
        "x.is_pinned() (pinned)": x_pin.is_pinned,
        "x.is_pinned() (pageable)": x_page.is_pinned,
        "x.is_cuda": lambda: x_pin.is_cuda,
        "ev.record(stream)": lambda: ev.record(compute),
        "_CudaEventBase.record(ev, stream)": lambda: base.record(ev, compute),
        "stream.wait_event(ev)": lambda: compute.wait_event(ev),
        "_CudaEventBase.wait(ev, stream)": lambda: base.wait(ev, compute),
        "ev.query() (done)": ev.query,
        "ev.synchronize() (done)": ev.synchronize,
        "with torch.cuda.stream(s)": with_stream,
        "_cuda_setStream there and back": set_pair,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "RLock enter and exit": locked,
        "dst.copy_(pinned, non_blocking=True)": lambda: dst.copy_(x_pin, non_blocking=True),
        "dst.copy_(pinned) (waits)": lambda: dst.copy_(x_pin),
        "dst.copy_(device) (D2D)": lambda: dst.copy_(src),
        "host_dst.copy_(pinned) (host memcpy)": lambda: host_dst.copy_(x_pin),
        "host_dst.copy_(pageable) (host memcpy)": lambda: host_dst.copy_(x_page),
        "src.clone()": src.clone,
        "graph.replay() (one Linear)": g.replay,
    }
    loops = {k: n(f) for k, f in calls.items()}
    return time_loops(loops, rounds=7, per=200)


# ---------------------------------------------------------------------------- 2. designs by hand

def designs(model, data):
    shape = data[0].shape
    pool = torch.cuda.graph_pool_handle()
    statics = [torch.zeros(shape, device=DEV) for _ in range(2)]
    graphs, outs = zip(*(capture(model, st, pool=pool) for st in statics))
    copy = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    copied = [torch.cuda.Event(), torch.cuda.Event()]
    replayed = [torch.cuda.Event(), torch.cuda.Event()]
    stage = [torch.empty(shape).pin_memory() for _ in range(2)]
    staged = [torch.cuda.Event(), torch.cuda.Event()]
    dstage = [torch.empty(shape, device=DEV) for _ in range(2)]

    def two_graphs(wait=False, host_stage=False, clone=False):
        def loop():
            for e in replayed:
                e.record(compute)
            for e in copied:
                e.record(compute)
            for i, x in enumerate(data):
                k = i & 1
                if host_stage:
                    copied[k].synchronize()  # the copy that read stage[k] (two items ago) is over
                    stage[k].copy_(x)
                    x = stage[k]
                copy.wait_event(replayed[k])
                with torch.cuda.stream(copy):
                    statics[k].copy_(x, non_blocking=True)
                    copied[k].record(copy)
                compute.wait_event(copied[k])
                graphs[k].replay()
                replayed[k].record(compute)
                if clone:
                    outs[k].clone()
                if wait:
                    copied[k].synchronize()
        return loop

    st, g = statics[0], graphs[0]

    def seed():
        for x in data:
            st.copy_(x)
            g.replay()

    def one_graph_host_stage():
        for e in staged:
            e.record(compute)
        for i, x in enumerate(data):
            k = i & 1
            staged[k].synchronize()
            stage[k].copy_(x)
            st.copy_(stage[k], non_blocking=True)
            staged[k].record(compute)
            g.replay()

    def one_graph_device_stage():
        for e in staged:
            e.record(compute)
        for i, x in enumerate(data):
            k = i & 1
            copy.wait_event(staged[k])  # dstage[k] read (two items ago) before it is written again
            with torch.cuda.stream(copy):
                dstage[k].copy_(x, non_blocking=True)
                copied[k].record(copy)
            copied[k].synchronize()  # the caller's memory is read
            compute.wait_event(copied[k])
            st.copy_(dstage[k])
            staged[k].record(compute)
            g.replay()

    loops = {
        "two graphs, copy stream, no host wait (the floor)": two_graphs(),
        "  + a wait for each copy (pinned memory handed back)": two_graphs(wait=True),
        "  + host copy into own pinned buffers instead": two_graphs(host_stage=True),
        "  + clone of the output": two_graphs(clone=True),
        "  + wait for each copy + clone": two_graphs(wait=True, clone=True),
        "one graph, blocking copy (the seed's loop)": seed,
        "one graph, host copy into own pinned buffers": one_graph_host_stage,
        "one graph, device staging, wait for the copy": one_graph_device_stage,
    }
    return loops


# ---------------------------------------------------------------------------- 3. graphwrap, timed in parts

class Timed:
    """Wraps functions and methods with wall-clock accumulators; ``undo()`` puts them back."""

    def __init__(self):
        self.ns = defaultdict(int)
        self.count = defaultdict(int)
        self.undos = []

    def wrap(self, owner, attr, name=None):
        name = name or attr
        fn = getattr(owner, attr)
        ns, count = self.ns, self.count
        clock = time.perf_counter_ns

        def timed(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                ns[name] += clock() - t0
                count[name] += 1

        had = attr in vars(owner)
        setattr(owner, attr, timed)
        self.undos.append((owner, attr, fn if had else None))

    def undo(self):
        for owner, attr, fn in reversed(self.undos):
            if fn is None:
                delattr(owner, attr)  # it was inherited (a method of a base, or of the instance's class)
            else:
                setattr(owner, attr, fn)
        self.undos.clear()

    def report(self, title, items, total_us):
        print(f"\n{title}: {total_us:.2f} µs per item with the timers on")
        for name in sorted(self.ns, key=lambda k: -self.ns[k]):
            print(f"  {name:<40} {self.ns[name] / 1e3 / items:8.2f} µs per item  ({self.count[name] / items:.2f} calls)")


def breakdown(gw, model, data, label):
    """Each graphwrap loop once more with its functions timed."""
    pl = importlib.import_module(gw.__name__ + ".loops.pipeline")
    sl = importlib.import_module(gw.__name__ + ".capture.slots")
    pn = importlib.import_module(gw.__name__ + ".core.plans")
    for what in ("pipeline", "gm(x)"):
        gm = gw.GraphedModule(model)
        with torch.no_grad():
            for _ in range(3):
                if what == "pipeline":
                    for _o in gm.pipeline(data):
                        pass
                else:
                    for x in data:
                        gm(x)
            torch.cuda.synchronize()
            t = Timed()
            eng = gm.engine
            if what == "pipeline":
                t.wrap(eng, "facts")
                for f in ("_issue", "_issue_on", "_copy_in", "_stage_pageable", "_finish", "owned", "_current_device"):
                    if hasattr(pl, f):
                        t.wrap(pl, f)
            else:
                t.wrap(eng, "fast_plan")
                t.wrap(pn.Plan, "call1")
                t.wrap(torch.Tensor, "copy_", "Tensor.copy_")
                t.wrap(torch.Tensor, "clone", "Tensor.clone")
            t.wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
            t.wrap(torch.Tensor, "is_pinned", "Tensor.is_pinned")
            t.wrap(sl.OutputRing, "take", "OutputRing.take")
            t.wrap(sl.Slot, "views", "Slot.views")
            t.wrap(sl.Slot, "free", "Slot.free")
            try:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if what == "pipeline":
                    for _o in gm.pipeline(data):
                        pass
                else:
                    for x in data:
                        gm(x)
                torch.cuda.synchronize()
                total = (time.perf_counter() - t0) * 1e6 / len(data)
            finally:
                t.undo()
            t.report(f"{label} {what}", len(data), total)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--old", default=None, help="a folder holding an earlier graphwrap as graphwrap_before/")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    before = None
    if a.old:
        sys.path.insert(0, a.old)
        import graphwrap_before as before
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for bs in [int(b) for b in a.batch_sizes.split(",")]:
        print(f"\n==================== batch {bs}")
        try:
            _show(f"single calls, µs each (batch {bs} where a tensor is copied)", primitives(bs))
        except Exception as e:  # noqa: BLE001 - the other parts still run
            print("single calls failed:", repr(e))
        torch.manual_seed(0)
        model = SeedMLP().to(DEV).eval()
        data = [torch.randn(bs, 1024).pin_memory() for _ in range(ITEMS)]
        with torch.no_grad():
            loops = designs(model, data)
            gm = graphwrap.GraphedModule(model, max_batch_size=256)
            gm_view = graphwrap.GraphedModule(model, max_batch_size=256, outputs="view")
            loops["graphwrap gm(x) loop"] = lambda: [gm(x) for x in data] and None
            loops["graphwrap pipeline"] = lambda: [None for _ in gm.pipeline(data)] and None
            loops["graphwrap pipeline, outputs=view"] = lambda: [None for _ in gm_view.pipeline(data)] and None
            if before is not None:
                gb = before.GraphedModule(model, max_batch_size=256)
                gb_view = before.GraphedModule(model, max_batch_size=256, outputs="view")
                loops["before: gm(x) loop"] = lambda: [gb(x) for x in data] and None
                loops["before: pipeline"] = lambda: [None for _ in gb.pipeline(data)] and None
                loops["before: pipeline, outputs=view"] = lambda: [None for _ in gb_view.pipeline(data)] and None
            _show(f"loops, µs per item (batch {bs}, {ITEMS} items, median of {a.rounds} [min .. max])",
                  time_loops(loops, rounds=a.rounds))
        for gw, label in ((graphwrap, "now"), (before, "before")):
            if gw is not None:
                try:
                    breakdown(gw, model, data, f"{label}, batch {bs}:")
                except Exception as e:  # noqa: BLE001
                    import traceback
                    traceback.print_exc()
                    print("breakdown failed:", repr(e))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
