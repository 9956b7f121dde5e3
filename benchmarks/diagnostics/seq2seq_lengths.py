"""Encoder-decoder requests of many lengths: gm.generate of this graphwrap beside an earlier one
in one process, and transformers' eager loop. BART-base-shaped (6 + 6 layers, 768 wide), random
weights, fp16, 24 requests of 4 rows, encoder lengths drawn from 8 to 120 tokens, 32 new tokens
each; seconds for the 24 requests, a first pass (captures included) and a second, the tokens
compared with the eager loop's, and each GraphedModule's caches, graph keys and eager calls.

``python benchmarks/diagnostics/seq2seq_lengths.py PATH``: PATH holds the earlier package as
``graphwrap_before/`` (as for ``before_after.py``).
"""

import sys
import time

import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".old")
sys.path.insert(0, ".")
import graphwrap_before  # noqa: E402

import graphwrap  # noqa: E402

NEW, ROWS = 32, 4


def main():
    import transformers

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    torch.manual_seed(0)
    cfg = transformers.BartConfig(forced_eos_token_id=None)  # bart-base's shape
    model = transformers.BartForConditionalGeneration(cfg).cuda().half().eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 121, (24,), generator=g).tolist()
    requests = []
    for n in lengths:
        ids = torch.randint(3, cfg.vocab_size, (ROWS, n), generator=g).cuda()
        requests.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False))
    print(f"encoder lengths: {sorted(lengths)} ({len(set(lengths))} distinct)")
    after, before = graphwrap.GraphedModule(model), graphwrap_before.GraphedModule(model)
    runs = {"eager loop": lambda kw: model.generate(**kw, cache_implementation="static", disable_compile=True),
            "after": lambda kw: after.generate(**kw, cache_implementation="static"),
            "before": lambda kw: before.generate(**kw, cache_implementation="static")}
    outs = {}
    with torch.no_grad():
        for name, fn in runs.items():
            for p in ("first pass", "second pass"):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs[name] = [fn(kw) for kw in requests]
                torch.cuda.synchronize()
                print(f"  {name:10s} {p}: {time.perf_counter() - t0:.3f} s", flush=True)
    for name in ("after", "before"):
        same = sum(torch.equal(a, b) for a, b in zip(outs[name], outs["eager loop"]))
        gm = after if name == "after" else before
        s = gm.stats()
        caches = [k for k in gm.__dict__.get("_gw_caches", {}) if k[0] == "seq2seq"]
        print(f"  {name}: {same} of {len(requests)} requests' tokens equal to the eager loop's; {len(caches)} caches "
              f"(cross-attention lengths {sorted(k[3] for k in caches)}), {len(s['keys'])} graph keys, eager calls "
              f"{s['eager_calls']}")


if __name__ == "__main__":
    main()
