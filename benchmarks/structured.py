"""Structured output in the shared batch: is every constrained output valid, and what does a
constraint cost the batch?

- ``validity``: random JSON schemas (objects, arrays, enums, bounded integers and numbers, strings,
  nesting, required fields), each a sampled call with ``grammar=Grammar.json_schema(...)``; every
  output that ends (its end-of-sequence token) must parse and validate (``jsonschema``); outputs
  cut by ``max_new_tokens`` are counted apart (a model of random weights can write a long string).
- ``overhead``: ``--concurrent`` calls in the batch at once, a quarter of them constrained by a
  schema, against the same calls with none: output tokens per second of the whole batch, and of
  the unconstrained calls alone (the rows beside a constrained one), medians of ``--repeats``.
  With ``--eager-sampler``, both again with the sampler's graphs set aside (each step's sampling
  launched op by op, as before they were made), in the same process.

Runs on a CPU (the tiny model of tests/tiny_lm.py) or a GPU (``--shape llama-1b``: the 1.1B Llama
shape, random weights, fp16, with a byte-level BPE tokenizer of ``--vocab`` tokens trained on the
spot on random JSON text, so that the masks are a real vocabulary's size).
"""

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
NAMES = ["id", "name", "size", "tags", "ok", "score", "items", "kind", "x", "y", "note", "level"]
WORDS = ["red", "green", "blue", "small", "large", "on", "off", "alpha", "beta"]


def random_schemas(n: int, seed: int = 0) -> List[Dict[str, Any]]:
    """``n`` schemas of objects, seeded: what models are asked for in practice, nested up to 3 deep."""
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]


def _object(rng: random.Random, depth: int) -> Dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(1, 4))
    props = {k: _value(rng, depth + 1) for k in names}
    required = [k for k in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> Dict[str, Any]:
    kinds = ["integer", "number", "boolean", "enum", "string", "string"] + (["object", "array"] if depth < 3 else [])
    k = rng.choice(kinds)
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if k == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if k == "string":
        return {"type": "string", "maxLength": rng.randint(1, 16)} if rng.random() < 0.7 else {"type": "string"}
    if k == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 3)}
    return _object(rng, depth)


def validity(gm, tok, schemas: List[dict], max_new_tokens: int, device="cpu", prompt: str = "the quick brown fox",
             seed: int = 0) -> dict:
    """Each schema a sampled call, all queued at once: how many ended, how many were cut, and
    every ended output that does not parse or validate (``(schema, text, error)``)."""
    import jsonschema
    import torch

    from graphwrap import Grammar

    torch.manual_seed(seed)
    p = torch.tensor([tok.encode(prompt)], device=device)
    futures = [gm.submit_generate(p, grammar=Grammar.json_schema(s), tokenizer=tok, max_new_tokens=max_new_tokens,
                                  do_sample=True) for s in schemas]
    ended, cut, invalid = 0, 0, []
    for s, f in zip(schemas, futures):
        out = f.result(timeout=600)[0, p.shape[1]:].tolist()
        if out[-1] != tok.eos_token_id:
            cut += 1
            continue
        ended += 1
        text = tok.decode(out, skip_special_tokens=True)
        try:
            jsonschema.validate(json.loads(text), s)
        except Exception as e:  # noqa: BLE001 - every way an output is wrong is a finding
            invalid.append((s, text, f"{type(e).__name__}: {str(e).splitlines()[0]}"))
    return {"schemas": len(schemas), "ended": ended, "cut": cut, "invalid": invalid}


class Times:
    """A streamer that keeps when each token came (the prompt's ``put`` first, left out)."""

    def __init__(self):
        self.at: List[float] = []
        self.prompt = True

    def put(self, value):
        if self.prompt:
            self.prompt = False
            return
        self.at.append(time.perf_counter())

    def end(self):
        pass

    def tpot(self):
        return (self.at[-1] - self.at[0]) / (len(self.at) - 1) if len(self.at) > 1 else None


OVERHEAD_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "items": {"type": "array", "items": {"type": "integer"}},
    "notes": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "items", "notes"],
    "additionalProperties": False}


