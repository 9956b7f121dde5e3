"""BERT-base fp16, requests of every length through GraphedModule(m, seq_dim=1), every answer
checked against eager; run with CUDA_LAUNCH_BLOCKING=1 to find a failing kernel."""
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "."]
import logging

import torch
import transformers

logging.basicConfig(level=logging.INFO, format="%(message)s")
from text import workload

import graphwrap

torch.manual_seed(0)
cfg = transformers.BertConfig()
model = transformers.BertModel(cfg).cuda().half().eval()
reqs = workload(cfg.vocab_size, "cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 60)
gm = graphwrap.GraphedModule(model, seq_dim=1)
with torch.no_grad():
    for i, r in enumerate(reqs):
        got = gm(**r)
        want = model(**r)
        err = float((got.last_hidden_state - want.last_hidden_state).abs().max())
        if err > 0.05:
            print("MISMATCH", i, tuple(r["input_ids"].shape), err)
print("done", gm.stats()["eager_calls"], round(gm.stats()["padded_token_share"], 3))
