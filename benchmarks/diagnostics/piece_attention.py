"""One layer's attention in a piece of a long prompt, by kernel: 128 queries of 32 heads (128
wide, fp16) over ``S`` keys of 8 heads gathered from a paged pool (``[S, 8, 128]`` transposed),
an additive mask ``[1, 1, 128, S]``, as the batch's piece graph runs it through transformers
(keys and values repeated to 32 heads, then PyTorch's attention); each of PyTorch's kernels that
takes it, with the repeat, without it (``enable_gqa``), and folded (a key head's four query
heads as 512 query positions under the mask's rows repeated: graphwrap's attention), graphwrap's
piece kernel reading the pool in place (no gather, no mask: each query's keys only), and flash
without a mask for scale.
Median of 20 timed runs after 3, CUDA events, per call.

``python3 benchmarks/diagnostics/piece_attention.py`` from the repository root, on a GPU;
``--tune [--width 512]`` times the piece kernel's shapes of work instead (query rows and key positions a
program takes, warps, pipeline stages, splits of the keys), each checked against the reference,
ten calls in a CUDA graph (as the piece graphs run it: no host launch between them).
"""

import argparse
import itertools
import statistics
import time

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphwrap.decoding.kernels import piece_attention
from graphwrap.decoding.kernels.piece_attention import attend_piece

DEV = torch.device("cuda")
H, KV, D, W = 32, 8, 128, 128


def ms(f) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(f, calls: int = 10) -> float:
    """Like :func:`ms`, over a CUDA graph of ``calls`` calls (no host launches between kernels, as
    in the batch's piece graphs), per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            f()
    return ms(graph.replay) / calls


def repeat(x: torch.Tensor) -> torch.Tensor:
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, H // kv, s, d).reshape(b, H, s, d)


def tune(width: int = W):
    """Each shape of work of the piece kernel for a piece ``width`` wide, by S, fastest first."""
    print(f"piece_attention --tune: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}, a piece {width} wide", flush=True)
    configs = [(r, t, 8 if r == 128 else 4, st, sp)
               for r, t, st, sp in itertools.product((32, 64, 128), (64, 128), (2, 3, 4), (1, 2, 4))]
    for S in (1024, 4096, 8192):
        paged = torch.randn(2, S // 16, 16, KV, D, device=DEV, dtype=torch.half)
        blocks = torch.randperm(S // 16, device=DEV)
        q = torch.randn(1, H, width, D, device=DEV, dtype=torch.half)
        at = torch.tensor([S - width, width, 0], device=DEV)
        want = piece_attention.reference(q, paged[0], paged[1], blocks, at)
        flops = 4 * width * S * D * H
        found = []
        for rows, tile, warps, stages, splits in configs:
            def f(rows=rows, tile=tile, warps=warps, stages=stages, splits=splits):
                return piece_attention._launch(q[0], paged[0], paged[1], blocks, at, D ** -0.5, 0, 0.0, rows=rows,
                                               tile=tile, warps=warps, stages=stages, splits=splits)
            label = f"rows {rows:3d} tile {tile:3d} warps {warps} stages {stages} splits {splits}"
            try:
                err = (f()[None].float() - want.float()).abs().max().item()
                found.append((graph_ms(f), label, err))
            except Exception as e:  # (a shape that does not fit the chip's shared memory)
                print(f"  S={S:5d} {label}: refused: {str(e).splitlines()[0][:90]}", flush=True)
        for t, label, err in sorted(found):
            print(f"  S={S:5d} {label}  {t:7.3f} ms  ({flops / t / 1e9:6.1f} TFLOP/s)  max error {err:.4f}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true", help="the piece kernel's shapes of work timed instead")
    ap.add_argument("--width", type=int, default=W, help="--tune: the piece's width (512: a piece alone)")
    a = ap.parse_args()
    if a.tune:
        return tune(a.width)
    print(f"piece_attention: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}, {time.strftime('%Y-%m-%d')}", flush=True)
    for S in (1024, 4096, 8192):
        pool = torch.randn(2, S, KV, D, device=DEV, dtype=torch.half)
        k, v = (pool[i].transpose(0, 1)[None] for i in range(2))  # [1, 8, S, 128], as gathered
        q = torch.randn(1, H, W, D, device=DEV, dtype=torch.half)
        start = S - W
        seen = torch.arange(S, device=DEV)[None] <= (start + torch.arange(W, device=DEV))[:, None]
        mask = torch.where(seen, 0.0, torch.finfo(torch.half).min).to(torch.half)[None, None]
        fold_mask = mask[:, :, None].expand(-1, -1, H // KV, -1, -1).reshape(1, 1, H // KV * W, S)
        flops = 4 * W * S * D * H
        rows = [("repeat of keys and values", lambda: (repeat(k), repeat(v)))]
        for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("math", SDPBackend.MATH)):
            def now(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, repeat(k), repeat(v), attn_mask=mask)

            def gqa(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            def folded(backend=backend):  # (graphwrap's fold: a key head's query heads as its positions)
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q.reshape(1, KV, H // KV * W, D), k, v, attn_mask=fold_mask)

            rows += [(f"{name}: repeat + attention", now), (f"{name}: enable_gqa", gqa), (f"{name}: folded", folded)]

        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        rows.append(("flash, no mask, enable_gqa", flash))
        blocks = torch.arange(S // 16, device=DEV)  # (the row's line: the pool's blocks in order)
        paged = pool.view(2, S // 16, 16, KV, D)
        at = torch.tensor([start, W, 0], device=DEV)
        rows.append(("graphwrap's piece kernel", lambda: attend_piece(q, paged[0], paged[1], blocks, at)))
        for label, f in rows:
            try:
                t = ms(f)
                print(f"  S={S:5d} {label:28s} {t:7.3f} ms  ({flops / t / 1e9:6.1f} TFLOP/s)", flush=True)
            except RuntimeError as e:
                print(f"  S={S:5d} {label:28s} refused: {str(e).splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
    main()
