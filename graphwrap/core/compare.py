"""Comparing a graph's outputs with eager ones, with tolerances that fit each dtype.

Pure torch: runs on CPU tensors in the tests and on CUDA tensors at capture time.
"""

from typing import Optional, Sequence

import torch

from .tree import Tensor

# Same shapes: replay against eager on identical inputs. Reduction order in nondeterministic
# kernels (atomics) separates them, and so can cuBLAS's choice of algorithm, which depends on
# the workspace a stream has (a captured GEMM's is the graph pool's): in fp16, BERT-base at
# batch 64 differed by 2.6e-3 of its largest output (H100, torch 2.11). A graph that replays
# frozen host state is off by far more.
SAME_SHAPE_TOL = {
    torch.float64: 1e-7,
    torch.float32: 1e-4,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
}
# Different batch sizes pick different kernels (GEMM tiling, split-K, TF32 convolutions in
# fp32), so the real rows of a padded batch match eager on the real rows only to rounding.
CROSS_SHAPE_TOL = {
    torch.float64: 1e-6,
    torch.float32: 5e-3,
    torch.float16: 2e-2,
    torch.bfloat16: 8e-2,
}


def tolerance(dtype: torch.dtype, table=SAME_SHAPE_TOL) -> float:
    if dtype in table:
        return table[dtype]
    if dtype.is_floating_point or dtype.is_complex:
        return table[torch.float16]  # float8 and friends: the loosest float tolerance we know
    return 0.0


def compare_tensors(got: Tensor, want: Tensor, tol: float) -> Optional[str]:
    """None if ``got`` matches ``want``, else a short description of the difference.

    Elementwise ``|got - want| <= tol * (|want| + max|want|)``, NaN where and only where
    ``want`` has NaN, and infinities equal. Integers and bools must match exactly.
    """
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if got.numel() == 0:
        return None
    if not (want.dtype.is_floating_point or want.dtype.is_complex):
        bad = (got != want).sum().item()
        return None if bad == 0 else f"{bad} of {want.numel()} elements differ"
    # float32 holds fp16, bf16 and fp32 values exactly and keeps the temporaries small (a large
    # logits tensor in float64 would take four times its fp16 size, several times over).
    if want.dtype.is_complex:
        work = torch.complex128 if want.dtype == torch.complex128 else torch.complex64
    else:
        work = torch.float64 if want.dtype == torch.float64 else torch.float32
    g = got.detach().to(work)
    w = want.detach().to(work)
    g_nan, w_nan = torch.isnan(g), torch.isnan(w)
    if not torch.equal(g_nan, w_nan):
        return f"NaN in {int(g_nan.sum())} elements, eager has {int(w_nan.sum())}"
    g_inf, w_inf = torch.isinf(g), torch.isinf(w)
    if not torch.equal(g_inf, w_inf) or not torch.equal(g[g_inf], w[w_inf]):
        return "infinities differ"
    finite = ~(w_nan | w_inf)
    g, w = g[finite], w[finite]
    if g.numel() == 0:
        return None
    scale = w.abs().max()
    err = (g - w).abs()
    limit = tol * (w.abs() + scale)
    if bool((err <= limit).all()):
        return None
    rel = float(err.max() / scale) if scale > 0 else float("inf")
    return f"max abs diff {float(err.max()):.3g} (relative to max |eager| {rel:.3g}, tolerance {tol:g})"


def compare_leaves(got: Sequence, want: Sequence, table=SAME_SHAPE_TOL, names=None) -> Optional[str]:
    """Compare two flat output lists leaf by leaf; None if all match, else the first difference."""
    if len(got) != len(want):
        return f"{len(got)} outputs != {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        name = names(i) if names else f"output {i}"
        if isinstance(w, Tensor) != isinstance(g, Tensor):
            return f"{name}: tensor on one side only"
        if isinstance(w, Tensor):
            msg = compare_tensors(g, w, tolerance(w.dtype, table))
        else:
            try:
                msg = None if bool(g == w) else f"{g!r} != {w!r}"
            except Exception:  # noqa: BLE001
                msg = f"{g!r} cannot be compared with {w!r}"
        if msg is not None:
            return f"{name}: {msg}"
    return None
