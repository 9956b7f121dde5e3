"""gm.generate of this graphwrap beside an earlier one, in one process: GPT-2 fp16, prompt 32,
end to end for 128 new tokens and for one (the prompt alone), batch 1 and 8, with the step
captured by hand beside them; rounds interleaved, medians with min and max.

``python benchmarks/diagnostics/decode_before_after.py PATH``: PATH holds the earlier package
as ``graphwrap_before/`` (as for ``before_after.py``).
"""

import statistics
import sys
import time

import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".old")
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import decode  # noqa: E402
import graphwrap_before  # noqa: E402

import graphwrap  # noqa: E402


def main(rounds=9):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    model = decode._model("gpt2", "cuda")
    for batch in (1, 8):
        ids = torch.randint(3, model.config.vocab_size, (batch, decode.PROMPT), device="cuda")
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, cache_implementation="static")
        after, before = graphwrap.GraphedModule(model), graphwrap_before.GraphedModule(model)
        hand = decode._by_hand(model, ids, decode.NEW)
        fns = {"after": lambda n: after.generate(**kw, max_new_tokens=n),
               "before": lambda n: before.generate(**kw, max_new_tokens=n),
               "by hand": hand}
        times = {(k, n): [] for k in fns for n in (decode.NEW, 1)}
        outs = {}
        with torch.no_grad():
            for k, fn in fns.items():  # warm: captures, caches of both sizes
                outs[k] = fn(decode.NEW)
                fn(1)
            for _ in range(rounds):
                for k, fn in fns.items():
                    for n in (decode.NEW, 1):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fn(n)
                        torch.cuda.synchronize()
                        times[(k, n)].append(time.perf_counter() - t0)
        same = torch.equal(outs["after"], outs["before"])
        print(f"\nbatch {batch}: ms end to end, median [min, max] of {rounds} rounds (after's tokens equal "
              f"before's: {same})")
        for (k, n), ts in times.items():
            print(f"  {k:8s} {n:4d} new tokens  {1e3 * statistics.median(ts):8.2f}  "
                  f"[{1e3 * min(ts):.2f}, {1e3 * max(ts):.2f}]")
        for k in fns:
            per = (statistics.median(times[(k, decode.NEW)]) - statistics.median(times[(k, 1)])) / (decode.NEW - 1)
            print(f"  {k:8s} ms a token (difference of the medians / {decode.NEW - 1}): {1e3 * per:.3f}")


if __name__ == "__main__":
    main()
