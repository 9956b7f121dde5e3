"""A serving benchmark of any OpenAI-compatible server (graphwrap's, ``transformers serve``, ...),
with the metrics as ``vllm bench serve`` defines them.

    python3 benchmarks/bench_serve.py --url http://127.0.0.1:8000 --dataset random \\
        --input-len 128 --output-len 128 --num-prompts 256 --concurrency 256

Datasets (each drawn from ``--seed``, the same for every server):
- ``random``: every prompt ``--input-len`` tokens, every answer ``--output-len`` tokens (the end
  of sequence ignored: ``ignore_eos`` and ``min_tokens``, as vLLM's random dataset does);
- ``sharegpt``: a synthetic spread of lengths like ShareGPT's (input and output lengths drawn
  from log-normal laws, medians ``--input-len`` and ``--output-len``, clipped to the context);
- ``prefix``: ``--groups`` groups of ``--per-group`` prompts, each group with its own system
  prompt of ``--prefix-len`` tokens, then a question of ``--input-len`` tokens of its own, in a
  shuffled order; every answer ``--output-len`` tokens (the end of sequence ignored too).

Prompts go as token ids (``/v1/completions`` takes them; ``--prompt-form text`` sends the
``--tokenizer``'s decoding of the same ids, for a server that takes text alone). Requests are
sent at ``--request-rate`` a second (Poisson arrivals; ``inf``: all at once), at most
``--concurrency`` at a time. Every request is a stream with its usage asked for.

``--start NAME --model-dir DIR`` starts one of ``serve_openai.py``'s servers over ``DIR`` first
(``graphwrap``, ``transformers``, ``transformers-graphs``, ...; ``--make-model SHAPE`` makes DIR
with random weights) and stops it after; ``--url`` is then its address.

Per request: TTFT (the first chunk with text), the gaps between its chunks (ITL), its TPOT
(the time after the first token over the tokens after it) and its E2E latency; output tokens are
the usage the server reports. The report: output tokens/s and requests/s over the run's wall
time, mean, median and p99 of TTFT, TPOT, ITL and E2E, and the requests that failed (status,
error event, or a stream cut short), with the first few reasons.
"""

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass
class Request:
    prompt: List[int]
    output_len: int


@dataclass
class Outcome:
    ok: bool = False
    error: Optional[str] = None
    ttft: Optional[float] = None
    itl: List[float] = field(default_factory=list)
    e2e: float = 0.0
    tokens: int = 0


# ---------------------------------------------------------------------------- datasets

