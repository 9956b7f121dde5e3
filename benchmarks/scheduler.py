"""The shared batch's scheduler against issue 74's targets, on one GPU, in one process.

A model of a served shape (``--model``, default the Llama-3-8B shape of ``generate_large.py``:
fp16, random weights, no end-of-sequence token, greedy), one ``GraphedModule`` with default
settings, and in this order (the first long prompt must be the process's first):

1. **Shorts alone**: 32 requests of 32 prompt tokens and 64 new, at once (``submit_generate``);
   the first run apart, then (once the captures the batch queued ahead have ended, as in a
   process that has served a while) the median of ``--repeats``.
2. **Shorts beside a long prompt**: a 7,900-token prompt (1 new token) sent, then the 32
   shorts at once. The first such run is the process's first long prompt (its shapes
   captured meanwhile); the later ones are warm. Reported: the shorts' time against alone, the
   long prompt's time to first token against its prefill alone (3), and the shorts' longest gap
   between tokens against the median step (streamers on each).
3. **A prompt alone** of 1,000, 4,000 and 7,900 tokens, 1 new token: ``gm.generate`` (the first
   call of each length apart, then the median of ``--repeats``) against eager
   ``model.generate`` (after one untimed call, the median of ``--repeats``).
4. **Bursts**: 256 and 1,024 requests of 128 prompt tokens and 128 new at once (``--bursts``);
   the first apart, then the median of ``--repeats``, output tokens a second.

Every run draws prompts of its own: the batch caches prompts' prefixes, and a prompt sent again
would be served from the cache.

``--log`` prints graphwrap's log (each capture beside the decode thread, with its time). ``--budget 0,2048`` runs parts 2 to 4 under each value of
``graphwrap.decoding.engine.pieces.BUDGET`` in turn (0: off; by default its own value), in this one process; ``--prefill-beside`` likewise sets
``graphwrap.decoding.engine.schedule.PREFILL_BESIDE``, and ``--whole 8192,0`` ``pieces.WHOLE`` (a long prompt that finds the batch empty
in one forward, or in pieces). ``--json PATH`` writes every figure.

``python3 benchmarks/scheduler.py [--model llama3-8b] [--repeats 3]`` from the repository root, on a GPU.
"""

import argparse
import json
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, "benchmarks")
from generate_large import SHAPES, big_model  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402
from graphwrap.decoding.engine import pieces  # noqa: E402
from graphwrap.decoding.engine import schedule as schedule_mod  # noqa: E402

SHORT_IN, SHORT_NEW, SHORTS = 32, 64, 32
# a Llama of a few layers, for a run of every part on a CPU (the test of this script)
SHAPES.setdefault("tiny", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=500, max_position_embeddings=8192))


class Gaps:
    """A streamer that keeps the times its tokens came (the prompt's put first)."""

    def __init__(self):
        self.times: List[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def ids(g, n: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=g).to(device)


def shorts(g, vocab, device) -> List[torch.Tensor]:
    return [ids(g, SHORT_IN, vocab, device) for _ in range(SHORTS)]


def run_shorts(gm, prompts, long_ids=None, long_after=None) -> Dict[str, float]:
    """The shorts at once (after ``long_ids``, where given; or ``long_after`` seconds after the
    shorts, so that it finds their rows decoding): their seconds, and the long prompt's time to
    its one token from when it was sent; the shorts' gaps between tokens."""
    t0 = time.perf_counter()
    submit_long = lambda: gm.submit_generate(input_ids=long_ids, max_new_tokens=1, do_sample=False)  # noqa: E731
    long_f = submit_long() if long_ids is not None and long_after is None else None
    clocks = [Gaps() for _ in prompts]
    fs = [gm.submit_generate(input_ids=p, max_new_tokens=SHORT_NEW, do_sample=False, streamer=c)
          for p, c in zip(prompts, clocks)]
    t_long = t0
    if long_ids is not None and long_after is not None:
        time.sleep(long_after)
        t_long = time.perf_counter()
        long_f = submit_long()
    long_s = None
    if long_f is not None:
        long_f.result()
        long_s = time.perf_counter() - t_long
    for f in fs:
        f.result()
    took = time.perf_counter() - t0
    gaps = [b - a for c in clocks for a, b in zip(c.times[2:], c.times[3:])]
    return {"shorts_s": took, "long_ttft_s": long_s, "gap_p50_ms": 1e3 * statistics.median(gaps),
            "gap_max_ms": 1e3 * max(gaps)}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, make, repeats: int):
    """(first, median, min, max) seconds of ``fn(make())``, the first call apart: each call on
    inputs of its own (graphwrap caches prompts' prefixes: a prompt sent again is a cache hit)."""
    def once():
        x = make()
        sync()
        t0 = time.perf_counter()
        fn(x)
        sync()
        return time.perf_counter() - t0
    first = once()
    xs = [once() for _ in range(repeats)]
    return first, statistics.median(xs), min(xs), max(xs)


