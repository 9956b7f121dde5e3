"""Scratch: FP8 (and int8) products at one row: the committed few_rows (tl.dot) against a
reduction kernel without tensor cores, at many shapes of work."""
import itertools
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks/diagnostics")
from piece_attention import graph_ms
from step_products import _copies

from graphwrap.quantized import FP8, few_rows, rows_to_fp8

DEV = torch.device("cuda")


@triton.jit
def one_row(X, XS, W, WS, O, N, K, swn, sop, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
            HAS_XS: tl.constexpr, EVEN: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    per = tl.cdiv(K, SPLIT * BK) * BK
    start = tl.program_id(1) * per
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for k0 in range(start, tl.minimum(start + per, K), BK):
        kk = k0 + rk
        if EVEN:
            x = tl.load(X + kk)
            w = tl.load(W + rn[:, None] * swn + kk[None, :])
        else:
            x = tl.load(X + kk, mask=kk < K, other=0.0)
            w = tl.load(W + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    s = tl.sum(acc, 1)
    ws = tl.load(WS + rn, mask=rn < N, other=0.0)
    if HAS_XS:
        s = s * tl.load(XS)
    out = s * ws
    if SPLIT == 1:
        tl.store(O + rn, out.to(O.dtype.element_ty), mask=rn < N)
    else:
        tl.store(O + tl.program_id(1) * sop + rn, out, mask=rn < N)


@triton.jit
def sum_parts(P, O, NUMEL, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < NUMEL
    acc = tl.load(P + i, mask=m, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(P + s * NUMEL + i, mask=m, other=0.0)
    tl.store(O + i, acc.to(O.dtype.element_ty), mask=m)


def row(q, s, w, ws, dtype, bn, bk, split, warps, stages=None):
    n, k = w.shape
    out = torch.empty((1, n), dtype=dtype, device=q.device)
    parts = out if split == 1 else torch.empty((split, n), dtype=torch.float32, device=q.device)
    kw = dict(num_warps=warps) if stages is None else dict(num_warps=warps, num_stages=stages)
    one_row[(triton.cdiv(n, bn), split)](q, ws if s is None else s, w.view(torch.int8) if s is None else w, ws, parts,
                                         n, k, w.stride(0), n, BN=bn, BK=bk, SPLIT=split, HAS_XS=s is not None,
                                         EVEN=(n % bn == 0 and k % (split * bk) == 0), **kw)
    if split > 1:
        sum_parts[(triton.cdiv(n, 1024),)](parts, out, n, SPLIT=split, BLOCK=1024, num_warps=4)
    return out


K, I = 4096, 14336
WIDTHS = {"qkv": (K, 6144), "o": (K, 4096), "gateup": (K, 2 * I), "down": (I, K)}


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "fp8"
    g = torch.Generator(device=DEV).manual_seed(0)
    print(f"fp8row {kind}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    mine = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (1, 2, 4), (2, 4, 8)))
    theirs = list(itertools.product((32, 64), (256, 512), (1, 2), (4, 8), (4, 6)))
    for label, (k, n) in WIDTHS.items():
        x = torch.randn(1, k, generator=g, device=DEV).half()
        w = torch.randn(n, k, generator=g, device=DEV) / k ** 0.5
        if kind == "fp8":
            q, s = rows_to_fp8(x)
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
            w8, ws = (w / scale[:, None]).to(FP8), scale[None, :].contiguous()
            want = (q.float() * s) @ (w8.float() * ws.t()).t()
        else:
            q, s = x, None
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            w8, ws = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale.float().contiguous()
            want = x.float() @ (w8.float() * ws[:, None]).t()
        w16 = w.half()
        c16 = itertools.cycle(_copies([w16]))
        turn = itertools.cycle(_copies([w8, ws]))
        base = graph_ms(lambda: x @ next(c16)[0].t())
        dflt = graph_ms(lambda: few_rows(q, s, *next(turn), torch.float16))
        print(f"{label} [{k},{n}]: fp16 cuBLAS {1e3*base:.1f} us; few_rows default {1e3*dflt:.1f} us ({n*k/1e9/dflt:.2f} TB/s)", flush=True)
        found = []
        for bn, bk, split, warps in mine:
            if n % bn or k % (split * bk):
                continue
            f = lambda w_, s_, kw=dict(bn=bn, bk=bk, split=split, warps=warps): row(q, s, w_, s_, torch.float16, **kw)
            try:
                got = f(w8, ws)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                t = graph_ms(lambda: f(*next(turn)))
            except Exception as e:
                print(f"   one_row {bn} {bk} {split} {warps}: {type(e).__name__} {str(e)[:80]}", flush=True)
                continue
            found.append((t, f"one_row bn={bn} bk={bk} split={split} warps={warps}", err))
        for bn, bk, split, warps, stages in theirs:
            kw = dict(bn=bn, bk=bk, split=split, warps=warps, stages=stages)
            try:
                got = few_rows(q, s, w8, ws, torch.float16, **kw)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                t = graph_ms(lambda: few_rows(q, s, *next(turn), torch.float16, **kw))
            except Exception:
                continue
            found.append((t, f"few_rows {kw}", err))
        found.sort(key=lambda f: f[0])
        for t, name, err in found[:10]:
            print(f"   {1e3*t:6.1f} us ({n*k/1e9/t:.2f} TB/s) {name} err {err:.1e}", flush=True)
        best_few = next(f for f in found if f[1].startswith("few_rows"))
        print(f"   best few_rows: {1e3*best_few[0]:.1f} us {best_few[1]}", flush=True)


if __name__ == "__main__":
    main()
