"""Where the shared batch's decode step spends its time, against the memory-bandwidth floor:
GPT-2, the 1.1B Llama shape or a 7-8B shape (fp16, random weights), the generate workload's warm
burst (or with ``--burst N``, N requests of 128 tokens in and 128 out at once, as
``concurrency.py``'s; each burst's prompts its own), its tokens/s, the decode thread's turn and its
parts, then the ``--rows``-row step captured by hand over ``--span`` positions (each row at half of
it, as midway through the burst): a bare replay's
time, the bytes it must read (weights but the input embeddings' table, and the live keys and
values) over the bandwidth, and the
profiler's kernels of one replay by kind (matrix products, attention, the rest), then the
kernels of a whole warm burst by kind, with the GPU's busy share of the burst's wall time and
where the GPU idled (gaps between kernels by the kinds either side, the longest ones).

``python3 benchmarks/diagnostics/step_profile.py gpt2|llama|llama3-8b [--span 512] [--rows 64] [--burst N]
[--quantize fp8] [--ops] [--compile] [--cards]``
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
from concurrency import NEW, requests  # noqa: E402
from generate_large import SHAPES, big_model  # noqa: E402

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


def idle(prof, top: int = 8):
    """The GPU's idle time between kernels (and copies) in a profile: in all, in gaps over 50 us by
    the kinds either side, and the ``top`` longest gaps with the kernels either side."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    gaps, end = [], None
    for (s, e, name), before in zip(ks, [None] + ks[:-1]):
        if end is not None and s > end:
            gaps.append((s - end, before[2], name))
        end = e if end is None else max(end, e)
    pairs = collections.Counter()
    for gap, a, b in gaps:
        if gap > 50:
            pairs[f"{kind(a)} -> {kind(b)}"] += gap
    print(f"the GPU idle between kernels: {sum(x for x, _, _ in gaps) / 1e3:.1f} ms in {len(gaps)} gaps; over 50 us: "
          f"{sum(x for x, _, _ in gaps if x > 50) / 1e3:.1f} ms in {sum(1 for x, _, _ in gaps if x > 50)}", flush=True)
    for k, v in pairs.most_common(6):
        print(f"    {v / 1e3:8.1f} ms  {k}", flush=True)
    for gap, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"      {gap / 1e3:7.2f} ms  after {a[:60]}  before {b[:60]}", flush=True)


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


def read_bytes(model) -> int:
    """The bytes of weights a step reads: every parameter and buffer of two dimensions or more
    (quantized weights and their scales), each storage once, but the input embeddings' table,
    of which a step reads only its rows' (unless the output head shares it)."""
    head = model.get_output_embeddings()
    kept = {head.weight.data_ptr()} if head is not None and hasattr(head, "weight") else set()
    table = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Embedding)} - kept
    seen = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.dim() >= 2 and t.data_ptr() not in table:
            seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())
    return sum(seen.values())


