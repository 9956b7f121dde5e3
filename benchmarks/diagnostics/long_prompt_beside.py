"""A long prompt beside decoding rows, by the width of its pieces: a Llama-3-8B shape (fp16,
random weights), one 6,000-token prompt sent while 32 requests decode (the generate-large
scenario), once to warm up, then with pieces of each width in turn (``--widths``: the batch's
``piece`` in the paged pool, its pieces replays of their span bucket's graph; elsewhere its
``chunk``, eager pieces) in this one batch: the long prompt's
time, the others' gaps between tokens (p50, p99, longest), and its 16 tokens against
``model.generate``'s. ``--ahead`` captures every shape first (``gm.capture_generate``); a width other than the
batch's own piece runs once first, not reported, while its graphs are captured; ``--piece 256`` sets
the paged pool's piece for the whole run (its capture blocks sized for it); ``--in-flight
1,2,3`` runs each width with each bound on the pieces queued on the device at once.

``--apart`` runs each width twice: with the piece inside the rows' step forward where the
batch does so (``graphwrap/decoding/engine/steps.py``), then with the two apart (the batch's mixed
engine set aside for the run).

``--prefill-beside 0,512`` runs each width once for each bound on the prompt tokens a turn
admits while rows decode (``graphwrap.decoding.engine.server.PREFILL_BESIDE``; 0: none).

``--trace PREFIX`` runs each under torch's profiler and writes its trace.

``--burst N`` first serves N requests of the generate-large workload at once (prompts 16..1,024,
32..64 new tokens), so that the warm-up run is the first long prompt after serving, as in
generate-large: the step and prompt shapes that workload meets are captured, a long prompt's
are not unless the batch queued them. ``--switch S`` sets Python's switch interval
(``sys.setswitchinterval``) for the whole process. ``--log`` prints graphwrap's log (captures
beside the decode thread, with their times) with seconds since the start.

``python3 benchmarks/diagnostics/long_prompt_beside.py [--widths 128] [--ahead]`` from the
repository root, on a GPU.
"""

import argparse
import itertools
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from generate_large import _long, big_model  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402
from graphwrap.decoding import pieces as graphwrap_pieces  # noqa: E402
from graphwrap.decoding import server as server_mod  # noqa: E402

DEV = torch.device("cuda")
SEEDS = itertools.count()  # each run's prompts its own: a prompt sent again is served from the prefix cache


