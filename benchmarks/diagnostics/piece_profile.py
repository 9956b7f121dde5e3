"""A long prompt's pieces alone, on a 7-8B shape (fp16, random weights): one 6,000-token prompt
with no other rows, its pieces replays of their graphs (every shape captured ahead), then the
same prompt in eager pieces of the same width; for each, the prompt's time (median of 3 after a
warm-up), the decode thread's host time a piece, and its 16 tokens against ``model.generate``'s,
with eager's margin between the two tokens where they part (a near tie, or a wrong answer).
Then one run under the profiler: the kernels of one piece by kind, and the host calls that
waited longest.

``python3 benchmarks/diagnostics/piece_profile.py [--model llama3-8b]`` from the repository
root, on a GPU.
"""

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
from generate_large import big_model, parted  # noqa: E402
from step_profile import kernels, say_kernels  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

DEV = torch.device("cuda")
NEW = 16


def timed(gm, server, prompt, runs=3):
    """The prompt's time (median of ``runs`` after one warm-up), host seconds a piece, the output."""
    out = gm.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False)
    times, per = [], []
    for _ in range(runs):
        pieces, host = server.counts["prefill_pieces"], server.spent["prefill"]
        t0 = time.perf_counter()
        out = gm.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False)
        times.append(time.perf_counter() - t0)
        per.append((server.spent["prefill"] - host) / max(1, server.counts["prefill_pieces"] - pieces))
    return times, statistics.median(per), out


def waits(gm, prompt):
    """One run with torch's sync debug mode on: each Python stack that waited, and how often."""
    import collections
    import traceback
    import warnings

    stacks = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        stacks["".join(traceback.format_stack(limit=10)[:-1])] += 1

    old = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            warnings.simplefilter("always")
            gm.generate(input_ids=prompt, max_new_tokens=1, do_sample=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    print(f"calls that waited for the GPU in one run ({sum(stacks.values())}):", flush=True)
    for stack, n in stacks.most_common(4):
        print(f"--- {n} times:\n{stack}", flush=True)


def main():
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--length", type=int, default=6000)
    ap.add_argument("--sync-debug", action="store_true", help="the Python stacks of the calls that wait for the GPU")
    a = ap.parse_args()
    print(f"piece_profile: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
          flush=True)
    model = big_model(a.model, DEV)
    gm = GraphedModule(model, decode={"prefix_caching": False})  # (one prompt, sent again and again: none of it cached)
    gm.generate(input_ids=torch.randint(3, 1000, (1, 20), device=DEV), max_new_tokens=2, do_sample=False)
    gm.capture_generate()
    server = gm.__dict__["_gw_decode"]
    prompt = torch.randint(3, model.config.vocab_size, (1, a.length), generator=torch.Generator().manual_seed(7))
    prompt = prompt.to(DEV)
    with torch.no_grad():
        ref = model.generate(input_ids=prompt, max_new_tokens=NEW, do_sample=False)
    engine, chunk, width = server.piece_engine, server.chunk, server.piece_alone  # (no row decodes beside it)
    for how in ("graphs", "eager"):
        if how == "eager":
            server.piece_engine, server.chunk = None, width  # (eager pieces of the same width)
        times, per, out = timed(gm, server, prompt)
        print(f"{how} pieces of {width}: the prompt in {statistics.median(times):.3f} s ({min(times):.3f}-"
              f"{max(times):.3f}), host {1e3 * per:.2f} ms a piece; tokens: {parted(model, prompt, out, ref)}",
              flush=True)
    server.piece_engine, server.chunk = engine, chunk
    if a.sync_debug:
        waits(gm, prompt)
    pieces = server.counts["prefill_pieces"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        gm.generate(input_ids=prompt, max_new_tokens=1, do_sample=False)
        took = time.perf_counter() - t0
    n = server.counts["prefill_pieces"] - pieces
    by_kind, top = kernels(prof, per=n)
    say_kernels(f"one piece of {n} (graphs; the prompt's whole run, {took:.3f} s, over its pieces)", by_kind, top,
                1e6 * took / n)
    print("host calls by their own time (the whole run):", flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60),
          flush=True)
    gm.close()


if __name__ == "__main__":
    main()
