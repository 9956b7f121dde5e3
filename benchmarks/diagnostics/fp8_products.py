"""FP8 layers' products by kernel at a decode step's rows and a burst's, the Llama-3-8B shape's
widths: fp16's cuBLAS product (an ``nn.Linear``), ``torch._scaled_mm`` with row-wise scales (with
and without fast accumulation, its output in fp16 where this torch writes it), and graphwrap's
kernel for a few rows (``graphwrap.quantized.few_rows``); the attention's query, key and value
as one product beside the three apart. Each timed over ten calls in a CUDA graph, each call over
the next copy of the weights (enough copies to pass the L2 cache twice, as a step's layers each
read their own), median of 20, with the weights' bytes over the time and the products' rate.

``python3 benchmarks/diagnostics/fp8_products.py [--rows 1,16,64,256] [--tune]`` from the
repository root, on a GPU of compute capability 8.9 or later; ``--tune`` times shapes of work of
graphwrap's kernel (outputs a program takes, the inner dimension's step and parts, warps, stages) at 1 and
16 rows (``graphwrap.quantized.ROWS``), each checked against the product written out in fp32.
"""

import argparse
import itertools
import time

import torch
from piece_attention import graph_ms
from step_products import _copies

from graphwrap.quantized import FAST_ACCUM, FP8, few_rows, rows_to_fp8

DEV = torch.device("cuda")
K, I = 4096, 14336
WIDTHS = {"q, k and v as one": (K, 6144), "q or o": (K, 4096), "k or v": (K, 1024), "gate or up": (K, I),
          "gate and up as one": (K, 2 * I), "down": (I, K)}


def _fp8_weight(g, n, k):
    w = torch.randn(n, k, generator=g, device=DEV) / k ** 0.5
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
    return (w / scale[:, None]).to(FP8), scale[None, :].contiguous()


def _scaled(q, s, w, ws, fast, dtype=torch.float16):
    return torch._scaled_mm(q, w.t(), scale_a=s, scale_b=ws, out_dtype=dtype, use_fast_accum=fast)


def compare(rows: int):
    g = torch.Generator(device=DEV).manual_seed(rows)
    print(f"{rows} rows:", flush=True)
    for label, (k, n) in WIDTHS.items():
        x = torch.randn(rows, k, generator=g, device=DEV).half()
        q, s = rows_to_fp8(x)
        w16 = (torch.randn(n, k, generator=g, device=DEV) / k ** 0.5).half()
        w8, ws = _fp8_weight(g, n, k)
        c16, c8 = itertools.cycle(_copies([w16])), itertools.cycle(_copies([w8, ws]))
        flops = 2 * rows * n * k
        times = {"fp16 cuBLAS": graph_ms(lambda: x @ next(c16)[0].t())}
        for fast in (False, True):
            times[f"_scaled_mm fast={fast}"] = graph_ms(lambda: _scaled(q, s, *next(c8), fast))
        if rows <= 64:
            times["few_rows"] = graph_ms(lambda: few_rows(q, s, *next(c8), torch.float16))
        times["row scaling"] = graph_ms(lambda: rows_to_fp8(x))
        cells = []
        for name, t in times.items():
            b = (n * k * (2 if name.startswith("fp16") else 1)) / 1e9
            cells.append(f"{name} {1e3 * t:7.1f} us ({b / t:4.2f} TB/s, {flops / t / 1e9:5.0f} TFLOP/s)"
                         if name != "row scaling" else f"{name} {1e3 * t:5.1f} us")
        print(f"  {label:18s} [{k}, {n}]: " + "; ".join(cells), flush=True)


def tune():
    g = torch.Generator(device=DEV).manual_seed(0)
    configs = list(itertools.product((16, 32, 64), (128, 256), (1, 4), (4,), (4, 6)))
    for rows in (1, 16):
        for label, (k, n) in WIDTHS.items():
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            q, s = rows_to_fp8(x)
            w8, ws = _fp8_weight(g, n, k)
            want = (q.float() * s) @ (w8.float() * ws.t()).t()
            turn = itertools.cycle(_copies([w8, ws]))
            found = []
            for bn, bk, split, warps, stages in configs:
                kw = dict(bn=bn, bk=bk, split=split, warps=warps, stages=stages)
                try:
                    got = few_rows(q, s, w8, ws, torch.float16, **kw)
                    err = ((got.float() - want).abs().max() / want.abs().max()).item()
                    t = graph_ms(lambda: few_rows(q, s, *next(turn), torch.float16, **kw))
                except Exception as e:  # noqa: BLE001 - a shape of work this card cannot run: said
                    print(f"    {kw}: {type(e).__name__}", flush=True)
                    continue
                found.append((t, kw, err))
            found.sort(key=lambda f: f[0])
            default = graph_ms(lambda: few_rows(q, s, *next(turn), torch.float16))
            print(f"  {rows} rows, {label} [{k}, {n}]: the default {1e3 * default:.1f} us; fastest:", flush=True)
            for t, kw, err in found[:5]:
                print(f"    {1e3 * t:7.1f} us ({n * k / 1e9 / t:4.2f} TB/s) {kw} largest difference {err:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--tune", action="store_true")
    a = ap.parse_args()
    print(f"fp8_products: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
          f"graphwrap's products take fast accumulation: {FAST_ACCUM}", flush=True)
    for rows in map(int, a.rows.split(",")):
        compare(rows)
    if a.tune:
        tune()


if __name__ == "__main__":
    main()