def burst(gm, prompts, new: int) -> float:
    t0 = time.perf_counter()
    fs = [gm.submit_generate(input_ids=p, max_new_tokens=new, do_sample=False) for p in prompts]
    for f in fs:
        f.result()
    return time.perf_counter() - t0


def part_beside(out, gm, g, vocab, device, alone_s, repeats, long: int, long_after=None):
    runs = []
    for i in range(1 + repeats):
        r = run_shorts(gm, shorts(g, vocab, device), ids(g, long, vocab, device), long_after)
        r["shorts_x_alone"] = r["shorts_s"] / alone_s
        runs.append(r)
        label = "first long prompt" if i == 0 and not out.get("beside") else f"warm run {i}"
        if long_after is not None:
            label += f", sent {long_after:g} s after the shorts"
        print(f"  beside a {long}-token prompt ({label}): shorts {r['shorts_s']:.3f} s ({r['shorts_x_alone']:.2f}x alone), "
              f"long prompt's first token {r['long_ttft_s']:.3f} s, shorts' gaps p50 {r['gap_p50_ms']:.1f} / longest "
              f"{r['gap_max_ms']:.1f} ms", flush=True)
    return runs


def part_alone(gm, model, g, vocab, device, repeats, lengths):
    rows = {}
    for n in lengths:
        make = lambda: ids(g, n, vocab, device)  # noqa: E731
        ours = timed(lambda x: gm.generate(input_ids=x, max_new_tokens=1, do_sample=False), make, repeats)
        eager = timed(lambda x: model.generate(input_ids=x, max_new_tokens=1, do_sample=False), make, repeats)
        rows[n] = {"graphwrap_first_s": ours[0], "graphwrap_s": ours[1], "graphwrap_spread": ours[2:],
                   "eager_s": eager[1], "eager_spread": eager[2:], "x_eager": ours[1] / eager[1]}
        print(f"  a {n}-token prompt alone: graphwrap {ours[1]:.3f} s ({ours[2]:.3f}-{ours[3]:.3f}; first call "
              f"{ours[0]:.3f}), eager model.generate {eager[1]:.3f} s ({eager[2]:.3f}-{eager[3]:.3f}): "
              f"{ours[1] / eager[1]:.2f}x eager's time", flush=True)
    return rows


