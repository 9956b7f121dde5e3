"""Gaps between graph replays: ``python benchmarks/diagnostics/replay_gaps.py [--batches N]``.

The seed MLP at two widths, one graph per batch size 1..64 (``buckets="exact"``, plain
forward), replayed in a random order of sizes: back to back, and with a little other work
between replays (a 4-byte copy, a one-element kernel, a stream wait on a finished event, an
event record). Also one graph replayed back to back, and graphwrap's own loops over the same
sizes. Prints microseconds per replay, median of 5 runs after one untimed run, and the range.

Why it exists: a "floor" made of back-to-back replays of different graphs is no floor, if the
device idles between them.
"""

import argparse
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # the repository

import torch  # noqa: E402
from workloads import SeedMLP  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402


def timed(fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts), max(ts)


def _run(hidden, sizes, g):
    dev = "cuda"
    torch.manual_seed(0)
    model = SeedMLP(hidden=hidden).to(dev).eval()
    data = [torch.randn(n, 1024, generator=g).pin_memory() for n in sizes]
    with torch.no_grad():
        gm = GraphedModule(model, buckets="exact", max_batch_size=64)
        for _ in gm.pipeline(data):  # captures every size that occurs
            pass
        (ks,) = gm.engine.store.keys.values()
        graphs = {n: b.replicas[0].graph for n, b in ks.buckets.items()}
        one = graphs[sizes[0]]
        src, dst = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
        cur = torch.cuda.current_stream()
        done, rec = torch.cuda.Event(), torch.cuda.Event()
        done.record(cur)
        rows = {
            "different graphs back to back": lambda: [graphs[n].replay() for n in sizes],
            "different graphs, a 4-byte copy between": lambda: [(dst.copy_(src), graphs[n].replay()) for n in sizes],
            "different graphs, a one-element kernel between": lambda: [(dst.add_(1), graphs[n].replay()) for n in sizes],
            "different graphs, a wait on a finished event between":
                lambda: [(cur.wait_event(done), graphs[n].replay()) for n in sizes],
            "different graphs, an event record between": lambda: [(rec.record(cur), graphs[n].replay()) for n in sizes],
            f"one graph (batch {sizes[0]}) back to back": lambda: [one.replay() for _ in sizes],
            f"one graph (batch {sizes[0]}), a one-element kernel between":
                lambda: [(dst.add_(1), one.replay()) for _ in sizes],
            "gm.pipeline over the same batches": lambda: [None for _ in gm.pipeline(data)],
            "gm(x) over the same batches": lambda: [gm(x) for x in data],
        }
        k = len(sizes)
        for name, fn in rows.items():
            med, lo, hi = timed(fn)
            print(f"hidden {hidden} | {name} | {med * 1e6 / k:.1f} us per replay | {lo * 1e6 / k:.1f}..{hi * 1e6 / k:.1f}",
                  flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=400)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device found: replay gaps need a GPU.")
        return 0
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 65, (a.batches,), generator=g).tolist()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(sizes)} replays, sizes 1..64")
    for hidden in (4096, 1024):
        _run(hidden, sizes, g)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
