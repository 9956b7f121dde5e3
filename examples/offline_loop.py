"""An offline loop: batches of mixed sizes from host memory through ``gm.pipeline``.

    python examples/offline_loop.py

The pipeline copies each batch to the GPU on a copy stream while the previous one replays, and
yields the outputs in order. On a machine without CUDA every call runs eagerly (same answers).
Prints one line: batches, time, and whether every output equals eager.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphwrap  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    model = model.to(device).eval()
    pin = device == "cuda"
    batches = [torch.randn(int(n), 256, pin_memory=pin) for n in torch.randint(1, 65, (200,))]

    gm = graphwrap.GraphedModule(model)
    t0 = time.perf_counter()
    outs = list(gm.pipeline(batches))
    if device == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t0

    with torch.no_grad():
        same = all(torch.allclose(o, model(b.to(device)), rtol=1e-4, atol=1e-5) for o, b in zip(outs, batches))
    s = gm.stats()
    graphs = sum(len(k["buckets"]) for k in s["keys"])
    print(f"offline loop on {device}: {len(outs)} batches in {took:.3f} s (first pass, captures included), "
          f"{graphs} buckets captured, {sum(s['eager_calls'].values())} eager calls, answers equal eager: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
