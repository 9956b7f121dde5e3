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
16 rows (``graphwrap.quantized.ROWS``), and at one row its CUDA cores' kernel (``one_row``) for FP8
and int8 weights, each checked against the product written out in fp32.

``--split-k``: only ``torch._scaled_mm`` at ``--rows``, as it is, in inner parts, and transposed.
``--fp8-tiles``: only graphwrap's tiles kernel for FP8 layers at ``--rows``, by shape of work.
``--native``: only graphwrap's kernel on the tensor cores' own E4M3 products
(``graphwrap.quantized.fp8_tiles``) at ``fp8_tile_shape``'s shape beside ``torch._scaled_mm`` at
``--rows``, for the Llama-3-8B and 1.1B shapes' widths; with ``--tune``, by shape of work too.
``--int8-tiles``: only the int8 layers' tiles past 16 rows at 64 and 256 rows, by shape of work.
``--weight-only``: the int8 and int4 weight-only layers' products instead (``Int8Linear``,
``Int4Linear``) beside fp16's, the same widths and timing; with ``--tune``, ``int4_product``'s
shapes of work at 1 and 16 rows and its tiles at 64 and 256 rows beside the default (up to 64
rows ``weight_only.tiles``: ``swapped_tiles.py --only int4`` tunes those), each checked against
the unpacked weight's product in fp32.
"""

import argparse
import itertools
import time

import torch
from piece_attention import graph_ms
from step_products import _copies

from graphwrap.quantized import FAST_ACCUM, FP8, few_rows, fp8_tile_shape, fp8_tiles, one_row, rows_to_fp8

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


def _timed(shapes, run, weights, turn, want):
    """Each shape of work in ``shapes`` (``run(*weights, kw)``: the product at that shape), timed
    over the copies in ``turn`` and checked against ``want``: ``(ms, kw, largest relative
    difference)``, fastest first; a shape this card cannot run is said and left out."""
    found = []
    for kw in shapes:
        try:
            got = run(*weights, kw)
            err = ((got.float() - want).abs().max() / want.abs().max()).item()
            t = graph_ms(lambda: run(*next(turn), kw))
        except Exception as e:  # noqa: BLE001 - a shape of work this card cannot run: said
            print(f"    {kw}: {type(e).__name__}", flush=True)
            continue
        found.append((t, kw, err))
    return sorted(found, key=lambda f: f[0])


def _int8_weight(g, n, k):
    w = torch.randn(n, k, generator=g, device=DEV) / k ** 0.5
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale[None, :].contiguous()


def int8_case(g, rows, k, n):
    """``rows`` random fp16 rows of ``k`` inputs, int8 weights for ``n`` outputs and their
    scales, the product written out in fp32, a cycle over the weights' copies, and fp16's cuBLAS
    time for the same product (the weights made fp16)."""
    x = torch.randn(rows, k, generator=g, device=DEV).half()
    w8, ws = _int8_weight(g, n, k)
    want = x.float() @ (w8.float() * ws.t()).t()
    c16 = itertools.cycle(_copies([(w8.float() * ws.t()).half()]))
    return x, (w8, ws), want, itertools.cycle(_copies([w8, ws])), graph_ms(lambda: x @ next(c16)[0].t())


def _product(q, s, w, ws, kw):
    """few_rows' tiles at the shape ``kw``, or its one-row kernel where ``kw`` says ``one_row``."""
    if kw.get("one_row"):
        out = torch.empty((1, w.shape[0]), dtype=torch.float16, device=DEV)
        return one_row(q, s, w, ws, out, kw["bn"], kw["bk"], kw["warps"])
    return few_rows(q, s, w, ws, torch.float16, **kw)


def tune():
    """few_rows' shapes of work at 1 and 16 rows (FP8), and at one row its CUDA cores' kernel
    (one_row) beside them, for FP8 and int8 weights."""
    g = torch.Generator(device=DEV).manual_seed(0)
    tiles = [dict(bn=bn, bk=bk, split=sp, warps=w, stages=st)
             for bn, bk, sp, w, st in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4), (4,), (4, 6))]
    rows_ = [dict(one_row=True, bn=bn, bk=bk, warps=w) for bn, bk, w in itertools.product((4, 8, 16), (512, 1024), (2, 4, 8))]
    for kind, rows in (("fp8", 1), ("int8", 1), ("fp8", 16)):
        for label, (k, n) in WIDTHS.items():
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            if kind == "fp8":
                (q, s), (w8, ws) = rows_to_fp8(x), _fp8_weight(g, n, k)
                want = (q.float() * s) @ (w8.float() * ws.t()).t()
            else:
                q, s, (w8, ws) = x, None, _int8_weight(g, n, k)
                want = x.float() @ (w8.float() * ws.t()).t()
            turn = itertools.cycle(_copies([w8, ws]))
            found = _timed(tiles + (rows_ if rows == 1 else []), lambda w, ws_, kw: _product(q, s, w, ws_, kw),
                           (w8, ws), turn, want)
            default = graph_ms(lambda: few_rows(q, s, *next(turn), torch.float16))
            print(f"  {kind}, {rows} rows, {label} [{k}, {n}]: the default {1e3 * default:.1f} us; fastest:", flush=True)
            for t, kw, err in found[:5]:
                print(f"    {1e3 * t:7.1f} us ({n * k / 1e9 / t:4.2f} TB/s) {kw} largest difference {err:.1e}", flush=True)


