"""Where a long prompt's prefill spends its time: a Llama-3-8B shape (fp16, random weights), one
6,000-token prompt through ``gm.generate`` (pieces of 512 positions), beside the model's own
forward over 512 tokens and single pieces through ``ChunkStep`` at three offsets, each the best
of a few runs; then the torch profiler's table of one piece at offset 5,120.

``python benchmarks/diagnostics/long_prompt_pieces.py`` from the repository root, on a GPU.
"""

import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from generate_large import big_model  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402
from graphwrap.decoding.engine.step import ChunkStep  # noqa: E402

DEV = torch.device("cuda")


def best_ms(f, n=3):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * min(ts)


def main():
    print(f"long_prompt_pieces: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    model = big_model("llama3-8b", DEV)
    gm = GraphedModule(model)
    gm.generate(input_ids=torch.randint(3, 1000, (1, 20), device=DEV), max_new_tokens=2, do_sample=False)
    server = gm.__dict__["_gw_decode"]
    long_ids = torch.randint(3, 1000, (1, 6000), device=DEV)
    ms = best_ms(lambda: gm.generate(input_ids=long_ids, max_new_tokens=1, do_sample=False), 2)
    print(f"gm.generate, a 6,000-token prompt, 1 new token: {ms:.1f} ms", flush=True)
    x = torch.randint(3, 1000, (1, 512), device=DEV)
    with torch.no_grad():
        ms = best_ms(lambda: model(input_ids=x, use_cache=False, logits_to_keep=1))
        print(f"the model's own forward over 512 tokens, no cache: {ms:.1f} ms", flush=True)
        chunk, store, row = ChunkStep(model), server.store, 5
        store.assign([row], [list(range(200, 200 + 376))])
        for start in (0, 2560, 5120):
            with server.fold:
                ms = best_ms(lambda: chunk(x, start, store.chunk_window(row, start, 512)))
            print(f"ChunkStep, a piece of 512 at {start}: {ms:.1f} ms", flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with server.fold:
                chunk(x, 5120, store.chunk_window(row, 5120, 512))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
        store.release(torch.tensor([row], device=DEV))
    gm.close()


if __name__ == "__main__":
    main()
