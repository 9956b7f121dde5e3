"""Scenario "prefix": the shared batch with prefix caching on and off, side by side in one process.

Three workloads (issue 75's), each with ``decode={"prefix_caching": False}`` then ``True``, on
one model, every request submitted at once through ``gm.submit_generate`` with a streamer that
notes its first token's time:

- ``shared``: ``--groups`` groups of ``--per-group`` prompts, each group with its own system
  prompt of ``--prefix-len`` tokens, then a question of ``--question-len`` tokens, ``--new``
  new tokens each;
- ``turns``: ``--conversations`` conversations of ``--turns`` turns, each turn's prompt the last
  prompt, its answer and a new question of 64 tokens (each turn's requests sent at once, the
  turns one after another);
- ``random``: as many prompts of ``--prefix-len`` + ``--question-len`` random tokens, nothing
  shared (what caching costs where it finds nothing).

Each setting is one GraphedModule that runs its workload once to warm up (its first run,
captures included, reported apart), then ``--repeats`` times; each run draws prompts of its own
(run ``i`` from seed ``i``, the same in both settings), so no run finds an earlier run's
prefixes: what it hits, it wrote itself. Output tokens/s and time to first token p50, medians
with their spread, and the hits ``stats()`` reports. Greedy, no end-of-sequence token; the first requests' tokens are
compared between the settings.

``--piece-budgets 0,2048`` runs each workload with one piece a turn and again with a turn's
pieces up to 2,048 positions (``pieces.BUDGET``), in the same process.

``python3 benchmarks/prefix.py [--model llama3-8b] [--workloads shared,turns,random]`` on a GPU;
``--model tiny`` with small sizes runs on a CPU (a smoke run: its times say nothing).
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graphwrap import GraphedModule  # noqa: E402
from graphwrap.decoding.engine import pieces  # noqa: E402


class First:
    """A streamer that notes when its first new token came (the prompt comes first)."""

    def __init__(self):
        self.calls, self.at = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self):
        pass


def model_of(name: str, device):
    if name == "tiny":
        import transformers

        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                       max_position_embeddings=1024, eos_token_id=None, pad_token_id=0)
        return transformers.LlamaForCausalLM(cfg).to(device).eval()
    from generate_large import big_model

    return big_model(name, device)


def _ids(g, n, vocab):
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def shared(a, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(a.groups):
        system = _ids(g, a.prefix_len, vocab)
        out += [system + _ids(g, a.question_len, vocab) for _ in range(a.per_group)]
    return out


def unshared(a, vocab, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    return [_ids(g, a.prefix_len + a.question_len, vocab) for _ in range(a.groups * a.per_group)]


def _agree(x: torch.Tensor, y: torch.Tensor, new: int) -> int:
    """How many of the ``new`` tokens that end two outputs of one prompt agree before they part."""
    x, y = x.flatten().tolist(), y.flatten().tolist()
    parted = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    return max(0, parted - (len(x) - new))


def burst(gm, prompts, new, device):
    """Every prompt at once: (seconds, time to first token of each, outputs)."""
    clocks = [First() for _ in prompts]
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    futs = [gm.submit_generate(torch.tensor([p], device=device), max_new_tokens=new, do_sample=False, streamer=c)
            for p, c in zip(prompts, clocks)]
    outs = [f.result() for f in futs]
    dt = time.perf_counter() - t0
    return dt, [c.at - t0 for c in clocks if c.at is not None], outs


def run_turns(gm, a, vocab, device, seed):
    """The conversations' turns one after another: (seconds, first-token times, tokens made)."""
    g = torch.Generator().manual_seed(2000 + seed)
    prompts = [_ids(g, a.prefix_len, vocab) for _ in range(a.conversations)]
    seconds, ttft, made, first = 0.0, [], 0, None
    for _ in range(a.turns):
        dt, t, outs = burst(gm, prompts, a.new, device)
        seconds, ttft, made = seconds + dt, ttft + t, made + a.new * len(prompts)
        first = first if first is not None else outs
        prompts = [o[0].tolist() + _ids(g, 64, vocab) for o in outs]
    return seconds, ttft, made, first


def one(model, a, workload: str, caching: bool, device) -> dict:
    vocab = model.config.vocab_size
    runs = []
    first_outs = None
    gm = GraphedModule(model, decode={"prefix_caching": caching})
    for i in range(1 + a.repeats):
        if workload == "turns":
            seconds, ttft, made, outs = run_turns(gm, a, vocab, device, i)
        else:
            prompts = shared(a, vocab, i) if workload == "shared" else unshared(a, vocab, i)
            seconds, ttft, outs = burst(gm, prompts, a.new, device)
            made = a.new * len(prompts)
        c = (gm.stats()["decode"] or {}).get("prefix_cache") or {}
        hits, queries = c.get("prefix_cache_hits", 0), c.get("prefix_cache_queries", 0)
        runs.append({"seconds": seconds, "tokens_s": made / seconds, "ttft_p50_ms": 1e3 * statistics.median(ttft),
                     "hits": hits - sum(r["hits"] for r in runs), "queries": queries - sum(r["queries"] for r in runs)})
        first_outs = first_outs if first_outs is not None else [o.cpu() for o in outs[:4]]
    gm.close()
    del gm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    warm = runs[1:]
    out = {"workload": workload, "caching": caching, "first_run": runs[0], "runs": warm,
           "tokens_s": statistics.median(r["tokens_s"] for r in warm),
           "tokens_s_spread": [min(r["tokens_s"] for r in warm), max(r["tokens_s"] for r in warm)],
           "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in warm), "hits": warm[-1]["hits"],
           "queries": warm[-1]["queries"]}
    print(f"{workload} caching={'on' if caching else 'off'}: {out['tokens_s']:,.0f} tokens/s "
          f"({out['tokens_s_spread'][0]:,.0f}-{out['tokens_s_spread'][1]:,.0f}), time to first token p50 "
          f"{out['ttft_p50_ms']:.0f} ms; hits {out['hits']:,} of {out['queries']:,} prompt tokens; first run "
          f"{runs[0]['tokens_s']:,.0f} tokens/s", flush=True)
    return out, first_outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--workloads", default="shared,turns,random")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--piece-budgets", default="0",
                    help="comma-separated pieces.BUDGET values, each run with caching off and on (0: one piece a turn)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model_of(a.model, device)
    head = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "date": str(datetime.date.today()), "args": vars(a)}
    print(head, flush=True)
    results = []
    for w, budget in [(w, int(b)) for w in a.workloads.split(",") for b in a.piece_budgets.split(",")]:
        pieces.BUDGET = budget or None
        print(f"{w}: pieces.BUDGET {pieces.BUDGET}", flush=True)
        off, want = one(model, a, w, False, device)
        on, got = one(model, a, w, True, device)
        same = all(torch.equal(x, y) for x, y in zip(want, got))
        agree = [_agree(x, y, a.new) for x, y in zip(want, got)]
        print(f"{w}: caching on against off: {on['tokens_s'] / off['tokens_s']:.2f}x tokens/s, time to first token "
              f"{off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x lower; the first {len(agree)} requests' new tokens "
              f"agree for {agree} (of {a.new}; fp16 near-ties part them, caching on or not)", flush=True)
        results.append({"piece_budget": budget, "off": off, "on": on, "same_tokens": same,
                        "new_tokens_agreeing": agree})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({**head, "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