class _Results:
    def __init__(self):
        self.rows = []

    def add(self, *args, **extra):
        self.rows.append((args, extra))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="128")
    ap.add_argument("--ahead", action="store_true", help="gm.capture_generate() before the runs")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--piece", type=int, default=0, help="the paged pool's piece (graphwrap.decoding.cache.pool.PIECE) for this run")
    ap.add_argument("--in-flight", default="", help="pieces on the device at most, each in turn (e.g. 1,2,3)")
    ap.add_argument("--prefill-beside", default="", help="prompt tokens a turn admits beside decoding rows, each "
                    "in turn (0: no bound; e.g. 0,512)")
    ap.add_argument("--apart", action="store_true", help="each run again with the piece and the step apart")
    ap.add_argument("--trace", default="", help="a path prefix: each run's chrome trace, <prefix>-<run>.json")
    ap.add_argument("--burst", type=int, default=0, help="requests served at once before the warm-up run")
    ap.add_argument("--switch", type=float, default=0.0, help="Python's switch interval, seconds (sys.setswitchinterval)")
    ap.add_argument("--log", action="store_true", help="graphwrap's log, INFO and up, with seconds since the start")
    ap.add_argument("--no-cudnn", action="store_true", help="torch's cuDNN attention turned off for the run")
    a = ap.parse_args()
    if a.switch:
        sys.setswitchinterval(a.switch)
    if a.log:
        from harness import log_with_times

        log_with_times()
    if a.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    print(f"long_prompt_beside: {torch.cuda.get_device_name()}, torch {torch.__version__}, switch interval "
          f"{1e3 * sys.getswitchinterval():.2f} ms, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    if a.piece:
        from graphwrap.decoding.cache import pool

        pool.PIECE = server_mod.PIECE = a.piece
    model = big_model(a.model, DEV)
    gm = GraphedModule(model)
    gm.generate(input_ids=torch.randint(3, 1000, (1, 20), device=DEV), max_new_tokens=2, do_sample=False)
    server = gm.__dict__["_gw_decode"]
    if a.ahead:
        t0 = time.perf_counter()
        gm.capture_generate()
        print(f"every shape captured ahead in {time.perf_counter() - t0:.1f} s", flush=True)
    if a.burst:
        from generate import burst
        from generate_large import workload

        t0 = time.perf_counter()
        burst(gm, workload(model.config.vocab_size, n=a.burst, news=(32, 65)), DEV)
        print(f"{a.burst} requests at once first: {time.perf_counter() - t0:.2f} s; shapes captured: "
              f"{len(server.shapes.counts()['shapes'])}, queued: {server.captures.queued() if server.captures else []}", flush=True)
    results = _Results()
    print(f"warm-up run, pieces of {server.piece} (graphs: {server.piece_engine is not None}):", flush=True)
    _long("warm-up", gm, model, DEV, results, seed=next(SEEDS))
    d = gm.stats()["decode"]
    print(f"  warm-up: forwards since the batch was made, in a larger graph {d['in_a_larger_graph']}, eager "
          f"{d['eager_forwards']}; queued: {server.captures.queued() if server.captures else []}", flush=True)
    first = server.piece
    for w in (int(x) for x in a.widths.split(",")):
        if server.piece_engine is not None:  # (pieces of the paged pool; prompts past the chunk go in pieces)
            server.piece = min(w, server.chunk)
            if server.piece != first:  # (its span buckets' graphs captured first, by a run not reported)
                _long(f"warm-up for pieces of {w}", gm, model, DEV, results, seed=next(SEEDS))
        else:
            server.chunk = w
        runs = [(k, b, apart) for k in ([int(x) for x in a.in_flight.split(",")] if a.in_flight else [None])
                for b in ([int(x) for x in a.prefill_beside.split(",")] if a.prefill_beside else [None])
                for apart in ((False, True) if a.apart else (False,))]
        mixed = server.mixed_engine
        for k, b, apart in runs:
            server.mixed_engine = None if apart else mixed
            if k is not None:
                graphwrap_pieces.IN_FLIGHT = k
            if b is not None:
                server_mod.PREFILL_BESIDE = b or None
            label = (f"pieces of {w}" + (f", {k} on the device at most" if k is not None else "")
                     + (f", prompts beside decoding rows {b or 'unbounded'} tokens a turn" if b is not None else "")
                     + (", the piece and the step apart" if apart else ", the piece inside the step" if mixed else ""))
            mixed_steps = server.counts["mixed_steps"]
            pieces = server.counts["prefill_pieces"]
            if a.trace:  # (the run under the profiler, host and device, its trace written)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    _long(label, gm, model, DEV, results, seed=next(SEEDS))
                prof.export_chrome_trace(f"{a.trace}-{len(results.rows)}.json")
            else:
                _long(label, gm, model, DEV, results, seed=next(SEEDS))
            args, extra = results.rows[-1]
            print(f"  {label}: forwards since the batch was made, in a larger graph {d['in_a_larger_graph']}, eager "
                  f"{d['eager_forwards']}" if (d := gm.stats()["decode"]) else "", flush=True)
            beside = (f"; while it was served p99 {extra['during_p99_ms']:.1f} ms against p50 {extra['apart_p50_ms']:.1f} "
                      f"before and after it ({extra['during_p99_ms'] / extra['apart_p50_ms']:.2f}x)"
                      if extra.get("during_p99_ms") and extra.get("apart_p50_ms") else "")
            print(f"  {label}: {server.counts['prefill_pieces'] - pieces} pieces ({server.counts['mixed_steps'] - mixed_steps}"
                  f" inside a step), the prompt in {args[3][0]:.2f} s, "
                  f"the others' gaps p50 {extra['gap_p50_ms']:.1f} / p99 {extra['gap_p99_ms']:.1f} ms "
                  f"({extra['gap_p99_ms'] / extra['gap_p50_ms']:.2f}x){beside}, tokens equal: {extra['equal']}", flush=True)
    gm.close()


if __name__ == "__main__":
    main()
