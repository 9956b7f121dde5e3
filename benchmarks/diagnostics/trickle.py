"""Requests that reach the shared batch one at a time, as a server's do, against all at once.

A server hands the batch its requests one by one (each parsed and tokenized first), where the
in-process bursts submit all 64 at once. This runs the bench ``generate`` workload (64
requests, prompts 16..128, 32..256 new tokens, greedy, fp16, random weights) on GPT-2 or the
1.1B Llama shape, warm (every shape captured ahead), through the server's own call
(``serve.api.engines.submit``, host token ids, the server's keywords), three bursts each way:

- ``at once``: 64 threads released together;
- ``spaced``: one thread submitting a request every ``--spacing`` ms.

For each: the burst's wall time, time to first token and the gaps between a sequence's
tokens (p50/p99 over every sequence, from its feed), the batch's slowest turns (what each
spent admitting and prefilling, stepping, reading, retiring), and the prefills' host time
(count, total, longest, sequences each).

With ``--profile``, the spaced bursts' admissions (``DecodeServer._admit``) run under cProfile
(on Python 3.12 it sees every thread while on), its top functions printed.

    python3 benchmarks/diagnostics/trickle.py gpt2 [--spacing 1.25] [--profile]
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ".")
import generate as g  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402
from graphwrap.decoding import server as decode_server  # noqa: E402
from graphwrap.decoding.engine.report import Turns  # noqa: E402
from graphwrap.serve.api.engines import submit  # noqa: E402


class Feed:
    def __init__(self, t0):
        self.t0, self.times = t0, []

    def add(self, tokens):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class Prefills:
    """Host time of each ``DecodeServer._prefill`` (the wrapper is installed for the run)."""

    def __init__(self):
        self.took, self.sizes = [], []
        real = decode_server.DecodeServer._prefill

        def timed(server, seqs):
            t = time.perf_counter()
            try:
                return real(server, seqs)
            finally:
                self.took.append(time.perf_counter() - t)
                self.sizes.append(len(seqs))

        decode_server.DecodeServer._prefill = timed

    def report(self) -> str:
        if not self.took:
            return "no prefills"
        return (f"{len(self.took)} prefills, {1e3 * sum(self.took):.1f} ms in all, longest {1e3 * max(self.took):.1f} "
                f"ms, median {1e3 * statistics.median(self.took):.2f} ms, sequences each {statistics.mean(self.sizes):.1f}")


def profile_admissions():
    """``DecodeServer._admit`` under a profiler (``.real`` puts it back)."""
    out = type("Profiled", (), {})()
    out.prof, out.real = cProfile.Profile(), decode_server.DecodeServer._admit

    def profiled(server, seqs):
        out.prof.enable()
        try:
            return out.real(server, seqs)
        finally:
            out.prof.disable()

    decode_server.DecodeServer._admit = profiled
    return out


def run(gm, reqs, kw, spacing):
    feeds = [None] * len(reqs)
    futs = [None] * len(reqs)
    t0 = time.perf_counter()
    if spacing is None:
        start = threading.Barrier(len(reqs) + 1)

        def one(i):
            start.wait()
            feeds[i] = Feed(time.perf_counter())
            futs[i] = submit(gm, reqs[i][0], dict(kw, max_new_tokens=reqs[i][1]), None, feeds[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
    else:
        for i, (ids, k) in enumerate(reqs):
            due = t0 + i * spacing / 1e3
            while time.perf_counter() < due:
                time.sleep(max(0.0, min(due - time.perf_counter(), 0.001)))
            feeds[i] = Feed(time.perf_counter())
            futs[i] = submit(gm, ids, dict(kw, max_new_tokens=k), None, feeds[i])
    for f in futs:
        f.result()
    wall = time.perf_counter() - t0
    ttft = [f.times[0] - f.t0 for f in feeds if f.times]
    gaps = [b - a for f in feeds for a, b in zip(f.times, f.times[1:])]
    return wall, ttft, gaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["gpt2", "llama"])
    ap.add_argument("--spacing", type=float, default=1.25, help="ms between requests in the spaced bursts")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the spaced bursts' admissions")
    a = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          flush=True)
    model = g._model(a.model, dev)
    eos = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    reqs = [(p[0].tolist(), k) for p, k in g.workload(model.config.vocab_size)]
    tokens = sum(k for _, k in reqs)
    kw = {"min_new_tokens": None, "repetition_penalty": 1.0, "eos_token_id": [], "do_sample": False,
          "pad_token_id": eos}
    gm = GraphedModule(model)
    gm.capture_generate()
    run(gm, reqs, kw, None)  # warm
    prefills = Prefills()
    server = gm.__dict__["_gw_decode"]
    for name, spacing in (("at once", None), (f"spaced {a.spacing} ms", a.spacing)):
        server.turns = Turns(10_000)
        prefills.took.clear()
        prefills.sizes.clear()
        walls, ttft, gaps = [], [], []
        for _ in range(a.bursts):
            w, t, gp = run(gm, reqs, kw, spacing)
            walls.append(w)
            ttft += t
            gaps += gp
        if spacing is not None and a.profile:
            prof = profile_admissions()
            run(gm, reqs, kw, spacing)
            decode_server.DecodeServer._admit = prof.real
            pstats.Stats(prof.prof).sort_stats("cumtime").print_stats(30)
        w = statistics.median(walls)
        print(f"[{a.model}] {name}: burst median {w:.3f} s ({min(walls):.3f}-{max(walls):.3f}; {tokens / w:,.0f} "
              f"tokens/s); TTFT p50/p99 {1e3 * g.pct(ttft, .5):.1f}/{1e3 * g.pct(ttft, .99):.1f} ms; gaps p50/p99/max "
              f"{1e3 * g.pct(gaps, .5):.2f}/{1e3 * g.pct(gaps, .99):.2f}/{1e3 * max(gaps):.1f} ms", flush=True)
        print(f"   prefills: {prefills.report()}", flush=True)
        print(f"   slowest turns: {server.turns.slowest()}", flush=True)
    gm.close()


if __name__ == "__main__":
    main()
