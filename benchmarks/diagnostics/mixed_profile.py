"""Where a turn goes while a long prompt is served beside decoding rows: a Llama-3-8B shape (fp16,
random weights, every shape captured ahead), 32 requests decoding; under the profiler, 40 turns
of the rows alone, then a 6,000-token prompt's whole run beside them (each of its turns a mixed
step where the batch does so), for each piece width of ``--widths``. For each: the kernels a turn
by kind and the largest by name, and the turn's wall time (the run over its turns).

``python3 benchmarks/diagnostics/mixed_profile.py [--widths 128,64]`` from the repository root,
on a GPU.
"""

import argparse
import os
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
from generate_large import big_model  # noqa: E402
from step_profile import kernels, say_kernels  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

DEV = torch.device("cuda")


def beside(gm, vocab, rows=32, new=4000):
    """``rows`` requests decoding on threads until ``stop`` is set (each asks ``new`` tokens)."""
    g = torch.Generator().manual_seed(3)
    stop = threading.Event()

    class Stop:
        def put(self, value):
            if stop.is_set():
                raise StopIteration  # (the request ends: its streamer raised)

        def end(self):
            pass

    def one(i):
        ids = torch.randint(3, vocab, (1, 16 + 4 * i), generator=g).to(DEV)
        try:
            gm.generate(input_ids=ids, max_new_tokens=new, do_sample=False, streamer=Stop())
        except Exception:  # noqa: BLE001 - ended by its streamer
            pass

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(rows)]
    for t in threads:
        t.start()
    return stop, threads


def idle(prof, top=8):
    """The GPU's idle time between kernels over a profile (its kernels' union against their
    span), and the ``top`` longest gaps with the kernels either side."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and (getattr(e, "device_time", 0) or 0) > 0)
    if not ks:
        return
    gaps, end, last = [], ks[0][1], ks[0][2]
    for a, b, name in ks[1:]:
        if a > end:
            gaps.append((a - end, last, name))
        if b > end:
            end, last = b, name
    span = end - ks[0][0]
    print(f"    the GPU idle {sum(g for g, _, _ in gaps) / 1e3:.3f} ms of {span / 1e3:.3f} ms ({len(ks)} kernels; "
          f"gaps over 20 us: {sum(1 for g, _, _ in gaps if g > 20)}, their total {sum(g for g, _, _ in gaps if g > 20) / 1e3:.3f} ms)",
          flush=True)
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"      {g:8.1f} us  after {a}  before {b}", flush=True)


def main():
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--widths", default="128,64")
    ap.add_argument("--length", type=int, default=6000)
    ap.add_argument("--trace", default="", help="a path prefix: each width's chrome trace, <prefix>-<width>.json")
    a = ap.parse_args()
    print(f"mixed_profile: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
          flush=True)
    model = big_model(a.model, DEV)
    gm = GraphedModule(model)
    gm.generate(input_ids=torch.randint(3, 1000, (1, 20), device=DEV), max_new_tokens=2, do_sample=False)
    server = gm.__dict__["_gw_decode"]
    t0 = time.perf_counter()
    gm.capture_generate()
    print(f"every shape captured ahead in {time.perf_counter() - t0:.1f} s", flush=True)
    prompt = torch.randint(3, model.config.vocab_size, (1, a.length), generator=torch.Generator().manual_seed(7))
    prompt = prompt.to(DEV)
    stop, threads = beside(gm, model.config.vocab_size)
    time.sleep(3.0)  # (every row decoding)
    steps = server.counts["steps"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        while server.counts["steps"] - steps < 40:
            time.sleep(0.001)
        took = time.perf_counter() - t0
        n = server.counts["steps"] - steps
    by_kind, top = kernels(prof, per=n)
    say_kernels(f"the rows alone: one turn of {n} ({server.sched.step_shape(server.sched.live())[0]} rows)",
                by_kind, top, 1e6 * took / n)
    idle(prof)
    for w in (int(x) for x in a.widths.split(",")):
        server.piece = min(w, server.chunk)
        gm.generate(input_ids=prompt, max_new_tokens=1, do_sample=False)  # (a warm-up: its shapes captured)
        mixed, pieces, steps = server.counts["mixed_steps"], server.counts["prefill_pieces"], server.counts["steps"]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            gm.generate(input_ids=prompt, max_new_tokens=1, do_sample=False)
            took = time.perf_counter() - t0
        m, p = server.counts["mixed_steps"] - mixed, server.counts["prefill_pieces"] - pieces
        n = server.counts["steps"] - steps  # (a mixed step counts as a step)
        by_kind, top = kernels(prof, per=max(1, n))
        say_kernels(f"pieces of {w} beside the rows: one turn of {n} ({m} mixed, {p} pieces; the prompt in "
                    f"{took:.3f} s)", by_kind, top, 1e6 * took / max(1, n))
        idle(prof)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50),
              flush=True)
        if a.trace:
            prof.export_chrome_trace(f"{a.trace}-{w}.json")
    stop.set()
    for t in threads:
        t.join(timeout=30)
    gm.close()


if __name__ == "__main__":
    main()
