"""Concurrent default calls of an encoder-decoder: Whisper's base shape (fp16, random weights, 30 s
of audio features a request, 64 new tokens each), ``gm.generate`` with no ``cache_implementation``
from 32 threads at once (the one-call loop: each call's steps replay; calls that wait together
share a turn, graphwrap/decoding/callers/turns.py), the same with ``decode=False`` (each call its own
turn), against ``model.generate`` one request after another (every step eager: what these calls
ran when graphwrap left them to transformers), and ``gm.generate`` one after another; tokens/s of
each (the median of 3 warm rounds; 2 for the eager one), and whether each request's tokens are
``model.generate``'s alone.

``python3 benchmarks/diagnostics/concurrent_seq2seq.py [--requests 32] [--new 64] [--float32]`` from the
repository root, on a GPU.
"""

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from decode import _model, _timed  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

DEV = torch.device("cuda")


def rounds(fn, n: int = 3) -> list:
    """Each round's seconds, shortest first."""
    return _timed(fn, n)[0]


def parted(model, feats, ours, ref):
    """Where ``ours`` first parts from ``ref`` (decoder tokens), and eager's logits there: the
    margin of ``ref``'s token over ours (a near tie where it is within fp16's rounding)."""
    diff = (ours[0] != ref[0]).nonzero()
    if ours.shape != ref.shape and not len(diff):
        return f"lengths {ours.shape[-1]} and {ref.shape[-1]}"
    if not len(diff):
        return "equal"
    i = int(diff[0])
    with torch.no_grad():
        logits = model(input_features=feats, decoder_input_ids=ref[:, :i]).logits[0, -1].float()
        # the same logits as model.generate's own steps made them (its cache, one token a step)
        stepped = model.generate(input_features=feats, do_sample=False, max_new_tokens=i, min_new_tokens=i,
                                 output_scores=True, return_dict_in_generate=True).scores[i - 1][0].float()
        # transformers' own loop over a static cache, every step eager (graphwrap's loop's cache kind)
        static = model.generate(input_features=feats, do_sample=False, max_new_tokens=i + 1, min_new_tokens=i + 1,
                                cache_implementation="static")
    a, b = int(ref[0, i]), int(ours[0, i])
    top2 = logits.topk(2).values
    finite = stepped.isfinite()  # (the steps' scores: -inf where a processor forbade a token)
    spread = (stepped - logits)[finite].abs().max()
    same = "ours" if int(static[0, i]) == b else "model.generate's" if int(static[0, i]) == a else "another"
    return (f"part at token {i}: eager's logit of model.generate's token {logits[a]:.4f}, of ours "
            f"{logits[b]:.4f} (margin {logits[a] - logits[b]:.4f}; eager's top two {top2[0]:.4f}, {top2[1]:.4f}); "
            f"model.generate's own step there: {stepped[a]:.4f} and {stepped[b]:.4f}, and eager's two ways "
            f"differ by up to {spread:.4f} over the vocabulary; model.generate over a static cache (eager) "
            f"makes {same} token there")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--float32", action="store_true", help="the model in float32 (fp16 by default)")
    a = ap.parse_args()
    print(f"concurrent_seq2seq: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    import transformers

    transformers.logging.set_verbosity_error()  # (generate's notes on max_length, once a call)
    model = _model("whisper", DEV)
    dtype = torch.float32 if a.float32 else torch.float16
    model = model.to(dtype)
    print(f"Whisper-base shape in {dtype}", flush=True)
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(1, model.config.num_mel_bins, 3000, generator=g).to(DEV, dtype) for _ in range(a.requests)]
    kw = dict(do_sample=False, max_new_tokens=a.new, min_new_tokens=a.new)  # (random weights can end a row early)
    tokens = a.requests * a.new
    with torch.no_grad():
        want = [model.generate(input_features=f, **kw) for f in feats[:2]]  # (first calls, untimed)
        eager = rounds(lambda: [model.generate(input_features=f, **kw) for f in feats], 2)
        want = [model.generate(input_features=f, **kw) for f in feats]
    gm = GraphedModule(model)
    outs = [None] * a.requests

    def burst(wrapped):
        def one(i):
            outs[i] = wrapped.generate(input_features=feats[i], **kw)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(a.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    first = rounds(lambda: burst(gm), 1)[0]
    warm = rounds(lambda: burst(gm))
    equal = sum(torch.equal(o, w) for o, w in zip(outs, want))
    parts = [f"request {i}: {parted(model, feats[i], o, w)}" for i, (o, w) in enumerate(zip(outs, want))
             if not torch.equal(o, w)]
    alone = rounds(lambda: [gm.generate(input_features=f, **kw) for f in feats])
    apart = GraphedModule(model, decode=False)
    burst(apart)  # (its caches and graphs: at one row)
    turns = rounds(lambda: burst(apart))
    equal_apart = sum(torch.equal(o, w) for o, w in zip(outs, want))
    parts += [f"request {i}, decode=False: {parted(model, feats[i], o, w)}"
              for i, (o, w) in enumerate(zip(outs, want)) if not torch.equal(o, w)]

    def rate(ts):
        return tokens / statistics.median(ts)

    base = rate(eager)
    print(f"{a.requests} requests, {a.new} new tokens each, default calls (no cache_implementation):", flush=True)
    print(f"  model.generate one after another: {base:,.0f} tokens/s (rounds {[round(t, 2) for t in eager]} s)")
    print(f"  gm.generate from {a.requests} threads: first burst {first:.2f} s; warm {rate(warm):,.0f} tokens/s "
          f"(rounds {[round(t, 2) for t in warm]} s), {rate(warm) / base:.1f}x; tokens equal to model.generate's: "
          f"{equal} of {a.requests}")
    print(f"  gm.generate one after another: {rate(alone):,.0f} tokens/s (rounds {[round(t, 2) for t in alone]} s), "
          f"{rate(alone) / base:.1f}x")
    print(f"  gm.generate from {a.requests} threads, decode=False (a turn each): {rate(turns):,.0f} tokens/s "
          f"(rounds {[round(t, 2) for t in turns]} s), {rate(turns) / base:.1f}x; joined turns "
          f"{rate(warm) / rate(turns):.1f}x that; tokens equal: {equal_apart} of {a.requests}")
    for p in parts:
        print(f"  {p}")
    print(f"  stats: {gm.stats().get('generate')}, turns {gm.stats().get('generate_turns')}", flush=True)


if __name__ == "__main__":
    main()
