"""OpenAI-compatible servers raced on one machine: ``python -m graphwrap serve`` against
``transformers serve --continuous-batching`` (with and without its CUDA graphs), each in a
process of its own, driven by the official ``openai`` client from this process.

A burst is 64 streamed completions sent at once (prompts of 16 to 128 tokens, ``max_tokens``
32 to 256, greedy, the same for every server and burst); each server gets its first burst (what
a user meets after start-up) reported apart, then ``--bursts`` warm ones (median and spread).
The requests are spread over ``--clients`` processes (one client process parsing every
chunk would set the pace). The row "in-process" is ``gm.generate`` from a thread per request in
a process of its own, no server: what the server costs is the difference. Per burst: output
tokens per second (the usage the server reports, over the burst's wall time),
time to first token and the gaps between chunks (p50 and p99 over every request).

The model is made here with random weights (fp16 on a GPU) and saved with a word-level
tokenizer over its whole vocabulary ("w0".."wN"), so any token id decodes and a prompt of k
words is k tokens. Needs the ``openai`` package, FastAPI and uvicorn.

The graphwrap servers: ``graphwrap`` (the defaults), ``graphwrap-thread`` (``--engine thread``),
``graphwrap-h11`` (uvicorn's h11 parser and asyncio loop), ``graphwrap-2http`` and
``graphwrap-4http`` (``--api-servers 2`` and ``4``: HTTP processes over one engine process),
``graphwrap-dp2`` and ``graphwrap-dp2-load`` (``--data-parallel 2``: an engine process on each
of two GPUs, routed by prefix or to the least loaded).

``--client raw`` streams over bare sockets instead of the ``openai`` client, and ``--client-gc
off`` keeps the client processes' collector off during bursts: both tell the clients' own
pauses and costs from the server's.

    python3 benchmarks/serve_openai.py --model gpt2 --servers graphwrap,transformers-graphs --out DIR
"""

import argparse
import asyncio
import concurrent.futures
import gc
import json
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Dict, List, Optional, Tuple

CLIENT_GC = [True]  # whether the client processes collect garbage during a burst (--client-gc)
CLIENT = ["openai"]  # what the client processes stream with (--client)
STALLS_KEPT = 300
STALL = 0.1  # a gap between one stream's chunks this long (s) is listed with its times
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SERVERS = {
    "graphwrap": lambda d, port: [sys.executable, "-m", "graphwrap", "serve", d, "--port", str(port),
                                  "--served-model-name", d],
    "graphwrap-thread": lambda d, port: [sys.executable, "-m", "graphwrap", "serve", d, "--port", str(port),
                                         "--served-model-name", d, "--engine", "thread"],
    "graphwrap-h11": lambda d, port: [sys.executable, "-m", "graphwrap", "serve", d, "--port", str(port),
                                      "--served-model-name", d, "--http", "h11", "--loop", "asyncio"],
    "graphwrap-2http": lambda d, port: [sys.executable, "-m", "graphwrap", "serve", d, "--port", str(port),
                                        "--served-model-name", d, "--api-servers", "2"],
    "graphwrap-4http": lambda d, port: [sys.executable, "-m", "graphwrap", "serve", d, "--port", str(port),
                                        "--served-model-name", d, "--api-servers", "4"],
    "graphwrap-dp2": lambda d, port: [sys.executable, "-m", "graphwrap", "serve", d, "--port", str(port),
                                      "--served-model-name", d, "--data-parallel", "2"],
    "graphwrap-dp2-load": lambda d, port: [sys.executable, "-m", "graphwrap", "serve", d, "--port", str(port),
                                           "--served-model-name", d, "--data-parallel", "2", "--routing", "load"],
    "transformers-graphs": lambda d, port: ["transformers", "serve", d, "--continuous-batching",
                                            "--cb-use-cuda-graph", "--port", str(port), "--host", "127.0.0.1"],
    "transformers": lambda d, port: ["transformers", "serve", d, "--continuous-batching", "--no-cb-use-cuda-graph",
                                     "--port", str(port), "--host", "127.0.0.1"],
}