def main():
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["gpt2", "llama", *SHAPES])
    ap.add_argument("--span", type=int, default=512)
    ap.add_argument("--rows", type=int, default=64, help="the rows of the step captured by hand")
    ap.add_argument("--burst", type=int, default=0, help="N requests of 128 in and 128 out at once, not the "
                    "generate workload")
    ap.add_argument("--quantize", default=None, help="the model through graphwrap.quantize first (fp8, int8, int4)")
    ap.add_argument("--kv-cache-dtype", default=None, help="the shared batch's cache: auto or fp8")
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
    model = big_model(a.model, DEV) if a.model in SHAPES else g._model(a.model, DEV)
    vocab = model.config.vocab_size
    if a.quantize:
        graphwrap.quantize(model, a.quantize)
    gm = GraphedModule(model, decode={"kv_cache_dtype": a.kv_cache_dtype} if a.kv_cache_dtype else None)
    if a.burst:
        reqs = [(p, NEW) for p in requests(a.burst, vocab)]
    else:
        reqs = g.workload(vocab)
    tokens = sum(k for _, k in reqs)
    first = g.burst(gm, reqs, DEV)[0]
    print(f"first burst {first:.3f} s", flush=True)
    times = [g.burst(gm, g.renewed(reqs, 1 + r, vocab), DEV)[0] for r in range(3)]
    d = gm.stats()["decode"]
    print(f"warm bursts: {tokens / statistics.median(times):,.0f} tokens/s (median of 3, {min(times):.3f}-"
          f"{max(times):.3f} s); turn p50 {d['turn_ms']['p50']:.3f} ms, time per output token p50 "
          f"{d['tpot_ms']['p50']:.3f} ms", flush=True)
    server = gm.__dict__["_gw_decode"]
    parts = {k: round(v, 3) for k, v in server.spent.items()}
    print(f"the decode thread's seconds by part, all bursts: {parts}; steps {d['steps']}", flush=True)
    rows = a.rows
    replay = statistics.median(g.step_graph(gm, rows, a.span))
    weights = read_bytes(model)
    kv = rows * (a.span // 2) * server.cache.token_bytes
    floor = (weights + kv) / bw
    flops = 2 * rows * sum(m.in_features * m.out_features for m in model.modules() if hasattr(m, "in_features"))
    print(f"{rows}-row step over {a.span} (rows at {a.span // 2}): bare replay {1e3 * replay:.3f} ms; floor "
          f"{weights / 1e9:.2f} GB weights + {kv / 1e9:.2f} GB keys and values at {bw / 1e12:.2f} TB/s = "
          f"{1e3 * floor:.3f} ms: {floor / replay:.0%} of the roofline; products {flops / 1e12:.2f} TFLOP: "
          f"{flops / replay / 1e12:.0f} TFLOP/s; {rows} rows / replay = {rows / replay:,.0f} tokens/s", flush=True)
    if a.cards:
        from graphwrap.decoding.kernels import mlp

        cards = mlp.CARDS
        for named in (True, False, True, False):
            mlp.CARDS = cards if named else {}
            print(f"gated MLP's shape of work {mlp.shape_of_work(model.config.intermediate_size, DEV)}: bare "
                  f"replay {1e3 * statistics.median(g.step_graph(gm, rows, a.span)):.3f} ms", flush=True)
        mlp.CARDS = cards
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.step_graph(gm, rows, a.span)  # (3 eager warm-ups, then 5 x 50 replays)
    by_kind, top = kernels(prof, per=253)
    say_kernels("one replay (from 253 runs: 3 eager warm-ups, 250 replays)", by_kind, top, 1e6 * replay)
    if a.ops:
        say_ops(gm, rows, a.span)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = g.burst(gm, g.renewed(reqs, 9, vocab), DEV)[0]
    by_kind, top = kernels(prof)
    say_kernels(f"a warm burst under the profiler ({t:.3f} s)", by_kind, top, 1e6 * t)
    idle(prof)
    gm.close()
    if a.compile:
        compiled_bursts(model, reqs, tokens, a.span, rows)


def compiled_bursts(model, reqs, tokens, span: int, rows: int):
    """compile=True on the same model: the first burst, every queued compile waited for, three
    warm bursts, then one under the profiler (kernels by kind, as the default's above), and the
    ``rows``-row step over ``span`` captured by hand from the compiled forward (a bare replay)."""
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
    vocab = model.config.vocab_size
    times = [g.burst(gm, g.renewed(reqs, 21 + r, vocab), DEV)[0] for r in range(3)]
    d = gm.stats()["decode"]
    print(f"compile=True warm bursts: {tokens / statistics.median(times):,.0f} tokens/s (median of 3, "
          f"{min(times):.3f}-{max(times):.3f} s); turn p50 {d['turn_ms']['p50']:.3f} ms; in a larger graph "
          f"{d['in_a_larger_graph']}, eager forwards {d['eager_forwards']}", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = g.burst(gm, g.renewed(reqs, 29, vocab), DEV)[0]
    by_kind, top = kernels(prof)
    say_kernels(f"compile=True: a warm burst under the profiler ({t:.3f} s)", by_kind, top, 1e6 * t)
    from graphwrap.capture.work import compiled_forward

    engine = gm.__dict__["_gw_decode"].compiled_engines["step"]
    with engine.lock:
        cf = compiled_forward(engine)
    replay = statistics.median(g.step_graph(gm, rows, span, step=cf))  # (Inductor compiles this span first)
    print(f"compile=True: {rows}-row step over {span} captured by hand, its compiled forward: bare replay "
          f"{1e3 * replay:.3f} ms", flush=True)
    gm.close()


if __name__ == "__main__":
    main()
