"""What holds graphwrap's int4 tiles (``weight_only.tiles``) under the memory's bandwidth at a
few rows: the same kernel with the packed weights read in other orders and other steps, at the
Llama-3-8B shape's widths. Each form against ``weight_only.tiles`` at ``tile_shape``'s shape:

- ``plain``: the weights as graphwrap packs them (``[out, in / 2]``): a program's step reads 64
  bytes of each of its outputs' rows, rows ``in / 2`` bytes apart;
- ``blocked``: each program's tile of weights contiguous (``[out / bn, steps, bn, chunk]``),
  the scales likewise, so a step reads one run of ``bn * chunk`` bytes;
- ``chunk`` 64 or 128: one group a step, or two (128 bytes of a row a step);
- ``prefetch``: the next step's bytes loaded before this step's products (the loop's loads kept
  in flight by hand, beside Triton's stages);
- ``serial``: the groups' parts joined by the last program of each tile (a counter a tile), not
  by a second kernel (``sum_parts``).

Each timed over ten calls in a CUDA graph over weight copies past the L2 cache, median of 20,
checked against the unpacked weight's product in fp32.

``python3 benchmarks/diagnostics/int4_layout.py [--rows 1,16,64]`` from the repository root, on
a GPU.
"""

import argparse
import itertools
import time

import torch
import triton
import triton.language as tl
from fp8_products import WIDTHS
from piece_attention import graph_ms
from step_products import _copies

from graphwrap import weight_only
from graphwrap._int4_triton import _nibbles
from graphwrap.quantized import Int4Linear

DEV = torch.device("cuda")
LABELS = ("q, k and v as one", "q or o", "gate and up as one", "down")


