"""What Nsight Compute profiled (calls 4 and 5): graphwrap's int4 product at one row, the
Llama-3-8B shape's gate and up as one, then q/k/v as one, three calls each (the third of each
profiled: ``ncu --clock-control none -k regex:int4_tiles -s 2 -c 2 ...``). Run with
``PYTHONPATH`` at the repository root."""

import torch

from graphwrap import weight_only
from graphwrap.quantized import Int4Linear

DEV = torch.device("cuda")
sms = torch.cuda.get_device_properties(DEV).multi_processor_count
for k, n in ((4096, 28672), (4096, 6144)):
    x = torch.randn(1, k, device=DEV).half()
    layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
    for _ in range(3):
        y = weight_only.product(x, layer.weight_int4, layer.weight_scale, sms)
    torch.cuda.synchronize()
print("done")
