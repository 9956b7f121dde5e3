"""Scenario "cpu-first-call": a GPT-2-sized model's first ``generate`` on a CPU, in fresh processes.

Each run is a fresh process (spawned by this one) that builds GPT-2's shape with random
weights, fp32, then times one call of 32 prompt tokens and 32 new tokens, greedy:
``model.generate`` or ``GraphedModule(model).generate`` (its first: the shared batch is made
there, its probe and its cache included), and reads the process's resident memory before and
after, and its peak. ``--runs`` processes each, alternating; medians with their spread, and
graphwrap's against ``model.generate``'s. The torch threads are torch's default unless
``--threads`` says.

``python3 benchmarks/cpu_first_call.py [--runs 3]`` (CUDA is hidden from the runs).
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
if {threads}:
    torch.set_num_threads({threads})
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config()).eval()
ids = torch.randint(0, 50000, (1, 32))

def mem(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(key))

before = mem("VmRSS")
t = time.perf_counter()
if "{which}" == "graphwrap":
    import graphwrap
    out = graphwrap.GraphedModule(model).generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
else:
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
dt = time.perf_counter() - t
assert out.shape == (1, 64)
print(json.dumps({{"s": dt, "rss_before": before, "rss_after": mem("VmRSS"), "peak": mem("VmHWM")}}))
"""


def run(which: str, threads: int) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    got = subprocess.run([sys.executable, "-c", CHILD.format(which=which, threads=threads)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(got.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    rows = {"transformers": [], "graphwrap": []}
    for _ in range(a.runs):
        for which in rows:
            rows[which].append(run(which, a.threads))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    head = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "date": str(datetime.date.today()),
            "runs": a.runs}
    print(head)
    med = {}
    for which, rs in rows.items():
        s = [r["s"] for r in rs]
        peak = [r["peak"] for r in rs]
        after = [r["rss_after"] for r in rs]
        med[which] = {"s": statistics.median(s), "peak_mib": statistics.median(peak), "rss_after_mib": statistics.median(after)}
        print(f"{which}: first call {statistics.median(s):.2f} s ({min(s):.2f}-{max(s):.2f}), process memory after "
              f"{statistics.median(after):,.0f} MiB, peak {statistics.median(peak):,.0f} MiB "
              f"({min(peak):,.0f}-{max(peak):,.0f})")
    g, t = med["graphwrap"], med["transformers"]
    print(f"graphwrap against model.generate: time {g['s'] / t['s']:.2f}x, peak memory {g['peak_mib'] / t['peak_mib']:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**head, "runs_by_side": rows, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