@triton.jit
def forms(X, W, S, O, P, C, M, STEPS, PER, sxm, swb, swn, swg, ssb, ssn, ssg, som, sop, BM: tl.constexpr,
          BN: tl.constexpr, CHUNK: tl.constexpr, PREFETCH: tl.constexpr, SERIAL: tl.constexpr):
    """``weight_only.tiles``' product over weights at any strides: a program's tile of outputs
    ``program_id(1)`` (``swb`` apart), an output ``swn``, a step of ``CHUNK`` bytes ``swg``; the
    scales (int32 words) likewise by group."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rl = tl.arange(0, BN)
    rj = tl.arange(0, CHUNK)
    nb = tl.program_id(1)
    first = tl.program_id(2) * PER
    last = tl.minimum(first + PER, STEPS)
    wp = W + nb * swb + rl[:, None] * swn + first * swg + rj[None, :]
    xo = (rj // 64) * 128 + rj % 64
    xp = X + rm[None, :] * sxm + first * (2 * CHUNK) + xo[:, None]
    sp = S + nb * ssb + rl * ssn + first * (CHUNK // 64) * ssg
    rows = rm[None, :] < M
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    b = tl.load(wp)
    for i in range(first, last):
        if PREFETCH:
            ahead = tl.load(wp + swg, mask=i + 1 < last, other=0)
        lo, hi = _nibbles(b)
        pair = tl.load(sp)
        scale = (pair & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        offset = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
        if CHUNK == 128:
            pair2 = tl.load(sp + ssg)
            scale2 = (pair2 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
            offset2 = (pair2 >> 16).to(tl.int16).to(tl.float16, bitcast=True)[:, None]
            scale = tl.where(rj[None, :] < 64, scale, scale2)
            offset = tl.where(rj[None, :] < 64, offset, offset2)
        xl = tl.load(xp, mask=rows, other=0.0)
        xh = tl.load(xp + 64, mask=rows, other=0.0)
        acc = tl.dot(lo * scale + offset, xl, acc)
        acc = tl.dot(hi * scale + offset, xh, acc)
        wp += swg
        xp += 2 * CHUNK
        sp += (CHUNK // 64) * ssg
        if PREFETCH:
            b = ahead
        else:
            b = tl.load(wp, mask=i + 1 < last, other=0)
    rn = nb * BN + rl
    if SERIAL:
        tl.store(P + tl.program_id(2) * sop + rm[None, :] * som + rn[:, None], acc, mask=rows)
        tl.debug_barrier()
        tile = tl.program_id(0) * tl.num_programs(1) + nb
        count = tl.atomic_add(C + tile, 1, sem="acq_rel")
        if count == tl.num_programs(2) - 1:
            total = tl.zeros((BN, BM), dtype=tl.float32)
            for p in range(0, tl.num_programs(2)):
                total += tl.load(P + p * sop + rm[None, :] * som + rn[:, None], mask=rows, other=0.0,
                                 cache_modifier=".cg")
            tl.store(O + rm[None, :] * som + rn[:, None], total.to(O.dtype.element_ty), mask=rows)
            tl.atomic_xchg(C + tile, 0)
    else:
        tl.store(P + tl.program_id(2) * sop + rm[None, :] * som + rn[:, None], acc.to(P.dtype.element_ty),
                 mask=rows)


def blocked(w4, s4, bn, chunk):
    """The packed bytes and the scales (int32 words) with each tile of ``bn`` outputs' steps of
    ``chunk`` bytes contiguous."""
    n, half = w4.shape
    groups = s4.shape[1]
    w = w4.view(n // bn, bn, half // chunk, chunk).permute(0, 2, 1, 3).contiguous()
    s = s4.view(torch.int32).view(n, groups).view(n // bn, bn, groups).permute(0, 2, 1).contiguous()
    return w, s


def run(x, w, s, n, k, shape, layout, chunk, prefetch, serial, counters):
    bm, bn, split, warps, stages = shape
    m = x.shape[0]
    steps = k // 2 // chunk
    per = -(-steps // split)
    split = -(-steps // per)
    out = torch.empty((m, n), dtype=x.dtype, device=DEV)
    parts = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=DEV)
    groups = k // 128
    if layout == "plain":
        sw, ss = (bn * k // 2, k // 2, chunk), (bn * groups, groups, 1)
    else:
        sw, ss = (bn * k // 2, chunk, bn * chunk), (bn * groups, 1, bn)
    serial = serial and split > 1
    forms[(triton.cdiv(m, bm), n // bn, split)](
        x, w, s, out, parts, counters, m, steps, per, x.stride(0), *sw, *ss, n, m * n, BM=bm, BN=bn, CHUNK=chunk,
        PREFETCH=prefetch, SERIAL=serial, num_warps=warps, num_stages=stages)
    if split > 1 and not serial:
        from graphwrap._fp8_triton import sum_parts
        sum_parts[(triton.cdiv(m * n, 1024),)](parts, out, m * n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64")
    a = ap.parse_args()
    print(f"int4_layout: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    g = torch.Generator(device=DEV).manual_seed(2)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    counters = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)
    for rows in [int(r) for r in a.rows.split(",")]:
        for label in LABELS:
            k, n = WIDTHS[label]
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
            w4, s4 = layer.weight_int4, layer.weight_scale
            want = x.float() @ weight_only.unpack(w4, s4).t()
            shape = weight_only.tile_shape(rows, n, k, sms)
            turn = itertools.cycle(_copies([w4, s4]))
            base = graph_ms(lambda: weight_only.tiles(x, *next(turn), shape))
            gb = n * k / 2e9
            print(f"  {rows} rows, {label} [{k}, {n}], {shape}: tiles {1e3 * base:.1f} us ({gb / base:.2f} TB/s)",
                  flush=True)
            found = []
            for layout, chunk in itertools.product(("plain", "blocked"), (64, 128)):
                w, s = (w4, s4.view(torch.int32).view(n, -1)) if layout == "plain" else blocked(w4, s4, shape[1],
                                                                                                 chunk)
                copies = itertools.cycle(_copies([w, s]))
                for prefetch, serial, stages in itertools.product((False, True), (False, True), (2, 3)):
                    form = (*shape[:4], stages)
                    kw = dict(layout=layout, chunk=chunk, prefetch=prefetch, serial=serial, stages=stages)
                    try:
                        got = run(x, w, s, n, k, form, layout, chunk, prefetch, serial, counters)
                        err = ((got.float() - want).abs().max() / want.abs().max()).item()
                        t = graph_ms(lambda: run(x, *next(copies), n, k, form, layout, chunk, prefetch, serial,
                                                 counters))
                    except Exception as e:  # noqa: BLE001 - a form this card cannot run: said
                        print(f"    {kw}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    found.append((t, kw, err))
            for t, kw, err in sorted(found, key=lambda f: f[0])[:6]:
                print(f"    {1e3 * t:7.1f} us ({gb / t:4.2f} TB/s, {base / t:4.2f}x) {kw} largest difference "
                      f"{err:.1e}", flush=True)
            worst = max(f[2] for f in found)
            print(f"    ({len(found)} forms; largest difference of any {worst:.1e}; counters left nonzero: "
                  f"{int((counters != 0).sum())})", flush=True)


if __name__ == "__main__":
    main()