def burst(gm, tok, n: int, constrained: int, new: int, vocab: int, device: str, seed: int,
          streamers: bool = False) -> dict:
    """``n`` calls at once (the first ``constrained`` with OVERHEAD_SCHEMA), prompts of 64 random
    ids, ``new`` tokens each (the unconstrained ones ignore the end): the burst's time per step
    (its wall time over its steps: every call takes ``new`` steps), and with ``streamers`` each
    call's time per output token as a streamer of its own sees it (its Python on the delivery
    workers then competes with the decode thread for the GIL, as no server's streams do)."""
    import torch

    from graphwrap import Grammar

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, min(vocab, len(tok)), (n, 64), generator=g)
    calls = []
    before = gm.stats().get("decode") or {"steps": 0, "thread_s": {}}
    t0 = time.perf_counter()
    for i in range(n):
        times = Times()
        kw: Dict[str, Any] = dict(max_new_tokens=new, do_sample=True, **({"streamer": times} if streamers else {}))
        if i < constrained:
            kw.update(grammar=Grammar.json_schema(OVERHEAD_SCHEMA), tokenizer=tok)
        else:
            kw.update(eos_token_id=None, pad_token_id=0)
        calls.append((times, gm.submit_generate(prompts[i:i + 1].to(device), **kw)))
    made = sum(f.result(timeout=600).shape[1] - 64 for _, f in calls)
    wall = time.perf_counter() - t0
    after = gm.stats()["decode"]
    steps = after["steps"] - before["steps"]
    # (the decode thread's seconds by part, per step: where a step's time goes on the host)
    parts = {k: 1e3 * (v - before["thread_s"].get(k, 0.0)) / max(1, steps) for k, v in after["thread_s"].items()}
    plain = [t.tpot() for t, _ in calls[constrained:] if t.tpot() is not None]
    bound = [t.tpot() for t, _ in calls[:constrained] if t.tpot() is not None]
    # Each sequence's time per output token as the batch records it (first token to last), the
    # burst's n: the steps' pace without the burst's start (submits, grammars, prefills).
    tpot = list(gm.__dict__["_gw_decode"].tpot)[-n:]
    return {"wall_s": wall, "tokens_per_s": made / wall, "ms_per_step": 1e3 * wall / max(1, steps),
            "tpot_ms_batch": 1e3 * statistics.median(tpot) if tpot else None,
            "tpot_ms_plain": 1e3 * statistics.median(plain) if plain else None,
            "tpot_ms_constrained": 1e3 * statistics.median(bound) if bound else None,
            "constrained_tokens": [len(t.at) for t, _ in calls[:constrained]], "steps": steps,
            "thread_ms_per_step": {k: round(v, 3) for k, v in parts.items()}}