def part_bursts(gm, g, vocab, device, sizes, repeats):
    """Each size's bursts: output tokens/s, and of the warm ones the decode thread's longest turn
    (a turn is a gap in every decoding row's stream) and the time to first token, medians."""
    rows = {}
    server = gm.__dict__["_gw_decode"]
    for n in sizes:
        xs, longest, ttft = [], [], []
        for _ in range(1 + repeats):
            server.turns.seconds.clear()  # (this burst's turns and first tokens alone)
            server.ttft.clear()
            xs.append(burst(gm, [ids(g, 128, vocab, device) for _ in range(n)], 128))
            longest.append(1e3 * max(server.turns.seconds))
            ttft.append(sorted(server.ttft))
        rate = [n * 128 / x for x in xs]
        pct = lambda q: statistics.median(1e3 * t[min(len(t) - 1, int(q * len(t)))] for t in ttft[1:])  # noqa: E731
        rows[n] = {"first_tok_s": rate[0], "tok_s": statistics.median(rate[1:]), "spread": (min(rate[1:]), max(rate[1:])),
                   "longest_turn_ms": statistics.median(longest[1:]), "first_longest_turn_ms": longest[0],
                   "ttft_p50_ms": pct(0.5), "ttft_p99_ms": pct(0.99)}
        print(f"  {n} at once, 128 in and 128 out: {rows[n]['tok_s']:,.0f} output tokens/s "
              f"({rows[n]['spread'][0]:,.0f}-{rows[n]['spread'][1]:,.0f}; first {rate[0]:,.0f}); longest turn "
              f"{rows[n]['longest_turn_ms']:.0f} ms (first burst {longest[0]:.0f}); first token p50 "
              f"{rows[n]['ttft_p50_ms']:.0f} / p99 {rows[n]['ttft_p99_ms']:.0f} ms", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", default=str(pieces.BUDGET or 0), help="pieces.BUDGET values, each in turn (0: off)")
    ap.add_argument("--prefill-beside", default=str(schedule_mod.PREFILL_BESIDE or 0),
                    help="schedule.PREFILL_BESIDE values, each in turn (0: no bound)")
    ap.add_argument("--whole", default=str(pieces.WHOLE), help="pieces.WHOLE values, each in turn (0: a long prompt "
                    "alone goes in pieces too)")
    ap.add_argument("--bursts", default="256,1024")
    ap.add_argument("--long-after", default="", help="part 2 again with the long prompt sent this many seconds "
                    "after the shorts (each value in turn), so that it finds their rows decoding")
    ap.add_argument("--whole-beside", default=str(int(pieces.WHOLE_BESIDE)), help="pieces.WHOLE_BESIDE values, each "
                    "in turn (1: a long prompt within the turn's prompt budget goes in one forward beside decoding rows)")
    ap.add_argument("--skip", default="", help="parts to leave out: beside, alone, bursts")
    ap.add_argument("--long", type=int, default=7900, help="the long prompt's tokens (part 2)")
    ap.add_argument("--alone", default="1000,4000,7900", help="prompt lengths of part 3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-pieces-ahead", action="store_true", help="the batch queues no piece shape ahead (as before "
                    "2026-11-29): the first long prompt's pieces are captured when it comes")
    ap.add_argument("--no-ladder", action="store_true", help="the batch queues no ladder of steps ahead (as before "
                    "2026-11-29): a step not captured yet is served by the largest")
    ap.add_argument("--log", action="store_true", help="graphwrap's log (INFO: each capture beside the decode thread, "
                    "with its time) with seconds since the start")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.log:
        from harness import log_with_times

        log_with_times()
    if a.no_pieces_ahead:
        from graphwrap.decoding.engine import captures

        captures.piece_shapes = lambda server: []
    if a.no_ladder:
        from graphwrap.decoding.engine import captures

        captures.ladder = lambda buckets: []
    device = torch.device(a.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"scheduler: {name}, torch {torch.__version__}, {a.model}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    model = big_model(a.model, device)
    vocab = model.config.vocab_size
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(0)
    out: Dict = {"model": a.model, "device": name, "torch": torch.__version__, "settings": []}
    t0 = time.perf_counter()
    warm = run_shorts(gm, shorts(g, vocab, device))["shorts_s"]
    server = gm.__dict__.get("_gw_decode")
    if server is not None and server.captures is not None:  # (what the batch queued ahead, captured before the runs)
        server.captures.finish(300)
    alone = [run_shorts(gm, shorts(g, vocab, device))["shorts_s"] for _ in range(a.repeats)]
    alone_s = statistics.median(alone)
    out["shorts_alone"] = {"first_s": warm, "s": alone_s, "spread": (min(alone), max(alone))}
    print(f"shorts alone: {alone_s:.3f} s ({min(alone):.3f}-{max(alone):.3f}); the process's first run {warm:.3f} s "
          f"(the batch made {time.perf_counter() - t0:.1f} s before the runs after it)", flush=True)
    skip = set(a.skip.split(","))
    turns = [(b, p, w, x) for b in a.budget.split(",") for p in a.prefill_beside.split(",") for w in a.whole.split(",")
             for x in a.whole_beside.split(",")]
    for budget, beside, whole, whole_beside in ((int(b), int(p), int(w), int(x)) for b, p, w, x in turns):
        pieces.BUDGET = budget or None
        schedule_mod.PREFILL_BESIDE = beside or None
        pieces.WHOLE = whole
        pieces.WHOLE_BESIDE = bool(whole_beside)
        print(f"pieces.BUDGET {pieces.BUDGET}, PREFILL_BESIDE {schedule_mod.PREFILL_BESIDE}, WHOLE {whole}, "
              f"WHOLE_BESIDE {pieces.WHOLE_BESIDE}:", flush=True)
        s: Dict = {"budget": budget, "prefill_beside": beside, "whole": whole, "whole_beside": whole_beside}
        if "beside" not in skip:
            s["beside"] = part_beside(out, gm, g, vocab, device, alone_s, a.repeats, a.long)
            out["beside"] = True
            for after in (float(x) for x in a.long_after.split(",") if x):
                s[f"beside_after_{after:g}"] = part_beside(out, gm, g, vocab, device, alone_s, a.repeats, a.long, after)
        if "alone" not in skip:
            s["alone"] = part_alone(gm, model, g, vocab, device, a.repeats, [int(x) for x in a.alone.split(",")])
        if "bursts" not in skip:
            s["bursts"] = part_bursts(gm, g, vocab, device, [int(x) for x in a.bursts.split(",") if x], a.repeats)
        d = gm.stats()["decode"]
        s["counts"] = {k: d.get(k) for k in ("rows", "steps", "mixed_steps", "prefill_pieces", "budget_pieces",
                                             "whole_prefills", "eager_forwards", "in_a_larger_graph",
                                             "collector_pauses")}
        print(f"  stats: {s['counts']}", flush=True)
        s["slowest_turns"] = d.get("slowest_turns")  # (the decode thread's longest turns so far, by part)
        print(f"  the decode thread's slowest turns so far: {(s['slowest_turns'] or [])[:3]}", flush=True)
        out["settings"].append(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    gm.close()


if __name__ == "__main__":
    main()
