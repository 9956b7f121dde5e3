"""Scenario "quantized": quantized weights (``graphwrap.quantize``) beside fp16, in one process.

One model of ``--model``'s shape (random weights, fp16, seed 0) and a twin of it for each of
``--kinds`` (a deep copy, then ``graphwrap.quantize(..., kind)``: ``fp8``, ``int8`` or ``int4``
weight-only; ``kv8``: the fp16 model with its shared batch's cache in FP8,
``decode={"kv_cache_dtype": "fp8"}``; ``fp8+kv8``: both), each through its own GraphedModule:

- **agreement**, teacher-forced: ``--agree-seqs`` random sequences of ``--agree-len`` tokens
  through both eager models; at each position, whether the twin's argmax is fp16's, or within 0.01
  of the fp16 logits' spread (max - min) of fp16's best; and the logits' relative error. The
  same for a bf16 copy, as the yardstick: random weights give flat logits (their top two a
  small share of the spread apart), so a few percent of noise moves many argmaxes, and the
  8B shape's 32 random layers magnify noise (see :func:`scale_outputs`). With ``kv8``, the twin
  reads each sequence in pieces of :data:`KV8_PIECE` through a cache that keeps keys and values
  as the FP8 pool does (the batch's scales), so every piece after the first attends over what
  the cache read back;
- **batch 1**: one call of ``--prompt`` random tokens and ``--new`` new tokens at a time
  (greedy, no end-of-sequence), a first call apart, then the median of ``--repeats``, as
  milliseconds per new token (after the first call, the shapes it queued for capture beside the
  decode thread are waited for, so that the timed calls share the GPU with no capture;
  ``--no-settle``: not, as before 2026-11-30's FP8-cache runs, whose batch-1 medians moved by
  20-30% between calls);
- **at once**: ``--concurrency`` such calls submitted together, output tokens/s, a first burst
  apart (then its captures waited for likewise), then the median of ``--repeats``.

The ratios are each kind's against fp16's, measured side by side. ``python3 benchmarks/quantized.py
[--model llama3-8b]`` on a GPU of compute capability 8.9 or later; ``--model tiny`` runs on a
CPU (torch's own FP8 product: a smoke run, its times say nothing).
"""

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefix import model_of  # noqa: E402  (the same shapes: tiny, or generate_large's)

import graphwrap  # noqa: E402
from graphwrap import GraphedModule  # noqa: E402

KV8_PIECE = 64  # positions a kv8 twin's teacher-forced forward takes at a time


def agreement(full, twin, vocab: int, seqs: int, length: int, device) -> dict:
    """Teacher-forced: the share of positions where the twin's argmax is fp16's, exactly or within
    0.01 of the fp16 logits' spread (``twin``: a model, or a function of the ids to its logits)."""
    g = torch.Generator().manual_seed(5)
    same = near = total = 0
    err, tops = [], []
    with torch.no_grad():
        for _ in range(seqs):
            ids = torch.randint(3, vocab, (1, length), generator=g).to(device)
            a = full(ids).logits[0].float()
            b = (twin(ids).logits if isinstance(twin, torch.nn.Module) else twin(ids))[0].float()
            best, got = a.argmax(-1), b.argmax(-1)
            spread = a.max(-1).values - a.min(-1).values
            gap = a.max(-1).values - a.gather(-1, got[:, None])[:, 0]
            same += int((best == got).sum())
            near += int((gap <= 0.01 * spread).sum())
            total += length
            err.append(float((b - a).norm() / a.norm()))
            top2 = a.topk(2, dim=-1).values
            tops.append(float(((top2[:, 0] - top2[:, 1]) / spread).median()))
    return {"argmax_same": same / total, "within_0.01_spread": near / total, "positions": total,
            "logits_relative_error": statistics.median(err), "top_two_gap_of_spread": statistics.median(tops)}


