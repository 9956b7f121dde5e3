"""Which global forward hooks appear while torch.compile compiles a module in another thread.

``python benchmarks/diagnostics/global_hooks.py``: compiles a small MLP with Inductor in a thread
and samples torch.nn's global forward hook tables from the main thread meanwhile; prints each
hook seen (its module and name) and how many samples saw it.
"""

import collections
import threading
import time

import torch
from torch import nn
from torch.nn.modules import module as nn_module


def main():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    done = threading.Event()

    def compile_it():
        with torch.no_grad():
            torch.compile(model, dynamic=True)(x)
        done.set()

    seen, samples = collections.Counter(), 0
    t = threading.Thread(target=compile_it)
    t.start()
    while not done.is_set():
        samples += 1
        for table in ("_global_forward_pre_hooks", "_global_forward_hooks"):
            for h in list(getattr(nn_module, table).values()):
                seen[(table, getattr(h, "__module__", "?"), getattr(h, "__qualname__", repr(h)))] += 1
        time.sleep(1e-4)  # let the compiling thread have the GIL
    t.join()
    print(f"{samples} samples of the global hook tables while torch {torch.__version__} compiled")
    for (table, mod, name), n in seen.items():
        print(f"  {table}: {mod}.{name} in {n} samples")
    if not seen:
        print("  none seen")


if __name__ == "__main__":
    main()
