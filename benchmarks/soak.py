"""Memory over a long loop: ``python benchmarks/soak.py [--batches N]``.

Runs gm.pipeline over N small pinned batches of mixed sizes (with and without to_host) and
prints device memory (allocated, reserved) and host memory (RSS) at the start and the end.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from workloads import SeedMLP  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=100_000)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device found: the soak needs a GPU.")
        return 0
    model = SeedMLP().cuda().eval()
    gm = GraphedModule(model, max_batch_size=16)
    pool = [torch.randn(n, 1024).pin_memory() for n in (1, 2, 3, 5, 8, 13, 16)]

    def batches(k):
        for i in range(k):
            yield pool[i % len(pool)]

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for to_host in (False, True):
        for _ in gm.pipeline(batches(2000), to_host=to_host):  # warm-up: captures every bucket
            pass
        torch.cuda.synchronize()
        start = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), rss_mib())
        t0 = time.perf_counter()
        n = 0
        for _ in gm.pipeline(batches(a.batches), to_host=to_host):
            n += 1
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        end = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), rss_mib())
        print(f"to_host={to_host}: {n} batches in {dt:.1f} s; device allocated {start[0] / 2**20:.1f} -> "
              f"{end[0] / 2**20:.1f} MiB, reserved {start[1] / 2**20:.1f} -> {end[1] / 2**20:.1f} MiB; "
              f"host RSS {start[2]:.0f} -> {end[2]:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
