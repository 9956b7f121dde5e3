"""The bench ``generate`` workload's warm bursts, many of them: a model's shared batch after two
bursts to warm it (their times said too), then ``--bursts`` more, their median in tokens/s with every burst's time.
Run once per tree (in a process each) to set two trees side by side where three bursts (what
``step_profile.py`` times) are too few to tell them apart.

``python3 benchmarks/diagnostics/warm_bursts.py gpt2 [--bursts 12] [--label after]`` from the
repository root (or an earlier tree's), on a GPU.
"""

import argparse
import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
import generate as g  # noqa: E402

from graphwrap import GraphedModule  # noqa: E402

DEV = torch.device("cuda")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=["gpt2", "llama"])
    ap.add_argument("--bursts", type=int, default=12)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    model = g._model(a.model, DEV)
    gm = GraphedModule(model)
    reqs = g.workload(model.config.vocab_size)
    tokens = sum(k for _, k in reqs)
    vocab = model.config.vocab_size  # (each burst's prompts its own: a prompt sent again is a prefix cache hit)
    first = [g.burst(gm, g.renewed(reqs, r, vocab) if r else reqs, DEV)[0] for r in range(2)]
    print(f"{a.model} {a.label}: the first two bursts {first[0]:.3f} s, {first[1]:.3f} s", flush=True)
    times = [g.burst(gm, g.renewed(reqs, 2 + r, vocab), DEV)[0] for r in range(a.bursts)]
    m = statistics.median(times)
    print(f"{a.model} {a.label}: warm bursts {tokens / m:,.0f} tokens/s (median of {a.bursts}, {min(times):.3f}-"
          f"{max(times):.3f} s; {sorted(round(t, 3) for t in times)})", flush=True)
    gm.close()


if __name__ == "__main__":
    main()
