"""Two forms of graphwrap's tiles at the Llama-3-8B shape's widths: int8 weight-only products
past 16 rows with the weights as the left operand (``graphwrap.quantized.int8_tiles``, ``O^T = W
. X^T``: each int8 weight made fp16 in registers and handed to the tensor cores from there, the
rows from shared memory) at ``int8_tile_shape``'s shape and by shape of work, against
``few_rows``' tiles (the weights the right operand) and fp16's cuBLAS; and FP8
products of 2 to 16 rows on the tensor cores' own E4M3 products in tiles of 16 rows
(``fp8_tiles``) against ``few_rows`` (E4M3 values made fp16); and int4 weight-only products from
one row up with the weights made whole in registers as the left operand
(``graphwrap.weight_only.tiles``) at ``tile_shape``'s shape and by shape of work, against
``int4_product``'s tiles (the weights the right operand, each group's sum scaled; what
``weight_only.product`` takes past 64 rows) and fp16's cuBLAS. Each timed over ten calls in a
CUDA graph over weight copies past the L2 cache, median of 20, checked against the product
written out.

``python3 benchmarks/diagnostics/swapped_tiles.py [--only int8|fp8|int4] [--rows 24,64,128,256,2048]
[--int4-rows 1,4,16,64,256] [--no-tune]`` from the repository root, on a Hopper GPU.
"""

import argparse
import itertools
import time

import torch
import triton
from fp8_products import WIDTHS, _fp8_weight, _timed, int8_case
from piece_attention import graph_ms
from step_products import _copies

from graphwrap import weight_only
from graphwrap.quantized import Int4Linear, few_rows, fp8_tiles, int8_tile_shape, int8_tiles, rows_to_fp8

DEV = torch.device("cuda")
LABELS = ("q, k and v as one", "q or o", "gate and up as one", "down")


