"""What Nsight Compute profiled (call 6): graphwrap's FP8 product at one row (``one_row``), the
Llama-3-8B shape's down projection, then q/k/v as one, three calls each (``ncu --clock-control
none -k regex:one_row -s 2 -c 2 ...``). Run with ``PYTHONPATH`` at the repository root."""

import torch

from graphwrap.quantized import FP8, product, rows_to_fp8

DEV = torch.device("cuda")
for k, n in ((14336, 4096), (4096, 6144)):
    x = torch.randn(1, k, device=DEV).half()
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    s = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
    w8, ws = (w / s[:, None]).to(FP8), s[None, :].contiguous()
    q, qs = rows_to_fp8(x)
    for _ in range(3):
        y = product(q, qs, w8, ws, torch.float16)
    torch.cuda.synchronize()
print("done")
