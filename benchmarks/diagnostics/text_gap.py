"""Where the seq_dim=1 path spends its time beside requests padded by hand (BERT-base fp16)."""
import cProfile
import os
import pstats
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."), "."]
import torch
import transformers
from text import padded_by_hand, workload

import graphwrap

torch.manual_seed(0)
cfg = transformers.BertConfig()
model = transformers.BertModel(cfg).cuda().half().eval()
reqs = workload(cfg.vocab_size, "cuda", 300)
hand = padded_by_hand(reqs)
seq = graphwrap.GraphedModule(model, seq_dim=1)
one = graphwrap.GraphedModule(model)
def loop(fn, rs):
    with torch.no_grad():
        for r in rs:
            fn(**r)
for _ in range(2):
    loop(seq, reqs); loop(one, hand)
ts = {"seq": [], "hand": []}
for _ in range(5):
    for name, fn, rs in (("seq", seq, reqs), ("hand", one, hand)):
        torch.cuda.synchronize(); t0 = time.perf_counter(); loop(fn, rs); torch.cuda.synchronize()
        ts[name].append(time.perf_counter() - t0)
print({k: [round(v, 4) for v in sorted(x)] for k, x in ts.items()})
for name, g in (("seq", seq), ("hand", one)):
    s = g.stats()
    bs = [b for k in s["keys"] for b in k["buckets"].values()]
    print(name, "eager_calls", s["eager_calls"], "by choice", s["eager_by_choice"], "buckets", len(bs),
          "eager buckets", [(b["batch"], b["seq"], b["graph_us"], b["eager_us"]) for b in bs if b["serves"] == "eager"],
          "padded rows", round(s["padded_share"], 3), "tokens", round(s["padded_token_share"], 3))
for name, fn, rs in (("seq", seq, reqs), ("hand", one, hand)):
    torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable(); loop(fn, rs); torch.cuda.synchronize(); pr.disable()
    print("==", name); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