def weight_only(rows: int):
    from graphwrap.quantized import Int4Linear, Int8Linear

    g = torch.Generator(device=DEV).manual_seed(rows)
    print(f"{rows} rows, weight-only:", flush=True)
    for label, (k, n) in WIDTHS.items():
        x = torch.randn(rows, k, generator=g, device=DEV).half()
        linear = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16)
        l8, l4 = Int8Linear(linear), Int4Linear(linear)
        c16 = itertools.cycle(_copies([linear.weight.detach()]))
        c8 = itertools.cycle(_copies([l8.weight_int8, l8.weight_scale]))
        c4 = itertools.cycle(_copies([l4.weight_int4, l4.weight_scale]))
        times = {"fp16 cuBLAS": (graph_ms(lambda: x @ next(c16)[0].t()), 2 * n * k),
                 "int8": (graph_ms(lambda: Int8Linear.rows(x, *next(c8))), n * k),
                 "int4": (graph_ms(lambda: Int4Linear.rows(x, *next(c4))), n * k // 2 + l4.weight_scale.numel() * 2)}
        cells = [f"{name} {1e3 * t:7.1f} us ({b / 1e9 / t:4.2f} TB/s)" for name, (t, b) in times.items()]
        print(f"  {label:18s} [{k}, {n}]: " + "; ".join(cells), flush=True)


def tune_int4():
    from graphwrap._compat import multiprocessors
    from graphwrap.quantized import Int4Linear
    from graphwrap.weight_only import product, unpack

    g = torch.Generator(device=DEV).manual_seed(0)
    sms = multiprocessors(torch.device(DEV))
    few = [dict(bm=16, bn=bn, split=sp, warps=w, stages=3) for bn, sp, w in
           itertools.product((32, 64, 128), (1, 2, 4), (2, 4))]
    tiles = [dict(bm=bm, bn=bn, split=1, warps=w, stages=3) for bm, bn, w in
             itertools.product((64, 128), (64, 128), (4, 8))]
    for rows, configs in ((1, few), (16, few), (64, tiles), (256, tiles)):
        for label in ("q, k and v as one", "q or o", "gate and up as one", "down"):
            k, n = WIDTHS[label]
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            l4 = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
            want = x.float() @ unpack(l4.weight_int4, l4.weight_scale).t()
            turn = itertools.cycle(_copies([l4.weight_int4, l4.weight_scale]))
            found = _timed(configs, lambda w, s, kw: product(x, w, s, sms, **kw), (l4.weight_int4, l4.weight_scale),
                           turn, want)
            default = graph_ms(lambda: product(x, *next(turn), sms))
            print(f"  int4, {rows} rows, {label} [{k}, {n}]: the default {1e3 * default:.1f} us; int4_product's "
                  f"fastest:", flush=True)
            for t, kw, err in found[:4]:
                print(f"    {1e3 * t:7.1f} us ({n * k / 2e9 / t:4.2f} TB/s) {kw} largest difference {err:.1e}", flush=True)


def tune_int8_tiles():
    """The int8 layers' tiles past ROWS rows (``graphwrap.quantized.tiles``) at 64 and 256 rows:
    rows and outputs a program, the inner dimension's step, warps, stages; beside fp16's cuBLAS."""
    from graphwrap.quantized import tiles

    g = torch.Generator(device=DEV).manual_seed(0)
    shapes = [dict(bm=bm, bn=bn, bk=bk, split=1, warps=w, stages=st) for bm, bn, bk, w, st in
              ((64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 4, 4),
               (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3))]
    for rows in (64, 256):
        for label in ("q, k and v as one", "q or o", "gate and up as one", "down"):
            k, n = WIDTHS[label]
            x, (w8, ws), want, turn, base = int8_case(g, rows, k, n)
            found = _timed(shapes, lambda w, ws_, kw: few_rows(x, None, w, ws_, torch.float16, **kw), (w8, ws),
                           turn, want)
            default = graph_ms(lambda: few_rows(x, None, *next(turn), torch.float16))
            print(f"  int8, {rows} rows, {label} [{k}, {n}]: fp16 cuBLAS {1e3 * base:.1f} us; the default "
                  f"{tiles(rows)} {1e3 * default:.1f} us; fastest:", flush=True)
            for t, kw, err in found[:4]:
                print(f"    {1e3 * t:7.1f} us {kw} largest difference {err:.1e}", flush=True)


def split_k(rows: int):
    """``torch._scaled_mm`` at ``rows`` rows as it is, with its inner dimension in 2 or 4 parts
    (each part's product in fp16, then summed), and transposed (the weight as the left operand,
    the rows' scales as the right's): a product of fewer output tiles than SMs (the output and
    down widths at 256 rows make 64 tiles of 128 x 128 on 132 SMs) may gain from more programs.
    Each checked against the product written out in fp32."""
    g = torch.Generator(device=DEV).manual_seed(rows)
    fast = FAST_ACCUM

    def parts(q, s, w, ws, n):
        k = q.shape[1] // n
        out = _scaled(q[:, :k], s, w[:, :k], ws, fast)
        for i in range(1, n):
            out += _scaled(q[:, i * k:(i + 1) * k], s, w[:, i * k:(i + 1) * k], ws, fast)
        return out

    def transposed(q, s, w, ws):
        return torch._scaled_mm(w, q.t(), scale_a=ws.t().contiguous(), scale_b=s.t().contiguous(),
                                out_dtype=torch.float16, use_fast_accum=fast).t()

    side = torch.cuda.Stream()

    def streams(q, s, w, ws):  # (the two halves on two streams: in a graph, two branches at once)
        k = q.shape[1] // 2
        here = torch.cuda.current_stream()
        side.wait_stream(here)
        out = _scaled(q[:, :k], s, w[:, :k], ws, fast)
        with torch.cuda.stream(side):
            other = _scaled(q[:, k:], s, w[:, k:], ws, fast)
        here.wait_stream(side)
        return out.add_(other)

    print(f"{rows} rows, split inner dimension:", flush=True)
    for label in ("q, k and v as one", "q or o", "gate and up as one", "down"):
        k, n = WIDTHS[label]
        x = torch.randn(rows, k, generator=g, device=DEV).half()
        q, s = rows_to_fp8(x)
        w8, ws = _fp8_weight(g, n, k)
        want = (q.float() * s) @ (w8.float() * ws.t()).t()
        turn = itertools.cycle(_copies([w8, ws]))
        runs = {"as is": lambda w, v: _scaled(q, s, w, v, fast), "2 parts": lambda w, v: parts(q, s, w, v, 2),
                "4 parts": lambda w, v: parts(q, s, w, v, 4), "2 streams": lambda w, v: streams(q, s, w, v),
                "transposed": lambda w, v: transposed(q, s, w, v)}
        cells = []
        for name, f in runs.items():
            try:
                err = ((f(w8, ws).float() - want).abs().max() / want.abs().max()).item()
                t = graph_ms(lambda: f(*next(turn)))
            except Exception as e:  # noqa: BLE001 - a form this torch cannot run: said
                cells.append(f"{name} {type(e).__name__}")
                continue
            cells.append(f"{name} {1e3 * t:6.1f} us (err {err:.0e})")
        print(f"  {label:18s} [{k}, {n}]: " + "; ".join(cells), flush=True)


def tune_fp8_tiles(rows_list):
    """graphwrap's tiles kernel (``few_rows`` past :data:`ROWS` rows) for FP8 layers at ``rows_list``
    rows, by shape of work (split inner dimension included), beside ``torch._scaled_mm``."""
    g = torch.Generator(device=DEV).manual_seed(0)
    shapes = [dict(bm=bm, bn=bn, bk=bk, split=sp, warps=w, stages=st) for bm, bn, bk, sp, w, st in
              itertools.product((64, 128), (64, 128), (64, 128), (1, 2, 4), (4, 8), (3, 4))]
    for rows in rows_list:
        for label in ("q, k and v as one", "q or o", "gate and up as one", "down"):
            k, n = WIDTHS[label]
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            (q, s), (w8, ws) = rows_to_fp8(x), _fp8_weight(g, n, k)
            want = (q.float() * s) @ (w8.float() * ws.t()).t()
            turn = itertools.cycle(_copies([w8, ws]))
            base = graph_ms(lambda: _scaled(q, s, *next(turn), FAST_ACCUM))
            found = _timed(shapes, lambda w, ws_, kw: few_rows(q, s, w, ws_, torch.float16, **kw), (w8, ws), turn,
                           want)
            print(f"  fp8, {rows} rows, {label} [{k}, {n}]: torch._scaled_mm {1e3 * base:.1f} us; fastest tiles:",
                  flush=True)
            for t, kw, err in found[:4]:
                print(f"    {1e3 * t:7.1f} us {kw} largest difference {err:.1e}", flush=True)


SMALL = {"1.1B q, k and v as one": (2048, 2560), "1.1B q or o": (2048, 2048),
         "1.1B gate and up as one": (2048, 11264), "1.1B down": (5632, 2048)}  # (the 1.1B Llama shape's)


def native(rows_list, tune: bool = False):
    """graphwrap's E4M3 tiles (``fp8_tiles``) at ``fp8_tile_shape``'s shape, each step's sum added
    in full fp32 (``precise``, graphwrap's) and not, beside ``torch._scaled_mm`` at ``rows_list``
    rows, the Llama-3-8B and 1.1B shapes' widths, each with its largest difference from the
    product written out; with ``tune``, the 8B widths' shapes of work besides (rows and outputs
    a program, the inner dimension's step, warps), fastest first."""
    g = torch.Generator(device=DEV).manual_seed(0)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    shapes = [(bm, bn, bk, w, 4) for bm, bn, bk, w in
              itertools.product((64, 128), (64, 128), (128, 256), (4, 8)) if bm * bn // (32 * w) <= 128]
    widths = {k: WIDTHS[k] for k in ("q, k and v as one", "q or o", "gate and up as one", "down")}
    for rows in rows_list:
        for label, (k, n) in {**widths, **SMALL}.items():
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            (q, s), (w8, ws) = rows_to_fp8(x), _fp8_weight(g, n, k)
            want = (q.float() * s) @ (w8.float() * ws.t()).t()
            turn = itertools.cycle(_copies([w8, ws]))
            flops = 2 * rows * n * k
            base, _, err = _timed([{}], lambda w, v, kw: _scaled(q, s, w, v, FAST_ACCUM), (w8, ws), turn, want)[0]
            line = (f"  {rows} rows, {label} [{k}, {n}]: torch._scaled_mm {1e3 * base:.1f} us "
                    f"({flops / base / 1e9:.0f} TFLOP/s, largest difference {err:.1e})")
            chosen = fp8_tile_shape(rows, n, k, sms)
            for precise in (True, False) if chosen else ():
                t, _, err = _timed([dict(shape=chosen, precise=precise)],
                                   lambda w, v, kw: fp8_tiles(q, s, w, v, torch.float16, **kw), (w8, ws), turn, want)[0]
                line += (f"; fp8_tiles {chosen}{' precise' if precise else ''} {1e3 * t:.1f} us ({base / t:.2f}x, "
                         f"{err:.1e})")
            print(line, flush=True)
            if tune and label in widths:
                fit = [dict(shape=sh) for sh in shapes if n % sh[1] == 0 and k % sh[2] == 0]
                found = _timed(fit, lambda w, v, kw: fp8_tiles(q, s, w, v, torch.float16, **kw), (w8, ws), turn, want)
                for t, kw, err in found[:3]:
                    print(f"    {1e3 * t:7.1f} us ({flops / t / 1e9:4.0f} TFLOP/s) {kw['shape']}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--weight-only", action="store_true", help="int8 and int4 weight-only layers' products instead")
    ap.add_argument("--int8-tiles", action="store_true", help="only the int8 layers' tiles past 16 rows, by shape")
    ap.add_argument("--split-k", action="store_true", help="only torch's FP8 product as is, in 2 or 4 inner parts, "
                    "and transposed, at --rows")
    ap.add_argument("--fp8-tiles", action="store_true", help="only graphwrap's tiles for FP8 layers at --rows, by "
                    "shape of work, beside torch's product")
    ap.add_argument("--native", action="store_true", help="only graphwrap's E4M3 tiles at --rows, by shape of work, "
                    "beside torch's product")
    a = ap.parse_args()
    print(f"fp8_products: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; "
          f"graphwrap's products take fast accumulation: {FAST_ACCUM}", flush=True)
    if a.int8_tiles:
        return tune_int8_tiles()
    if a.native:
        return native([int(r) for r in a.rows.split(",")], a.tune)
    if a.fp8_tiles:
        return tune_fp8_tiles([int(r) for r in a.rows.split(",")])
    if a.split_k:
        for rows in map(int, a.rows.split(",")):
            split_k(rows)
        return
    for rows in map(int, a.rows.split(",")):
        (weight_only if a.weight_only else compare)(rows)
    if a.tune:
        (tune_int4 if a.weight_only else tune)()


if __name__ == "__main__":
    main()
