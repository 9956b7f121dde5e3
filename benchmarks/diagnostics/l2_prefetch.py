"""Whether a decode step's products at one row wait on the memory or on themselves, and what
reading the next product's weights into the L2 cache beside the current one gives: the
Llama-3-8B shape's four products a layer (q/k/v as one, the output, gate and up as one, down)
at one row, in int4 (``weight_only.tiles``), FP8 (``quantized.product``) and fp16 (cuBLAS).

1. Each product alone, ten calls in a CUDA graph: over copies of its weights past the L2 cache
   ("cold", as a step reads them) and over one copy ("hot": the weights in the L2 cache where
   they fit). Hot much faster than cold: the kernel waits on the memory.
2. A chain of ``--layers`` layers' products (their own weights) in one CUDA graph, per layer:
   plainly, and with each product's launch preceded by a kernel on a second stream that asks the
   L2 cache for the next product's first ``--ahead`` MB (``cp.async.bulk.prefetch.L2``, no
   registers, no result), so the next weights stream in while this product and its joins run.

Median of 20 replays after 3. ``python3 benchmarks/diagnostics/l2_prefetch.py [--layers 8]
[--ahead 8,16,32]`` from the repository root, on a Hopper GPU.
"""

import argparse
import itertools
import time

import torch
import triton
import triton.language as tl
from fp8_products import WIDTHS, _fp8_weight
from piece_attention import graph_ms, ms
from step_products import _copies

from graphwrap import weight_only
from graphwrap.quantized import Int4Linear, product, rows_to_fp8

DEV = torch.device("cuda")
LABELS = ("q, k and v as one", "q or o", "gate and up as one", "down")
CHUNK = 1 << 16  # bytes a prefetch instruction asks for

_ASK = tl.constexpr("""{
.reg .pred p;
setp.gt.s32 p, $2, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2;
mov.b32 $0, 0;
}""")


@triton.jit
def prefetch_l2(P, NBYTES, CHUNK: tl.constexpr):
    """Ask the L2 cache for ``NBYTES`` bytes from ``P`` (16-byte aligned), ``CHUNK`` bytes a
    thread, 32 a program: nothing is read into registers or written."""
    i = tl.program_id(0) * 32 + tl.arange(0, 32)
    start = i.to(tl.int64) * CHUNK
    size = tl.minimum(NBYTES - start, CHUNK).to(tl.int32) // 16 * 16
    tl.inline_asm_elementwise(_ASK, "=r,l,r", [P + start, size], dtype=tl.int32, is_pure=False, pack=1)


def ask(tensors, limit):
    """Ask the L2 cache for up to ``limit`` bytes of ``tensors``, in order."""
    for t in tensors:
        n = min(t.numel() * t.element_size(), limit)
        if n <= 0:
            return
        prefetch_l2[(triton.cdiv(triton.cdiv(n, CHUNK), 32),)](t.view(torch.uint8).view(-1), n, CHUNK=CHUNK,
                                                               num_warps=1)
        limit -= n


def kinds(g, sms):
    """For each kind, ``make(label) -> weights`` and ``run(x, weights) -> out`` at one row."""
    def int4(label):
        k, n = WIDTHS[label]
        layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
        return [layer.weight_int4, layer.weight_scale]

    def fp8(label):
        k, n = WIDTHS[label]
        return list(_fp8_weight(g, n, k))

    def fp16(label):
        k, n = WIDTHS[label]
        return [(torch.randn(n, k, generator=g, device=DEV) / k ** 0.5).half()]

    def run_fp8(x, w):
        q, s = rows_to_fp8(x)
        return product(q, s, w[0], w[1], torch.float16)

    return {"int4": (int4, lambda x, w: weight_only.product(x, w[0], w[1], sms)), "fp8": (fp8, run_fp8),
            "fp16": (fp16, lambda x, w: x @ w[0].t())}


def chain_ms(run, layers, xs, ahead):
    """Per layer: ``layers`` (each four products' weights) in one graph, each product's input
    its own row; with ``ahead`` bytes of the next product's weights asked for first."""
    flat = [w for layer in layers for w in layer]
    side = torch.cuda.Stream()

    def go():
        main = torch.cuda.current_stream()
        for i, w in enumerate(flat):
            if ahead and i + 1 < len(flat):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    ask(flat[i + 1], ahead)
            run(xs[i % 4], w)
        if ahead:
            main.wait_stream(side)

    return graph_ms(go, calls=1) / len(layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ahead", default="8,16,32", help="MB of the next product's weights asked for")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(DEV)
    print(f"l2_prefetch: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, L2 {getattr(props, 'L2_cache_size', 0) >> 20} MB", flush=True)
    g = torch.Generator(device=DEV).manual_seed(3)
    for kind, (make, run) in kinds(g, props.multi_processor_count).items():
        xs = [torch.randn(1, WIDTHS[label][0], generator=g, device=DEV).half() for label in LABELS]
        for label, x in zip(LABELS, xs):
            w = make(label)
            gb = sum(t.numel() * t.element_size() for t in w) / 1e9
            turn = itertools.cycle(_copies(w))
            cold = graph_ms(lambda: run(x, next(turn)))
            hot = graph_ms(lambda: run(x, w))
            one = ms(lambda: run(x, w))
            print(f"  {kind}, {label} ({gb * 1e3:.1f} MB): cold {1e3 * cold:.1f} us ({gb / cold:.2f} TB/s), hot "
                  f"{1e3 * hot:.1f} us, launched alone {1e3 * one:.1f} us", flush=True)
        layers = [[make(label) for label in LABELS] for _ in range(a.layers)]
        want = [run(xs[i % 4], w) for i, w in enumerate([w for layer in layers for w in layer])]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            ask(layers[0][0], 1 << 30)
        torch.cuda.synchronize()
        got = [run(xs[i % 4], w) for i, w in enumerate([w for layer in layers for w in layer])]
        same = all(torch.equal(p, q) for p, q in zip(want, got))
        gb = sum(t.numel() * t.element_size() for layer in layers[:1] for w in layer for t in w) / 1e9
        plain = chain_ms(run, layers, xs, 0)
        print(f"  {kind}, {a.layers} layers in one graph ({gb * 1e3:.0f} MB a layer; the answers unchanged by a "
              f"prefetch: {same}): plain {1e3 * plain:.1f} us a layer ({gb / plain:.2f} TB/s)", flush=True)
        for mb in [int(m) for m in a.ahead.split(",")]:
            t = chain_ms(run, layers, xs, mb << 20)
            print(f"    next product's first {mb} MB asked for: {1e3 * t:.1f} us a layer ({gb / t:.2f} TB/s, "
                  f"{plain / t:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