def make_model(shape: str, path: str, device: str, fp32: bool = False) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if shape == "gpt2":
        cfg, cls, eos = GPT2Config(), GPT2LMHeadModel, 50256
    elif shape == "tiny":  # for a CPU: the server's own cost, the model's next to nothing
        cfg, cls, eos = (GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1024, bos_token_id=1023,
                                   eos_token_id=1023), GPT2LMHeadModel, 1023)
    elif shape == "llama-1b":  # TinyLlama-1.1B's shape
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, bos_token_id=1,
                          eos_token_id=2)
        cls, eos = LlamaForCausalLM, 2
    elif shape == "llama3-8b":  # Llama-3-8B's shape, made in place in seconds (generate_large.big_model)
        from generate_large import SHAPES

        cfg = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
        cls, eos = None, 2
    else:
        raise SystemExit(f"unknown --model {shape}")
    words = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{eos}", bos_token=f"w{eos}", unk_token="w0")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    if cls is None:
        from generate_large import big_model

        model = big_model(shape, device)  # (fp16, random weights, norms of one)
        model.config.eos_token_id, model.generation_config.eos_token_id = eos, eos
        model.save_pretrained(path)
        del model
        return path
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
    model = model.half() if device == "cuda" and not fp32 else model
    for p in model.parameters():  # small weights: logits of random models stay finite in fp16
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(path)
    del model
    return path


def workload(n: int, seed: int = 0, top: int = 30000) -> List[dict]:
    """``n`` requests: prompts of 16 to 128 words of ids 100 to ``top``, 32 to 256 new tokens."""
    rng = random.Random(seed)
    return [{"prompt": " ".join(f"w{rng.randrange(100, top)}" for _ in range(rng.randint(16, 128))),
             "max_tokens": rng.randint(32, 256)} for _ in range(n)]


def renewed(reqs: List[dict], seed: int) -> List[dict]:
    """The requests with prompts of new words, as many as each had and from the same range
    (graphwrap's server caches prompts' prefixes: a prompt sent again would be served from its
    cache, where a peer's server may compute it again); every other field kept."""
    rng = random.Random(10_000 + seed)
    top = max(int(w[1:]) for r in reqs for w in r["prompt"].split()) + 1
    return [dict(r, prompt=" ".join(f"w{rng.randrange(100, top)}" for _ in r["prompt"].split())) for r in reqs]


class Chunks:
    """One stream's text chunks as they come: time to the first, the gaps between the others
    (those past STALL with their times), and the usage the server reports."""

    def __init__(self, t0: float):
        self.t0, self.first, self.last, self.usage = t0, None, 0.0, None
        self.gaps: List[float] = []
        self.stalls: List[Tuple[float, float]] = []

    def text(self):
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.gaps.append(now - self.last)
            if now - self.last > STALL:
                self.stalls.append((self.last, now))
        self.last = now

    def result(self) -> dict:
        return {"ttft": (self.first or time.perf_counter()) - self.t0, "gaps": self.gaps, "tokens": self.usage or 0,
                "stalls": self.stalls}


async def one(client, model: str, req: dict) -> dict:
    t0 = time.perf_counter()
    asks = {"logprobs": req["logprobs"]} if req.get("logprobs") is not None else {}
    stream = await client.completions.create(model=model, prompt=req["prompt"], max_tokens=req["max_tokens"],
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             **asks)
    clock = Chunks(t0)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            clock.text()
        if chunk.usage is not None:
            clock.usage = chunk.usage.completion_tokens
    return clock.result()


