"""The shared batch's two cache layouts side by side, in one process: whole rows (``paged``
False: a step attends over views of the rows, padded to the longest live row) against the paged
pool (``paged`` True: on a GPU with Triton, each row read in place up to its own length).

``python benchmarks/diagnostics/paged_layouts.py [MODEL ...]`` (models of the generate suite:
gpt2, llama; default both): the generate suite's burst (64 requests, prompts 16..128, new
32..256, fp16, greedy), a first burst each, then warm bursts alternating between the layouts;
tokens/s median [min, max], time per output token p50, and whether both layouts made the same
tokens.
"""

import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
from generate import _model, burst, fresh_latencies, server_latencies, workload  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

DEV = torch.device("cuda")


def main(models):
    print(f"paged_layouts: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name in models:
        model = _model(name, DEV)
        reqs = workload(model.config.vocab_size)
        tokens = sum(k for _, k in reqs)
        gms = {"rows": GraphedModule(model, decode={"paged": False}),
               "paged": GraphedModule(model, decode={"paged": True})}
        outs, rates, tpot = {}, {k: [] for k in gms}, {k: [] for k in gms}
        for k, gm in gms.items():
            cold, _, _, outs[k] = burst(gm, reqs, DEV)
            print(f"  [{name}] {k}: first burst {cold:.2f} s", flush=True)
        for _ in range(3):
            for k, gm in gms.items():
                fresh_latencies(gm)
                t, *_ = burst(gm, reqs, DEV)
                rates[k].append(tokens / t)
                tpot[k].append(server_latencies(gm)["tpot_p50_ms"])
        for k in gms:
            r = rates[k]
            print(f"  [{name}] {k}: {statistics.median(r):,.0f} tokens/s [{min(r):,.0f}, {max(r):,.0f}], time per "
                  f"output token p50 {statistics.median(tpot[k]):.2f} ms, cache "
                  f"{gms[k].stats()['decode']['cache_bytes'] / 2**20:.0f} MiB", flush=True)
        same = sum(torch.equal(a, b) for a, b in zip(outs["rows"], outs["paged"]))
        print(f"  [{name}] paged/rows: {statistics.median(rates['paged']) / statistics.median(rates['rows']):.3f}; "
              f"{same} of {len(reqs)} requests made the same tokens both ways", flush=True)
        for gm in gms.values():
            gm.close()
        del gms, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gpt2", "llama"])