def scale_outputs(model):
    """The random weights of each layer's output projections (``o_proj``, ``down_proj``) times
    ``1/sqrt(2 x layers)``, as GPT-2's initialisation scales them (off by default). Tried against
    the Llama-3-8B shape's noise at a normal std of 0.02, where a bf16 copy's logits are 49% of
    their norm from fp16's (argmax the same at 33% of positions): with it, 44% (35%), no
    better. The 1.1B shape is calm either way (4%, 92%)."""
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_((2 * layers) ** -0.5)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def settle(gm, a):
    """The shapes queued for capture beside the decode thread, waited for (``--settle``)."""
    captures = getattr(gm.__dict__.get("_gw_decode"), "captures", None)
    if a.settle and captures is not None and not captures.finish(600):
        print("captures still queued after 600 s: the timed calls share the GPU with them", flush=True)


def calls(gm, prompts, new, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    futs = [gm.submit_generate(p, max_new_tokens=new, do_sample=False) for p in prompts]
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def one(model, label, a, device, decode=None) -> dict:
    if a.cache_memory is not None:  # (the pool's share of the free memory, for each setting alike)
        decode = {**(decode or {}), "cache_memory": a.cache_memory}
    gm = GraphedModule(model, decode=decode)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    single = [torch.randint(3, vocab, (1, a.prompt), generator=g).to(device)]
    many = [torch.randint(3, vocab, (1, a.prompt), generator=g).to(device) for _ in range(a.concurrency)]
    out = {"setting": label}
    first = calls(gm, single, a.new, device)
    off = gm.stats().get("decode", {}).get("off")
    if off is not None:  # (generate's own loop, a call at a time: not what is compared here)
        print(f"{label}: the shared batch does not serve it ({off}); first call {1e3 * first / a.new:.2f} ms a token",
              flush=True)
        gm.close()
        return {**out, "off": off, "batch1_first_ms_per_token": 1e3 * first / a.new}
    settle(gm, a)
    warm = [calls(gm, single, a.new, device) for _ in range(a.repeats)]
    out["batch1_first_ms_per_token"] = 1e3 * first / a.new
    out["batch1_ms_per_token"] = 1e3 * statistics.median(warm) / a.new
    out["batch1_spread"] = [1e3 * min(warm) / a.new, 1e3 * max(warm) / a.new]
    first = calls(gm, many, a.new, device)
    settle(gm, a)
    warm = [calls(gm, many, a.new, device) for _ in range(a.repeats)]
    made = a.concurrency * a.new
    out["at_once_first_tokens_s"] = made / first
    out["at_once_tokens_s"] = made / statistics.median(warm)
    out["at_once_spread"] = [made / max(warm), made / min(warm)]
    d = gm.stats()["decode"]
    out["cache"] = {"rows": d["rows"], "cache_bytes": d["cache_bytes"], "preempted": d["preempted"]}
    print(f"{label}: batch 1 {out['batch1_ms_per_token']:.2f} ms a token ({out['batch1_spread'][0]:.2f}-"
          f"{out['batch1_spread'][1]:.2f}; first call {out['batch1_first_ms_per_token']:.2f}); {a.concurrency} at once "
          f"{out['at_once_tokens_s']:,.0f} tokens/s ({out['at_once_spread'][0]:,.0f}-{out['at_once_spread'][1]:,.0f}; "
          f"first burst {out['at_once_first_tokens_s']:,.0f}); rows {d['rows']}, cache {d['cache_bytes'] / 1e9:.1f} GB, "
          f"preempted {d['preempted']}", flush=True)
    gm.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)  # (the first warm runs meet captures still under way)
    ap.add_argument("--agree-seqs", type=int, default=4)
    ap.add_argument("--agree-len", type=int, default=512)
    ap.add_argument("--scale-outputs", action=argparse.BooleanOptionalAction, default=False,
                    help="scale the random weights of each layer's output projections by 1/sqrt(2 x layers)")
    ap.add_argument("--kinds", default="fp8", help="what graphwrap.quantize makes, each beside fp16: fp8, int8, "
                                                   "int4; kv8 (the cache in FP8), or a kind+kv8")
    ap.add_argument("--settle", action=argparse.BooleanOptionalAction, default=True,
                    help="wait for the shapes queued for capture after each first call before the timed ones")
    ap.add_argument("--cache-memory", type=float, default=None,
                    help="decode={'cache_memory': F} for every setting: a pool too small for every request at once")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    full = model_of(a.model, device)
    if a.scale_outputs:
        scale_outputs(full)
    head = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": str(datetime.date.today()), "args": vars(a)}
    print(head, flush=True)
    agree = {"bf16": _agree(full, "bf16", copy.deepcopy(full).to(torch.bfloat16), a, device)}
    rows, ratio = [one(full, "fp16", a, device)], {}
    for kind in a.kinds.split(","):
        twin, decode = twin_of(full, kind)
        agree[kind] = _agree(full, kind, kv8_logits(twin, a, device) if decode else twin, a, device)
        rows.append(one(twin, kind, a, device, decode))
        del twin
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # (the next batch sizes its pool by the memory free: the last one's back)
        if "off" not in rows[0] and "off" not in rows[-1]:
            ratio[kind] = {"batch1_speedup": rows[0]["batch1_ms_per_token"] / rows[-1]["batch1_ms_per_token"],
                           "at_once_speedup": rows[-1]["at_once_tokens_s"] / rows[0]["at_once_tokens_s"]}
            print(f"{kind} against fp16: batch 1 {ratio[kind]['batch1_speedup']:.2f}x per token, {a.concurrency} "
                  f"at once {ratio[kind]['at_once_speedup']:.2f}x tokens/s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**head, "agreement": agree, "settings": rows, "ratios": ratio}, f, indent=1)


def twin_of(full, kind: str):
    """``(model, decode)``: a copy of ``full`` quantized as ``kind`` says (``full`` itself for
    ``kv8`` alone), and the decode options of its GraphedModule (the cache in FP8 with kv8)."""
    parts = kind.split("+")
    weights = [p for p in parts if p != "kv8"]
    model = graphwrap.quantize(copy.deepcopy(full), weights[0]) if weights else full
    return model, ({"kv_cache_dtype": "fp8"} if "kv8" in parts else None)


def kv8_logits(model, a, device):
    """The logits of ``model`` over ids read in pieces of :data:`KV8_PIECE` through a cache that
    keeps keys and values as the batch's FP8 pool does, with the scales the batch takes."""
    from transformers import DynamicCache

    from graphwrap.decoding.cache import fp8
    from graphwrap.decoding.engine.step import kv_scales
    from graphwrap.loops.decode import cache_keyword

    scales = kv_scales(model, device, fp8.CALIBRATION)

    def logits(ids):
        cache = DynamicCache(config=model.config)
        for layer, s in zip(cache.layers, scales):
            layer.update = _stored(layer.update, s)
        out = []
        with torch.no_grad():
            for i in range(0, ids.shape[1], KV8_PIECE):
                out.append(model(input_ids=ids[:, i:i + KV8_PIECE], use_cache=True,
                                 **{cache_keyword(model): cache}).logits)
        return torch.cat(out, 1)
    return logits


def _stored(update, s):
    from graphwrap.decoding.cache import fp8

    return lambda k, v, *args, **kw: update(fp8.round_trip(k, s.keys), fp8.round_trip(v, s.values), *args, **kw)


def _agree(full, name: str, other, a, device) -> dict:
    got = agreement(full, other, full.config.vocab_size, a.agree_seqs, a.agree_len, device)
    print(f"teacher-forced over {got['positions']} positions: {name}'s argmax is fp16's at "
          f"{100 * got['argmax_same']:.1f}%, within 0.01 of the logits' spread at "
          f"{100 * got['within_0.01_spread']:.1f}%; logits' relative error {got['logits_relative_error']:.4f} "
          f"(fp16's top two {100 * got['top_two_gap_of_spread']:.2f}% of the spread apart)", flush=True)
    return got


if __name__ == "__main__":
    main()