class HostClock:
    """Seconds the decode thread spends in the parts of a step, summed while it is installed: the
    grammar's host work (RowMasks.fill), applying the masks (RowMasks.apply: launches only), the
    forward (captures.forward: a graph's replay launched), the sampler (RowSettings.next_tokens:
    launches), queueing the tokens' copy (Tokens.queue), and handing out each token read
    (outputs.token, per token)."""

    def __init__(self):
        from graphwrap.decoding.engine import captures, outputs
        from graphwrap.decoding.engine.grammar import RowMasks
        from graphwrap.decoding.engine.inflight import Tokens
        from graphwrap.decoding.engine.sampling import RowSettings

        places = {"fill": RowMasks, "apply": RowMasks, "next_tokens": RowSettings, "queue": Tokens,
                  "token": outputs, "forward": captures}
        self.spent = dict.fromkeys(places, 0.0)
        self.calls = dict.fromkeys(places, 0)
        for name, owner in places.items():
            setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name, fn):
        def run(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.spent[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return run

    def take(self) -> Dict[str, float]:
        out = {f"{k}_ms_per_call": round(1e3 * v / max(1, self.calls[k]), 4) for k, v in self.spent.items()}
        out.update({f"{k}_calls": c for k, c in self.calls.items()})
        self.spent = dict.fromkeys(self.spent, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)
        return out


def make_tokenizer(path: str, vocab: int) -> str:
    """A byte-level BPE tokenizer of about ``vocab`` tokens trained on random words and JSON (no
    network), saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(60000)]
    text = [" ".join(rng.choice(words) for _ in range(40)) + ' {"k": [1, 2], "s": "x"}' for _ in range(20000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tok.save_pretrained(path)
    return path


def load(a):
    """``(gm, tokenizer, device)`` of ``--shape``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from graphwrap import GraphedModule

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.shape == "tiny":
        import tiny_lm

        d = tiny_lm.make(tempfile.mkdtemp(), positions=1024)
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d).to(device).eval()
    else:
        tok = AutoTokenizer.from_pretrained(make_tokenizer(tempfile.mkdtemp(), a.vocab))
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, bos_token_id=0,
                          eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
        model = model.half().eval() if device == "cuda" else model.eval()
        for p in model.parameters():  # small weights: logits of random models stay finite in fp16
            torch.nn.init.normal_(p, std=0.02)
    gm = GraphedModule(model, decode={"rows": a.rows, "max_len": 1024})
    return gm, tok, device


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=("tiny", "llama-1b"))
    ap.add_argument("--vocab", type=int, default=32000, help="the tokenizer's tokens (llama-1b)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--schemas", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=600)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--new", type=int, default=128, help="tokens each call of the overhead bursts makes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--streamers", action="store_true", help="each call of the bursts with a Python streamer")
    ap.add_argument("--skip", default="", help="validity or overhead: a part not to run")
    ap.add_argument("--eager-sampler", action="store_true",
                    help="the overhead bursts also with the sampler eager (its graphs set aside), in the same process")
    ap.add_argument("--fill-threads", action="store_true", help="the constrained bursts also with eight fill threads")
    ap.add_argument("--out", default=None, help="a JSON file of the results")
    a = ap.parse_args(argv)
    import torch

    gm, tok, device = load(a)
    res: Dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "torch": torch.__version__, "date": datetime.date.today().isoformat(), "shape": a.shape,
                           "tokenizer_tokens": len(tok)}
    if "validity" not in a.skip:
        t0 = time.perf_counter()
        v = validity(gm, tok, random_schemas(a.schemas), a.max_new_tokens, device)
        v["seconds"] = time.perf_counter() - t0
        print(f"validity: {v['schemas']} schemas, {v['ended']} ended, {v['cut']} cut at {a.max_new_tokens} tokens, "
              f"{len(v['invalid'])} invalid ({v['seconds']:.1f} s)")
        for s, text, err in v["invalid"][:5]:
            print("  invalid:", err, json.dumps(s)[:200], repr(text[:200]))
        res["validity"] = v
    if "overhead" not in a.skip:
        quarter = a.concurrent // 4
        burst(gm, tok, a.concurrent, quarter, a.new, 32000, device, seed=99)  # warm-up: graphs, compiles
        clock = HostClock()
        masks = gm.__dict__["_gw_decode"].settings.masks
        import xgrammar

        from graphwrap.decoding.engine.grammar import FILL_THREADS

        settings = gm.__dict__["_gw_decode"].settings
        graphs = settings.graphs  # (None on a CPU: the sampler is eager there)
        kinds = [("none", 0, 1), ("quarter", quarter, 1)]
        if a.eager_sampler and graphs is not None:
            kinds += [("none, eager sampler", 0, 1), ("quarter, eager sampler", quarter, 1)]
        if a.fill_threads:
            kinds.append(("quarter-8-threads", quarter, 8))
        runs: Dict[str, List[dict]] = {name: [] for name, _, _ in kinds}
        for r in range(a.repeats):
            for name, k, threads in kinds:
                masks.batch = xgrammar.BatchGrammarMatcher(threads if threads > 1 else FILL_THREADS)
                settings.graphs = None if "eager sampler" in name else graphs
                got = burst(gm, tok, a.concurrent, k, a.new, 32000, device, seed=r, streamers=a.streamers)
                got["grammar_host"] = clock.take()
                runs[name].append(got)
        res["overhead"] = runs
        for name in runs:
            ms = [x["ms_per_step"] for x in runs[name]]
            tps = [x["tokens_per_s"] for x in runs[name]]
            tp = [x["tpot_ms_batch"] for x in runs[name] if x["tpot_ms_batch"] is not None]
            print(f"{name:8s} ms per step {statistics.median(ms):.2f} [{min(ms):.2f}-{max(ms):.2f}]"
                  f"  batch {statistics.median(tps):,.0f} tok/s [{min(tps):,.0f}-{max(tps):,.0f}]"
                  f"  TPOT {statistics.median(tp):.2f} ms [{min(tp):.2f}-{max(tp):.2f}]")
            print(f"{'':8s} decode thread ms per step (last run): {runs[name][-1]['thread_ms_per_step']}; "
                  f"parts {runs[name][-1]['grammar_host']}")
        ratio = (statistics.median(x["ms_per_step"] for x in runs["quarter"])
                 / statistics.median(x["ms_per_step"] for x in runs["none"]))
        print(f"time per step (every call's time per output token), a quarter constrained / none: {ratio:.3f}")
        res["step_ratio"] = ratio
        tpot = {name: statistics.median(x["tpot_ms_batch"] for x in runs[name]) for name in runs}
        res["tpot_ratio"] = tpot["quarter"] / tpot["none"]
        print(f"TPOT as the batch records it, a quarter constrained / none: {res['tpot_ratio']:.3f}")
        if "quarter, eager sampler" in runs:
            eager = (statistics.median(x["ms_per_step"] for x in runs["quarter, eager sampler"])
                     / statistics.median(x["ms_per_step"] for x in runs["none, eager sampler"]))
            res["step_ratio_eager_sampler"] = eager
            res["tpot_ratio_eager_sampler"] = tpot["quarter, eager sampler"] / tpot["none, eager sampler"]
            print(f"the same with the eager sampler: {eager:.3f} a step, {res['tpot_ratio_eager_sampler']:.3f} TPOT")
        if graphs is not None:
            res["sampler_graphs"] = dict(graphs.counts, graphs=len(graphs.entries))
            print("sampler graphs:", res["sampler_graphs"])
    gm.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
