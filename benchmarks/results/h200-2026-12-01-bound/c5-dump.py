"""Call 5: the compiled int4 tiles kernel (``int4_dequant.py``'s copy of ``int4_tiles``, ``asm``
and ``bits``) at one row, gate and up as one, written to ``$OUT`` as its cubin and Triton GPU IR,
with its registers and shared memory. Run from the repository root with ``PYTHONPATH`` there
and ``benchmarks/diagnostics`` on it."""

import os

import int4_dequant as D
import torch

from graphwrap import weight_only
from graphwrap.quantized import Int4Linear

DEV = torch.device("cuda")
out = os.environ["OUT"]
k, n = 4096, 28672
x = torch.randn(1, k, device=DEV).half()
layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
shape = weight_only.tile_shape(1, n, k, torch.cuda.get_device_properties(DEV).multi_processor_count)
for way in (0, 1):
    kernels = []
    D.run(x, layer.weight_int4, layer.weight_scale, shape, way, kernels)
    with open(f"{out}/way{way}.cubin", "wb") as f:
        f.write(kernels[0].asm["cubin"])
    with open(f"{out}/way{way}.ttgir", "w") as f:
        f.write(kernels[0].asm["ttgir"])
    print("way", way, "regs", kernels[0].n_regs, "spills", kernels[0].n_spills, "shared", kernels[0].metadata.shared)
torch.cuda.synchronize()
