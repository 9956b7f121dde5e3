"""``model.generate`` alone on a 7-8B shape (fp16, random weights; the generate-large baseline):
tokens/s for one request of 16 and of 1,000 prompt tokens, 64 new each, in a fresh process and
nothing else running, and the GPU's kernels' share of one such call's wall time (the rest is the
host launching them).

``python3 benchmarks/diagnostics/generate_alone.py [--model llama2-7b]`` from the repository root,
on a GPU.
"""

import argparse
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/diagnostics")
from generate_large import big_model  # noqa: E402
from step_profile import kernels, say_kernels  # noqa: E402

DEV = torch.device("cuda")


def rate(model, prompt: int, new: int = 64) -> float:
    ids = torch.randint(3, 1000, (1, prompt), device=DEV)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    return new / (time.perf_counter() - t0)


def main():
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--no-cudnn", action="store_true", help="torch's cuDNN attention turned off for the run")
    a = ap.parse_args()
    if a.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    print(f"generate_alone {a.model}: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    model = big_model(a.model, DEV)
    print(f"attention: {model.config._attn_implementation}", flush=True)
    rate(model, 16, 4)
    for prompt in (16, 1000, 16, 1000):
        print(f"  prompt {prompt}: {rate(model, prompt):.1f} tokens/s", flush=True)
    ids = torch.randint(3, 1000, (1, 16), device=DEV)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=16, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    by_kind, top = kernels(prof)
    say_kernels("one model.generate, 16 new tokens, under the profiler", by_kind, top[:6], 1e6 * wall)


if __name__ == "__main__":
    main()