def dataset(name: str, n: int, seed: int, vocab: int, context: int, input_len: int, output_len: int,
            prefix_len: int = 0, groups: int = 0, per_group: int = 0, low: int = 3) -> List[Request]:
    """The requests of a dataset (token ids drawn from ``[low, vocab)``)."""
    rng = random.Random(seed)

    def ids(k: int) -> List[int]:
        return [rng.randrange(low, vocab) for _ in range(k)]

    if name == "random":
        return [Request(ids(input_len), output_len) for _ in range(n)]
    if name == "sharegpt":
        out = []
        for _ in range(n):
            i = int(min(max(4, rng.lognormvariate(math.log(input_len), 0.9)), context // 2))
            o = int(min(max(4, rng.lognormvariate(math.log(output_len), 0.9)), context - i))
            out.append(Request(ids(i), o))
        return out
    if name == "prefix":
        out = []
        for _ in range(groups):
            system = ids(prefix_len)
            out += [Request(system + ids(input_len), output_len) for _ in range(per_group)]
        rng.shuffle(out)
        return out
    raise SystemExit(f"unknown dataset {name!r}")


# ---------------------------------------------------------------------------- one request

async def _body(reader, timeout: float):
    """The response's body as it comes, piece by piece (HTTP/1.1: chunked, or up to its end)."""
    headers = {}
    while True:
        line = await asyncio.wait_for(reader.readline(), timeout)
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip().lower()
    if headers.get("transfer-encoding") == "chunked":
        while True:
            size = int((await asyncio.wait_for(reader.readline(), timeout)).split(b";")[0], 16)
            if size == 0:
                return
            data = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
            yield data[:-2]
    else:
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout)
            if not data:
                return
            yield data


async def one(host: str, port: int, model: str, req: Request, text_of, ignore_eos: bool, timeout: float,
              api_key: Optional[str]) -> Outcome:
    body: Dict = {"model": model, "prompt": text_of(req.prompt), "max_tokens": req.output_len, "temperature": 0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body.update(ignore_eos=True, min_tokens=req.output_len)
    raw = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    out = Outcome()
    t0 = time.perf_counter()
    last = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (host.encode(), auth, len(raw)) + raw)
        status = await asyncio.wait_for(reader.readline(), timeout)
        code = int(status.split()[1]) if len(status.split()) > 1 else 0
        done, finished, held, whole = False, False, b"", b""
        async for data in _body(reader, timeout):
            if code != 200:
                whole += data
                continue
            held += data
            while b"\n" in held and not done:
                line, held = held.split(b"\n", 1)
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = f"error event: {event['error'].get('message')}"
                    continue
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
                finished = finished or any(c.get("finish_reason") for c in event.get("choices") or ())
                if any(c.get("text") for c in event.get("choices") or ()):
                    now = time.perf_counter()
                    if out.ttft is None:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last = now
            if done:
                break
        writer.close()
        if code != 200:
            out.error = f"{code}: {whole.decode(errors='replace')[:200]}"
        elif not done and not finished and out.error is None:  # (a body ended whole after its finish: no [DONE]
            out.error = "the stream ended before its finish"         # is needed, and transformers serve sends none)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.e2e = time.perf_counter() - t0
    out.ok = out.error is None
    return out


async def run(url: str, model: str, reqs: List[Request], text_of, rate: float, concurrency: int, seed: int,
              ignore_eos: bool, timeout: float, api_key: Optional[str]):
    host, port = url.split("//")[1].split("/")[0].split(":")
    limit = asyncio.Semaphore(concurrency)
    rng = random.Random(seed + 1)

    async def limited(r: Request) -> Outcome:
        async with limit:
            return await one(host, int(port), model, r, text_of, ignore_eos, timeout, api_key)

    tasks = []
    t0 = time.perf_counter()
    for r in reqs:
        tasks.append(asyncio.ensure_future(limited(r)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    outcomes = await asyncio.gather(*tasks)
    return list(outcomes), time.perf_counter() - t0


# ---------------------------------------------------------------------------- the report

def _stats(xs: List[float]) -> Dict[str, Optional[float]]:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    s = sorted(xs)
    return {"mean": 1e3 * statistics.fmean(s), "median": 1e3 * statistics.median(s),
            "p99": 1e3 * s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]}


def report(outcomes: List[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    tpot = [(o.e2e - o.ttft) / (o.tokens - 1) for o in ok if o.ttft is not None and o.tokens > 1]
    errors = [o.error for o in outcomes if not o.ok]
    chunked = [o for o in ok if o.ttft is not None]
    return {
        "completed": len(ok), "failed": len(errors), "wall_s": wall,
        "output_tokens": sum(o.tokens for o in ok),
        "output_tokens_per_s": sum(o.tokens for o in ok) / wall if wall else None,
        "requests_per_s": len(ok) / wall if wall else None,
        "ttft_ms": _stats([o.ttft for o in ok if o.ttft is not None]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for o in ok for g in o.itl]),
        # (ITL is between chunks with text: where a server sends several tokens a chunk, as a
        # stream behind the engine gets them, its gaps are fewer and longer than TPOT says)
        "tokens_per_chunk": (sum(o.tokens for o in chunked) / sum(1 + len(o.itl) for o in chunked)
                             if chunked else None),
        "e2e_ms": _stats([o.e2e for o in ok]),
        "errors": errors[:10],
    }


def _line(name: str, s: Dict[str, Optional[float]]) -> str:
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return f"  {name:5s} mean {f(s['mean']):>9s}  median {f(s['median']):>9s}  p99 {f(s['p99']):>9s} ms"


def print_report(r: dict, title: str):
    print(title)
    print(f"  {r['completed']} completed, {r['failed']} failed in {r['wall_s']:.2f} s: "
          f"{r['output_tokens_per_s']:.1f} output tokens/s, {r['requests_per_s']:.2f} requests/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(_line(name.upper(), r[f"{name}_ms"]))
    if r.get("tokens_per_chunk") is not None:
        print(f"  {r['tokens_per_chunk']:.2f} tokens a chunk of text (ITL is between chunks)")
    if r.get("prefix_cache_hit_rate") is not None:
        print(f"  prefix cache: {100 * r['prefix_cache_hit_rate']:.1f}% of the prompt tokens found cached")
    for e in r["errors"][:5]:
        print(f"  failed: {e}")


def served_model(url: str, api_key: Optional[str]) -> dict:
    req = urllib.request.Request(url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"][0]


def prefix_counts(url: str, api_key: Optional[str]) -> Optional[Tuple[float, float]]:
    """The prompt tokens the server's prefix cache was asked for and found, from its ``/metrics``
    (summed over its engines), where it reports them."""
    req = urllib.request.Request(url.rstrip("/") + "/metrics",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    got = {"graphwrap_prefix_cache_queries": 0.0, "graphwrap_prefix_cache_hits": 0.0}
    seen = False
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
            seen = True
    return (got["graphwrap_prefix_cache_queries"], got["graphwrap_prefix_cache_hits"]) if seen else None


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="the server's base URL, http://HOST:PORT")
    ap.add_argument("--start", default=None, help="a server of serve_openai.py's to start over --model-dir")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--make-model", default=None, help="a shape of serve_openai.py's, made into --model-dir")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--model", default=None, help="the model name to ask for (default: the first /v1/models lists)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--dataset", default="random", choices=("random", "sharegpt", "prefix"))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=2048)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=None, help="token ids are drawn below this (default: the tokenizer's "
                                                            "size, else 1000)")
    ap.add_argument("--context", type=int, default=None, help="default: the server's max_model_len, else 2048")
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prompt-form", default="ids", choices=("ids", "text"))
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder: text prompts (--prompt-form text)")
    ap.add_argument("--no-ignore-eos", action="store_true", help="let answers end at the end of sequence")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--warmup", type=int, default=0, help="requests sent (and not counted) before the run")
    ap.add_argument("--repeats", type=int, default=1, help="runs, each of prompts of its own (seed + 100 i); past "
                    "one, the first is reported apart and the rest by their median")
    ap.add_argument("--out", default=None, help="a JSON file for the report")
    a = ap.parse_args(argv)
    if a.start is None:
        if a.url is None:
            raise SystemExit("--url, or --start with --model-dir")
        return _bench(a)
    import subprocess

    import serve_openai

    if a.make_model:
        import torch

        serve_openai.make_model(a.make_model, a.model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    log = open(os.path.join(os.path.dirname(a.out or os.path.abspath(a.model_dir)), f"server-{a.start}.log"), "w")
    proc = subprocess.Popen(serve_openai.SERVERS[a.start](a.model_dir, a.port), stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([serve_openai.ROOT,
                                                                             os.environ.get("PYTHONPATH", "")])))
    try:
        ready = serve_openai.wait_ready(a.port, proc, 600)
        print(f"{a.start} ready in {ready:.1f} s")
        a.url = f"http://127.0.0.1:{a.port}"
        return _bench(a, {"server": a.start, "ready_s": ready})
    finally:
        serve_openai.stop(proc)


def _bench(a, extra: Optional[dict] = None) -> int:
    try:
        info = served_model(a.url, a.api_key)
    except (OSError, ValueError, KeyError, IndexError) as e:  # (transformers serve's /v1/models reads the hub's cache)
        if a.model is None and not a.start:
            raise SystemExit(f"{a.url}/v1/models did not answer ({e}): name the model with --model")
        info = {"id": a.model}
    model = a.model or (a.model_dir if a.start else info["id"])
    context = a.context or info.get("max_model_len") or 2048
    tok = None
    if a.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.tokenizer)
    vocab = a.vocab or (len(tok) if tok is not None else 1000)
    if a.prompt_form == "text":
        if tok is None:
            raise SystemExit("--prompt-form text needs --tokenizer")
        text_of = lambda ids: tok.decode(ids)  # noqa: E731
    else:
        text_of = lambda ids: ids  # noqa: E731
    n = a.groups * a.per_group if a.dataset == "prefix" else a.num_prompts
    ignore_eos = a.dataset in ("random", "prefix") and not a.no_ignore_eos
    if a.warmup:
        warm = dataset("random", a.warmup, a.seed + 7, vocab, context, min(a.input_len, 32), 8)
        asyncio.run(run(a.url, model, warm, text_of, float("inf"), a.concurrency, a.seed, True, a.timeout,
                        a.api_key))
    runs = []
    for i in range(a.repeats):  # (run i from seed + 100 i: no run finds an earlier run's prefixes)
        seed = a.seed + 100 * i
        reqs = dataset(a.dataset, n, seed, vocab, context, a.input_len, a.output_len, a.prefix_len, a.groups,
                       a.per_group)
        before = prefix_counts(a.url, a.api_key)
        outcomes, wall = asyncio.run(run(a.url, model, reqs, text_of, a.request_rate, a.concurrency, seed,
                                         ignore_eos, a.timeout, a.api_key))
        r = report(outcomes, wall)
        after = prefix_counts(a.url, a.api_key)
        if before is not None and after is not None and after[0] > before[0]:
            r["prefix_cache_hit_rate"] = (after[1] - before[1]) / (after[0] - before[0])
        print_report(r, f"{a.url} {model}: {a.dataset}, {n} requests, rate {a.request_rate}, concurrency "
                        f"{a.concurrency}" + (f", run {i + 1} of {a.repeats}" if a.repeats > 1 else ""))
        runs.append(r)
    r = dict(runs[0]) if a.repeats == 1 else _repeated(runs)
    r["settings"] = {k: v for k, v in vars(a).items() if k != "api_key"}
    r["settings"].update(requests=n, model=model, date=time.strftime("%Y-%m-%d"), **(extra or {}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1, default=str)
    return 0 if all(x["failed"] == 0 for x in runs) else 1


def _repeated(runs: List[dict]) -> dict:
    """Runs after the first (its captures and first shapes reported apart): the median output
    tokens/s and TTFT median, with their spread, and every run."""
    warm = runs[1:]
    tps = [x["output_tokens_per_s"] for x in warm]
    ttft = [x["ttft_ms"]["median"] for x in warm]
    out = {"first_run": runs[0], "runs": warm, "output_tokens_per_s": statistics.median(tps),
           "output_tokens_per_s_spread": [min(tps), max(tps)], "ttft_median_ms": statistics.median(ttft),
           "ttft_median_ms_spread": [min(ttft), max(ttft)], "failed": sum(x["failed"] for x in runs)}
    rates = [x["prefix_cache_hit_rate"] for x in warm if "prefix_cache_hit_rate" in x]
    if rates:
        out["prefix_cache_hit_rate"] = statistics.median(rates)
    print(f"runs 2-{len(runs)}: {out['output_tokens_per_s']:.1f} output tokens/s ({min(tps):.1f}-{max(tps):.1f}), "
          f"TTFT median {out['ttft_median_ms']:.1f} ms ({min(ttft):.1f}-{max(ttft):.1f})"
          + (f", prefix cache hit rate {out['prefix_cache_hit_rate']:.1%}" if rates else ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
