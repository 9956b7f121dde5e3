"""A threaded server: many threads, each with its own requests, served by one ``Batcher``.

    python examples/threaded_server.py

Concurrent requests of one input signature are joined along the batch into one call and each
caller gets its own rows back. On a machine without CUDA the module runs eagerly, and requests
are still joined. Prints one line: requests, module calls, and whether every answer equals eager.
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphwrap  # noqa: E402

CLIENTS, REQUESTS = 16, 50


def main() -> int:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(device).eval()
    batcher = graphwrap.Batcher(graphwrap.GraphedModule(model), max_delay_ms=2)
    wrong, done = [], []

    def client(i):
        g = torch.Generator().manual_seed(i)
        for _ in range(REQUESTS):
            x = torch.randn(int(torch.randint(1, 5, (1,), generator=g)), 64, generator=g).to(device)
            y = batcher(x)  # blocks this thread until its rows are back
            with torch.no_grad():
                if not torch.allclose(y, model(x), rtol=1e-4, atol=1e-5):
                    wrong.append(i)
            done.append(1)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    batcher.close()
    s = batcher.stats()
    print(f"threaded server on {device}: {len(done)} requests from {CLIENTS} threads in {took:.2f} s, "
          f"{s['module_calls']} module calls, answers equal eager: {not wrong}")
    return 0 if not wrong and len(done) == CLIENTS * REQUESTS else 1


if __name__ == "__main__":
    sys.exit(main())
