"""Where the shared batch's decode step spends its time, against the memory-bandwidth floor:
GPT-2 or the 1.1B Llama shape (fp16, random weights), the generate workload's warm burst
(tokens/s, the decode thread's turn and its parts), then the 64-row step captured by hand over
``--span`` positions (each row at half of it, as midway through the burst): a bare replay's
time, the bytes it must read (weights, and the live keys and values) over the bandwidth, and the
profiler's kernels of one replay by kind (matrix products, attention, the rest), then the
kernels of a whole warm burst by kind, with the GPU's busy share of the burst's wall time.

``python3 benchmarks/diagnostics/step_profile.py gpt2|llama [--span 512] [--ops] [--compile] [--cards]``
from the repository root, on a GPU (``--ops``: also the torch operators of eager steps, with their
input shapes and device time; ``--compile``: then a GraphedModule with ``compile=True`` in the same
process, its warm bursts once every queued compile has replaced its plain graph, and its warm
burst's kernels by kind beside the default's; ``--cards``: the bare replay with the gated-MLP
kernel's shape of work for this card and with the rule of cards not named, alternating).
"""

import argparse
import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import generate as g  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

DEV = torch.device("cuda")
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12}


def kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")):
        return "matrix products"
    if any(k in n for k in ("attend", "attention", "fmha", "flash", "softmax", "paged_decode")):
        return "attention"
    if "memcpy" in n or "memset" in n:
        return "copies"
    if any(k in n for k in ("norm", "rsqrt")):
        return "norms"
    return "other kernels"


def kernels(prof, per: int = 1):
    """(total µs by kind per ``per``, top 12 kernels by time) from a profile's device events."""
    by_kind, by_name = collections.Counter(), collections.Counter()
    for e in prof.events():
        t = getattr(e, "device_time", 0) or getattr(e, "cuda_time", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind(e.name)] += t / per
            by_name[e.name[:90]] += t / per
    return by_kind, by_name.most_common(12)


def say_kernels(title, by_kind, top, wall_us=None):
    total = sum(by_kind.values())
    busy = f", {total / wall_us:.0%} of {wall_us / 1e3:.2f} ms wall" if wall_us else ""
    print(f"{title}: kernels {total / 1e3:.3f} ms{busy}", flush=True)
    for k, v in by_kind.most_common():
        print(f"    {k:16s} {v / 1e3:8.3f} ms  {v / total:5.1%}", flush=True)
    for name, v in top:
        print(f"      {v / 1e3:8.3f} ms  {name}", flush=True)