async def one_raw(base: str, model: str, req: dict) -> dict:
    """``one`` over a bare socket: HTTP/1.1 written by hand, each event's JSON read with
    ``json.loads`` (what any client must do), nothing else (the ``openai`` client's own cost
    per chunk left out)."""
    host, port = base.split("//")[1].split("/")[0].split(":")
    asks = {"logprobs": req["logprobs"]} if req.get("logprobs") is not None else {}
    body = json.dumps({"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, **asks}).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (host.encode(), len(body)) + body)
    clock = Chunks(t0)
    while True:
        line = await asyncio.wait_for(reader.readline(), 60)  # (a server that never ends the body fails the race)
        if not line or line.startswith(b"data: [DONE]") or line == b"0\r\n":  # (or the body's last chunk)
            break
        if not line.startswith(b"data: "):
            continue  # (the status line, headers, chunk sizes, blank lines)
        event = json.loads(line[6:])
        if event.get("choices") and event["choices"][0].get("text"):
            clock.text()
        if event.get("usage"):
            clock.usage = event["usage"]["completion_tokens"]
    writer.close()
    return clock.result()


async def _requests(base: str, model: str, reqs: List[dict], raw: bool = False) -> List[dict]:
    if raw:
        return list(await asyncio.gather(*(one_raw(base, model, r) for r in reqs)))
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    out = await asyncio.gather(*(one(client, model, r) for r in reqs))
    await client.close()
    return list(out)


def _part(args) -> Tuple[List[dict], float]:
    """One client process's share of a burst, and the CPU seconds it spent on it. With
    ``--client-gc off``, its garbage collector is off during the burst (and collects after): a
    collection in a client pauses its streams, and the pause would be counted in the server's gaps."""
    *args, gc_on, raw = args
    if not gc_on:
        gc.disable()
    cpu = time.process_time()
    try:
        return asyncio.run(_requests(*args, raw=raw)), time.process_time() - cpu
    finally:
        gc.enable()
        gc.collect()


def _ticks(pid: int) -> Dict[str, int]:
    """CPU clock ticks of every thread of ``pid`` and of its descendants, by "pid/tid" (Linux)."""
    out: Dict[str, int] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[f"{p}/{tid}"] = int(fields[11]) + int(fields[12])  # utime, stime
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def busiest(before: Dict[str, int], after: Dict[str, int], wall: float, k: int = 6) -> List[str]:
    """The server's ``k`` busiest threads over a burst: "pid/tid share-of-one-core"."""
    hz = os.sysconf("SC_CLK_TCK")
    used = sorted(((after[t] - before.get(t, 0)) / hz / wall, t) for t in after)[::-1][:k]
    return [f"{t} {u:.0%}" for u, t in used]


def burst(pool, base: str, model: str, reqs: List[dict], server_pid: Optional[int] = None) -> dict:
    """The requests sent at once from the pool's client processes (one process would be the
    bottleneck: the client's own parsing of every chunk); wall time from the first sent to the
    last answered. Each client process's CPU over the wall time, and the server's busiest
    threads (its own and its children's), say who was saturated."""
    k = pool._max_workers
    parts = [(base, model, reqs[i::k], CLIENT_GC[0], CLIENT[0] == "raw") for i in range(k)]
    ticks = _ticks(server_pid) if server_pid else {}
    t0 = time.perf_counter()
    got = list(pool.map(_part, parts))
    wall = time.perf_counter() - t0
    out = [dict(o, client=i) for i, (part, _) in enumerate(got) for o in part]
    r = summary(out, wall, t0)
    r["client_cpu"] = [round(cpu / wall, 2) for _, cpu in got]
    if server_pid:
        r["server_threads"] = busiest(ticks, _ticks(server_pid), wall)
    return r


def summary(out: List[dict], wall: float, t0: Optional[float] = None) -> dict:
    gaps = sorted(g for o in out for g in o["gaps"])
    ttft = sorted(o["ttft"] for o in out)
    tokens = sum(o["tokens"] for o in out)
    r = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
         "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
         "gap_p50_ms": 1e3 * pct(gaps, 50) if gaps else None, "gap_p99_ms": 1e3 * pct(gaps, 99) if gaps else None}
    if t0 is not None:  # every gap past STALL: when it began and ended (ms into the burst), and in which client
        r["stalls"] = sorted((round(1e3 * (a - t0)), round(1e3 * (b - t0)), o["client"])
                             for o in out for a, b in o.get("stalls", ()))[:STALLS_KEPT]
    return r


def in_process(model_dir: str, reqs: List[dict], bursts: int) -> dict:
    """The same requests through gm.generate from a thread each, in this process (what the
    server adds is the difference): tokens, time to first token through a streamer."""
    import threading

    import torch
    from transformers import AutoModelForCausalLM

    import graphwrap

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    gm = graphwrap.GraphedModule(model)

    class Clock:
        def __init__(self):
            self.t0, self.times, self.n = time.perf_counter(), [], 0

        def put(self, value):
            self.n += 1
            if self.n > 1:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    def run(reqs):
        ids = [torch.tensor([[int(w[1:]) for w in r["prompt"].split()]]) for r in reqs]
        clocks = [Clock() for _ in reqs]
        threads = [threading.Thread(target=gm.generate, args=(x,), kwargs=dict(
            max_new_tokens=r["max_tokens"], do_sample=False, streamer=c)) for x, r, c in zip(ids, reqs, clocks)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        out = [{"ttft": c.times[0] - t0, "gaps": [b - a for a, b in zip(c.times, c.times[1:])],
                "tokens": len(c.times)} for c in clocks]
        return summary(out, wall)

    first = run(reqs)
    warm = [run(renewed(reqs, i)) for i in range(bursts)]  # (as the servers' warm bursts)
    d = gm.stats()["decode"]  # (the decode thread's seconds by part: to set beside the server's log)
    return {"server": "gm.generate in process", "ready_s": 0.0, "first": first, "warm": warm,
            "decode": {k: d.get(k) for k in ("steps", "thread_s", "delivery_lag_ms", "turn_ms")}}


def pct(xs: List[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def wait_ready(port: int, proc, seconds: float, poll: float = 0.5) -> float:
    """Seconds until the server ``proc`` answers ``/health`` with 200 (asked every ``poll`` seconds)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(poll)
    raise RuntimeError("the server did not answer in time")


def race(name: str, model_dir: str, port: int, reqs: List[dict], bursts: int, log, clients: int) -> dict:
    proc = subprocess.Popen(SERVERS[name](model_dir, port), stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    try:
        ready = wait_ready(port, proc, 300)
        base = f"http://127.0.0.1:{port}/v1"
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(clients, mp_context=ctx) as pool:
            list(pool.map(_imports, range(clients)))
            first = burst(pool, base, model_dir, reqs, proc.pid)
            warm = [burst(pool, base, model_dir, renewed(reqs, i), proc.pid) for i in range(bursts)]
        seen = scrape(port) if name.startswith("graphwrap") else {}
    finally:
        stop(proc)
    return with_spread({"server": name, "ready_s": ready, "first": first, "warm": warm, "metrics": seen})


SCRAPED = ("decode_turn_p99_seconds", "decode_turn_max_seconds", "token_delivery_p99_seconds", "graph_captures", "eager_forwards",
           "step_eager_calls", "event_loop_lag_seconds_sum", "event_loop_lag_seconds_count",
           "engine_gc_pause_max_seconds")


def scrape(port: int) -> dict:
    """What the server's /metrics says of its batch and event loop after the bursts, and how
    many of its event loop's lag samples were 100 ms late or more."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    out = {k: values.get("graphwrap_" + k) for k in SCRAPED}
    under = values.get('graphwrap_event_loop_lag_seconds_bucket{le="0.1"}')
    if under is not None and out["event_loop_lag_seconds_count"] is not None:
        out["event_loop_lag_100ms_or_more"] = out["event_loop_lag_seconds_count"] - under
    return out


def stop(proc):
    """SIGTERM (the server drains), a kill where it has not ended within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def with_spread(r: dict) -> dict:
    tps = [w["tokens_per_s"] for w in r["warm"]]
    return dict(r, warm_tokens_per_s_median=statistics.median(tps), warm_tokens_per_s_min=min(tps),
                warm_tokens_per_s_max=max(tps))


def _imports(_):
    import openai  # noqa: F401 - each client process imports before the first burst


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama-1b", "llama3-8b", "tiny"))
    ap.add_argument("--servers", default="in-process,graphwrap,transformers-graphs",
                    help=f"of in-process (gm.generate from threads, no server), {', '.join(SERVERS)}")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--port", type=int, default=8911)
    ap.add_argument("--clients", type=int, default=4, help="client processes the requests are spread over")
    ap.add_argument("--in-process", default=None, help=argparse.SUPPRESS)  # (a model directory: the in-process row)
    ap.add_argument("--client-gc", default="on", choices=("off", "on"),
                    help="the client processes' garbage collector during a burst (off: its pauses are not counted "
                         "as the server's)")
    ap.add_argument("--client", default="openai", choices=("openai", "raw"),
                    help="the official openai client, or a bare socket reading each event's JSON (the client "
                         "library's own cost per chunk left out)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="each request asks for its tokens' log-probabilities and this many of the most likely "
                         "(the servers' rows; the in-process row asks for none)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.top = 1000 if a.model == "tiny" else 30000
    CLIENT_GC[0] = a.client_gc == "on"
    CLIENT[0] = a.client
    if a.in_process:
        print(json.dumps(with_spread(in_process(a.in_process, workload(a.requests, top=a.top), a.bursts))))
        return
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = make_model(a.model, tempfile.mkdtemp(prefix=f"serve-{a.model}-"), device)
    reqs = workload(a.requests, top=a.top)
    if a.logprobs is not None:
        reqs = [dict(r, logprobs=a.logprobs) for r in reqs]
    out_dir = a.out or tempfile.mkdtemp(prefix="serve-openai-")
    os.makedirs(out_dir, exist_ok=True)
    results: Dict[str, dict] = {}
    for name in a.servers.split(","):
        with open(os.path.join(out_dir, f"server-{name}-{a.model}.log"), "w") as log:
            try:
                if name == "in-process":  # a process of its own too: the servers then get the GPU's memory
                    got = subprocess.run([sys.executable, __file__, "--in-process", model_dir, "--requests",
                                          str(a.requests), "--bursts", str(a.bursts), "--model", a.model], stdout=subprocess.PIPE,
                                         stderr=log, text=True, timeout=600, check=True)
                    results[name] = json.loads(got.stdout.strip().splitlines()[-1])
                else:
                    results[name] = race(name, model_dir, a.port, reqs, a.bursts, log, a.clients)
            except Exception as e:  # noqa: BLE001 - the other servers still run; the reason is written down
                results[name] = {"server": name, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(results[name]), flush=True)
    where = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    meta = {"device": where, "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"), "model": a.model, "requests": a.requests, "bursts": a.bursts}
    with open(os.path.join(out_dir, f"serve-openai-{a.model}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"\n{a.model}, {a.requests} streamed completions a burst; {where}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {meta['date']}")
    print(f"{'server':22} {'ready s':>8} {'first tok/s':>12} {'warm tok/s (min-max)':>26} {'TTFT p50/p99 ms':>17} "
          f"{'gap p50/p99 ms':>16}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:22} {r['error']}")
            continue
        w = sorted(r["warm"], key=lambda x: x["tokens_per_s"])[len(r["warm"]) // 2]
        print(f"{name:22} {r['ready_s']:8.1f} {r['first']['tokens_per_s']:12.0f} "
              f"{r['warm_tokens_per_s_median']:10.0f} ({r['warm_tokens_per_s_min']:.0f}-{r['warm_tokens_per_s_max']:.0f})"
              f"{'':>4} {w['ttft_p50_ms']:7.0f}/{w['ttft_p99_ms']:<7.0f} {w['gap_p50_ms'] or 0:7.1f}/{w['gap_p99_ms'] or 0:<6.1f}")


if __name__ == "__main__":
    main()