def int8_rows(rows_list, tune: bool = True):
    g = torch.Generator(device=DEV).manual_seed(0)
    for rows in rows_list:
        shapes = [dict(shape=s) for s in itertools.product((16,) if rows <= 16 else (32, 64, 128), (64, 128), (64, 128),
                                                           (4, 8), (3, 4))
                  if s[0] * s[1] // (32 * s[3]) <= 128]
        for label in LABELS:
            k, n = WIDTHS[label]
            x, (w8, ws), want, turn, base = int8_case(g, rows, k, n)
            layers = graph_ms(lambda: few_rows(x, None, *next(turn), torch.float16))
            chosen = int8_tile_shape(rows, n, k, torch.cuda.get_device_properties(DEV).multi_processor_count)
            rule = graph_ms(lambda: int8_tiles(x, *next(turn), chosen)) if chosen else float("nan")
            found = _timed(shapes if tune else [dict(shape=chosen)] if chosen else [],
                           lambda w, v, kw: int8_tiles(x, w, v, kw["shape"]),
                           (w8, ws), turn, want)
            print(f"  int8, {rows} rows, {label} [{k}, {n}]: fp16 cuBLAS {1e3 * base:.1f} us; few_rows' tiles "
                  f"{1e3 * layers:.1f} us; int8_tiles {chosen} {1e3 * rule:.1f} us; fastest of {len(found)}:",
                  flush=True)
            for t, kw, err in found[:3]:
                print(f"    {1e3 * t:7.1f} us {kw['shape']} largest difference {err:.1e}", flush=True)


def _int4_shapes(rows):
    if rows <= 16:
        found = itertools.product((16,), (64, 128), (1, 2, 4, 8), (4, 8), (2, 3, 4))
    elif rows <= 64:
        found = itertools.product((16, 32, 64), (64, 128), (1, 2, 4), (4,), (3, 4))
    else:
        found = itertools.product((32, 64, 128), (64, 128), (1, 2), (4, 8), (3, 4))
    return [dict(shape=s) for s in found if s[0] * s[1] // (32 * s[3]) <= 128]


def int4_rows(rows_list, tune: bool = True):
    g = torch.Generator(device=DEV).manual_seed(2)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for rows in rows_list:
        for label in LABELS:
            k, n = WIDTHS[label]
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
            w4, s4 = layer.weight_int4, layer.weight_scale
            w16 = weight_only.unpack(w4, s4)
            want = x.float() @ w16.t()
            c16 = itertools.cycle(_copies([w16.half()]))
            base = graph_ms(lambda: x @ next(c16)[0].t())
            turn = itertools.cycle(_copies([w4, s4]))
            theirs = graph_ms(lambda: _int4_product(x, *next(turn), sms))
            chosen = weight_only.tile_shape(rows, n, k, sms)
            rule = graph_ms(lambda: weight_only.tiles(x, *next(turn), chosen)) if chosen else float("nan")
            found = _timed(_int4_shapes(rows) if tune else [dict(shape=chosen)] if chosen else [],
                           lambda w, v, kw: weight_only.tiles(x, w, v, kw["shape"]), (w4, s4), turn, want)
            print(f"  int4, {rows} rows, {label} [{k}, {n}]: fp16 cuBLAS {1e3 * base:.1f} us; int4_product "
                  f"{1e3 * theirs:.1f} us; tiles {chosen} {1e3 * rule:.1f} us ({n * k / 2e9 / rule:.2f} TB/s); "
                  f"fastest of {len(found)}:", flush=True)
            for t, kw, err in found[:4]:
                print(f"    {1e3 * t:7.1f} us ({n * k / 2e9 / t:4.2f} TB/s) {kw['shape']} largest difference "
                      f"{err:.1e}", flush=True)


def _int4_product(x, w, s, sms):
    """The product by int4_product's tiles at their default shape."""
    return weight_only.product(x, w, s, sms, bm=16 if x.shape[0] <= weight_only.ROWS else weight_only.TILES[0])


def fp8_few(rows_list):
    g = torch.Generator(device=DEV).manual_seed(1)
    shapes = [dict(shape=s) for s in itertools.product((16,), (32, 64, 128), (128, 256), (4,), (3, 4))]
    for rows in rows_list:
        for label in LABELS:
            k, n = WIDTHS[label]
            x = torch.randn(rows, k, generator=g, device=DEV).half()
            (q, s), (w8, ws) = rows_to_fp8(x), _fp8_weight(g, n, k)
            want = (q.float() * s) @ (w8.float() * ws.t()).t()
            turn = itertools.cycle(_copies([w8, ws]))
            layers = graph_ms(lambda: few_rows(q, s, *next(turn), torch.float16))
            found = _timed(shapes, lambda w, v, kw: fp8_tiles(q, s, w, v, torch.float16, kw["shape"]), (w8, ws),
                           turn, want)
            print(f"  fp8, {rows} rows, {label} [{k}, {n}]: few_rows {1e3 * layers:.1f} us; fp8_tiles of 16 rows, "
                  f"fastest of {len(found)}:", flush=True)
            for t, kw, err in found[:3]:
                print(f"    {1e3 * t:7.1f} us {kw['shape']} largest difference {err:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("int8", "fp8", "int4"), default=None)
    ap.add_argument("--rows", default="24,64,128,256,2048", help="the int8 products' rows")
    ap.add_argument("--int4-rows", default="1,4,16,64,256", help="the int4 products' rows")
    ap.add_argument("--no-tune", action="store_true", help="int8 and int4: only the rule's shape (checked), no others")
    a = ap.parse_args()
    print(f"swapped_tiles: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    if a.only in (None, "fp8"):
        fp8_few((2, 8, 16))
    if a.only in (None, "int8"):
        int8_rows([int(r) for r in a.rows.split(",")], not a.no_tune)
    if a.only in (None, "int4"):
        int4_rows([int(r) for r in a.int4_rows.split(",")], not a.no_tune)


if __name__ == "__main__":
    main()