def say_ops(gm, rows: int, span: int):
    """The torch operators of eager steps (the capture's own forwards) by device time, with their
    input shapes: which operator each kind of kernel above belongs to (the calls counted over
    the 3 warm-ups and the capture, the device time over the warm-ups)."""
    from torch.profiler import ProfilerActivity, profile

    server = gm.__dict__["_gw_decode"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        g.step_graph(gm, rows, span)
    rows_ = prof.key_averages(group_by_input_shape=True)
    rows_ = sorted(rows_, key=lambda e: -getattr(e, "self_device_time_total", 0))
    print(f"operators of the 3 eager warm-up steps ({server.store.__class__.__name__}), per step:", flush=True)
    for e in rows_[:24]:
        t = getattr(e, "self_device_time_total", 0) / 3
        if t:
            print(f"    {t / 1e3:8.3f} ms  {e.count // 4:4d}x  {e.key:28s} {str(e.input_shapes)[:110]}", flush=True)


def main():
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["gpt2", "llama"])
    ap.add_argument("--span", type=int, default=512)
    ap.add_argument("--ops", action="store_true", help="also the operators of eager steps, with their shapes")
    ap.add_argument("--compile", action="store_true", help="then compile=True's warm bursts and their kernels")
    ap.add_argument("--cards", action="store_true", help="also the bare replay with the gated-MLP kernel's shape "
                    "of work for this card and with the rule of cards not named (mlp.CARDS), alternating")
    a = ap.parse_args()
    name = torch.cuda.get_device_name()
    bw = next((v for k, v in BANDWIDTH.items() if k in name), 3.35e12)
    import graphwrap

    print(f"step_profile {a.model}: {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, graphwrap from "
          f"{os.path.dirname(graphwrap.__file__)}", flush=True)
    model = g._model(a.model, DEV)
    gm = GraphedModule(model)
    reqs = g.workload(model.config.vocab_size)
    tokens = sum(k for _, k in reqs)
    g.burst(gm, reqs, DEV)
    times = [g.burst(gm, reqs, DEV)[0] for _ in range(3)]
    d = gm.stats()["decode"]
    print(f"warm bursts: {tokens / statistics.median(times):,.0f} tokens/s (median of 3, {min(times):.3f}-"
          f"{max(times):.3f} s); turn p50 {d['turn_ms']['p50']:.3f} ms, time per output token p50 "
          f"{d['tpot_ms']['p50']:.3f} ms", flush=True)
    server = gm.__dict__["_gw_decode"]
    parts = {k: round(v, 3) for k, v in server.spent.items()}
    print(f"the decode thread's seconds by part, all bursts: {parts}; steps {d['steps']}", flush=True)
    replay = statistics.median(g.step_graph(gm, 64, a.span))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 64 * (a.span // 2) * server.cache.token_bytes
    floor = (weights + kv) / bw
    print(f"64-row step over {a.span} (rows at {a.span // 2}): bare replay {1e3 * replay:.3f} ms; floor "
          f"{weights / 1e9:.2f} GB weights + {kv / 1e9:.2f} GB keys and values at {bw / 1e12:.2f} TB/s = "
          f"{1e3 * floor:.3f} ms: {floor / replay:.0%} of the roofline; 64 rows / replay = "
          f"{64 / replay:,.0f} tokens/s", flush=True)
    if a.cards:
        from graphwrap.decoding.kernels import mlp

        cards = mlp.CARDS
        for named in (True, False, True, False):
            mlp.CARDS = cards if named else {}
            print(f"gated MLP's shape of work {mlp.shape_of_work(model.config.intermediate_size, DEV)}: bare "
                  f"replay {1e3 * statistics.median(g.step_graph(gm, 64, a.span)):.3f} ms", flush=True)
        mlp.CARDS = cards
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.step_graph(gm, 64, a.span)  # (3 eager warm-ups, then 5 x 50 replays)
    by_kind, top = kernels(prof, per=253)
    say_kernels("one replay (from 253 runs: 3 eager warm-ups, 250 replays)", by_kind, top, 1e6 * replay)
    if a.ops:
        say_ops(gm, 64, a.span)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = g.burst(gm, reqs, DEV)[0]
    by_kind, top = kernels(prof)
    say_kernels(f"a warm burst under the profiler ({t:.3f} s)", by_kind, top, 1e6 * t)
    gm.close()
    if a.compile:
        compiled_bursts(model, reqs, tokens, a.span)


def compiled_bursts(model, reqs, tokens, span: int):
    """compile=True on the same model: the first burst, every queued compile waited for, three
    warm bursts, then one under the profiler (kernels by kind, as the default's above), and the
    64-row step over ``span`` captured by hand from the compiled forward (a bare replay)."""
    from torch.profiler import ProfilerActivity, profile

    gm = GraphedModule(model, compile=True)
    first = g.burst(gm, reqs, DEV)[0]
    t0 = time.perf_counter()
    done = gm.__dict__["_gw_decode"].captures.finish(900)
    d = gm.stats()["decode"]
    marks = [(k["key"][:24], b["compiled"]) for e in d["compiled_engines"].values() for k in e["keys"]
             for b in k["buckets"].values()]
    print(f"compile=True: first burst {first:.3f} s; the queued compiles {'done' if done else 'NOT done'} in "
          f"{time.perf_counter() - t0:.1f} s; compiled shapes {d['captures']['compiled']}; their graphs marked "
          f"compiled: {sum(1 for _, c in marks if c)} of {len(marks)}", flush=True)
    times = [g.burst(gm, reqs, DEV)[0] for _ in range(3)]
    d = gm.stats()["decode"]
    print(f"compile=True warm bursts: {tokens / statistics.median(times):,.0f} tokens/s (median of 3, "
          f"{min(times):.3f}-{max(times):.3f} s); turn p50 {d['turn_ms']['p50']:.3f} ms; in a larger graph "
          f"{d['in_a_larger_graph']}, eager forwards {d['eager_forwards']}", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = g.burst(gm, reqs, DEV)[0]
    by_kind, top = kernels(prof)
    say_kernels(f"compile=True: a warm burst under the profiler ({t:.3f} s)", by_kind, top, 1e6 * t)
    from graphwrap.capture.work import compiled_forward

    engine = gm.__dict__["_gw_decode"].compiled_engines["step"]
    with engine.lock:
        cf = compiled_forward(engine)
    replay = statistics.median(g.step_graph(gm, 64, span, step=cf))  # (Inductor compiles this span first)
    print(f"compile=True: 64-row step over {span} captured by hand, its compiled forward: bare replay "
          f"{1e3 * replay:.3f} ms", flush=True)
    gm.close()


if __name__ == "__main__":
    main()
