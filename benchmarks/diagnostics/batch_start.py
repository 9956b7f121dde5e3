"""Where the time goes when the shared batch is made: the first ``gm.generate``'s set-up (the
probe of the model through the cache, the cache's layout and allocation, the engines), before
any request is served. Profiles making the batch in a fresh process and again for a second
GraphedModule of the same model in the same process (what the process's first time costs,
apart). GPT-2 or the 1.1B Llama shape, fp16, random weights.
Run from the project root: ``python3 benchmarks/diagnostics/batch_start.py [gpt2|llama]``
"""

import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ".")
import generate as g  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402
from graphwrap.decoding.callers import front  # noqa: E402


def make(model, profile: bool):
    gm = GraphedModule(model)
    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    server, why = front.server_of(gm.__dict__, model)
    torch.cuda.synchronize()
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    assert server is not None, why
    if server.captures is not None:
        server.captures.stop(60)
    return gm, dt, prof


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    dev = torch.device("cuda")
    model = g._model(name, dev)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {name}", flush=True)
    gm, first, prof = make(model, True)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    print(f"the batch made in a fresh process: {first:.3f} s", flush=True)
    print(out.getvalue()[:9000], flush=True)
    gm.close()
    for i in range(2):
        gm, again, _ = make(model, False)
        print(f"the batch of another GraphedModule of the same model, the process warm ({i + 1}): {again:.3f} s",
              flush=True)
        gm.close()


if __name__ == "__main__":
    main()
