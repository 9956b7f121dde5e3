"""A soak of ``python -m graphwrap serve`` as strangers use it: many requests over minutes from
concurrent clients, each of a random kind, every request's end counted.

Each request is drawn from a seed: completions or chat, streamed or whole, ``n`` of 1 to 3,
stop strings, log-probabilities, greedy or seeded sampling, 1 to 48 new tokens. Of them,
``--hang-up`` (10%) are abandoned at a random moment (queued, mid-stream or mid-answer) and
``--bad`` (5%) are bad input, each of which must be answered with its own 4xx (a wrong type, an
integer past int64, a token id outside the vocabulary, a body that is not JSON, too long a
prompt, an unknown field or path, too large a body...).

It ends with a table and a verdict, and exits 1 where any of these fails:
- no request lost (every one that was not abandoned got its answer: a complete body, or a
  stream ending in ``[DONE]``) and none answered 5xx;
- every bad input answered 4xx (with the API's error shape), every good one 200 (429 counts as
  lost: the queue must hold what the clients send);
- the server's memory flat after the warm-up (the host RSS of the server and its engine
  process, and the GPU memory /metrics reports, within ``--memory-slack``);
- no row, queued sequence or cache block left in use once the clients stop.

The server runs as a user runs it (``python -m graphwrap serve DIR``, the engine in a process of
its own), over a model made here (``serve_openai.py``'s: random weights, a word-level
tokenizer), or any running server given with ``--url`` (memory then unchecked).

    python3 benchmarks/soak_http.py --model tiny --requests 20000 --seconds 600 --out DIR
"""

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


# ---------------------------------------------------------------------------- the requests

def good_request(rng: random.Random, vocab: int) -> Tuple[str, dict]:
    """``(path, body)`` of a request the server must answer 200."""
    words = [f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(1, 64))]
    body: dict = {"max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 1, 2, 3])}
    chat = rng.random() < 0.3
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
    else:
        body["prompt"] = " ".join(words) if rng.random() < 0.7 else [int(w[1:]) for w in words]
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, seed=rng.randrange(1 << 32))
    if rng.random() < 0.2:
        body["stop"] = [f"w{rng.randrange(3, vocab)}" for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        body.update({"logprobs": True, "top_logprobs": rng.randint(0, 2)} if chat else {"logprobs": rng.randint(0, 3)})
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def bad_request(rng: random.Random, vocab: int, context: int) -> Tuple[str, str, bytes, Dict[str, str], int]:
    """``(what, path, raw body, headers, status)`` of a request the server must refuse so."""
    json_type = {"Content-Type": "application/json"}
    cases = [
        ("min_tokens past int64", {"prompt": "w5", "min_tokens": 2 ** 63}, 400),
        ("top_k past int64", {"prompt": "w5", "top_k": 2 ** 63, "stream": True}, 400),
        ("a seed past 64 bits", {"prompt": "w5", "seed": 2 ** 64}, 400),
        ("a token id past the vocabulary", {"prompt": [5, vocab + 7], "echo": True}, 400),
        ("a negative token id", {"prompt": [-1, 5], "echo": True}, 400),
        ("a stop id past the vocabulary", {"prompt": "w5", "stop_token_ids": [vocab]}, 400),
        ("stream as a string", {"prompt": "w5", "stream": "yes"}, 400),
        ("n as a string", {"prompt": "w5", "n": "2"}, 400),
        ("min_tokens past max_tokens", {"prompt": "w5", "min_tokens": 9, "max_tokens": 3}, 400),
        ("an unknown field", {"prompt": "w5", "frobnicate": 1}, 400),
        ("past the context", {"prompt": [5] * context, "max_tokens": 4}, 400),
        ("an empty message list", {"messages": []}, 400),
        ("too many choices", {"prompt": ["w5"] * 9, "n": 8}, 400),
        ("a penalty out of bounds", {"prompt": "w5", "presence_penalty": 2.5}, 400),
        ("best_of below n", {"prompt": "w5", "n": 3, "best_of": 2}, 400),
        ("a model not served", {"prompt": "w5", "model": "gpt-9"}, 404),
    ]
    pick = rng.randrange(len(cases) + 4)
    if pick < len(cases):
        what, body, status = cases[pick]
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return what, path, json.dumps(body).encode(), json_type, status
    if pick == len(cases):
        return "a body that is not JSON", "/v1/completions", b'{"prompt": "w5",', json_type, 400
    if pick == len(cases) + 1:
        return "no Content-Type", "/v1/completions", b'{"prompt": "w5"}', {}, 400
    if pick == len(cases) + 2:
        return "an unknown path", "/v1/nowhere", b"{}", json_type, 404
    return "a body over the limit", "/v1/completions", json.dumps({"prompt": "w5 " * (9 << 20)}).encode(), \
        json_type, 413


# ---------------------------------------------------------------------------- the clients

class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Dict[str, int] = {}
        self.problems: List[str] = []
        self.tokens = 0

    def add(self, what: str, problem: Optional[str] = None, tokens: int = 0):
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1
            self.tokens += tokens
            if problem is not None and len(self.problems) < 50:
                self.problems.append(problem)


def _check_whole(body: dict, req: dict) -> Optional[str]:
    prompts = len(req["prompt"]) if isinstance(req.get("prompt"), list) and req["prompt"] and \
        isinstance(req["prompt"][0], (str, list)) else 1
    want = prompts * req.get("n", 1)
    choices = body.get("choices") or []
    if len(choices) != want or sorted(c["index"] for c in choices) != list(range(want)):
        return f"{want} choices asked, {len(choices)} answered"
    if any(c["finish_reason"] not in ("stop", "length") for c in choices):
        return f"a finish_reason of {[c['finish_reason'] for c in choices]}"
    if body["usage"]["completion_tokens"] > want * req["max_tokens"]:
        return f"usage {body['usage']} past max_tokens"
    return None


def _check_stream(events: List[str], req: dict) -> Tuple[Optional[str], int]:
    if not events or events[-1] != "[DONE]":
        return "a stream that did not end with [DONE]", 0
    parsed = [json.loads(e) for e in events[:-1]]
    errors = [e for e in parsed if "error" in e]
    if errors:
        return f"an error event: {errors[0]}", 0
    finishes = [c["finish_reason"] for e in parsed for c in e.get("choices", []) if c.get("finish_reason")]
    want = req.get("n", 1)
    if len(finishes) != want:
        return f"{want} choices asked, {len(finishes)} ended", 0
    usage = [e["usage"] for e in parsed if e.get("usage")]
    if (req.get("stream_options") or {}).get("include_usage") and not usage:
        return "no usage event", 0
    return None, usage[-1]["completion_tokens"] if usage else 0


def one(port: int, rng: random.Random, vocab: int, context: int, hang_up: float, bad: float, tally: Tally,
        timeout: float):
    roll = rng.random()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if roll < bad:
            what, path, raw, headers, status = bad_request(rng, vocab, context)
            try:
                c.request("POST" if path != "/v1/nowhere" else "GET", path, raw, headers)
                r = c.getresponse()
                got = r.status
                answer = r.read()
            except (ConnectionError, OSError) as e:
                tally.add("lost", f"bad input ({what}): {type(e).__name__}: {e}")
                return
            ok = got == status and set(json.loads(answer)) == {"error"}
            tally.add("bad input answered 4xx" if ok else ("5xx" if got >= 500 else "bad input answered wrongly"),
                      None if ok else f"bad input ({what}): {got} {answer[:200]!r}")
            return
        path, req = good_request(rng, vocab)
        c.request("POST", path, json.dumps(req), {"Content-Type": "application/json"})
        if roll < bad + hang_up:  # abandoned: queued, mid-stream or mid-answer
            time.sleep(rng.random() * 0.3)
            r = None
            if req.get("stream") and rng.random() < 0.5:
                try:
                    r = c.getresponse()
                    for _ in range(rng.randint(0, 8)):
                        r.readline()
                except (ConnectionError, OSError):
                    pass
            c.sock.close() if c.sock is not None else None
            tally.add("hung up")
            return
        r = c.getresponse()
        if r.status != 200:
            tally.add("5xx" if r.status >= 500 else f"{r.status}", f"{path} {req}: {r.status} {r.read()[:300]!r}")
            return
        if req.get("stream"):
            events = [line[6:].decode().strip() for line in r.read().split(b"\n") if line.startswith(b"data: ")]
            problem, tokens = _check_stream(events, req)
        else:
            body = json.loads(r.read())
            problem, tokens = _check_whole(body, req), body["usage"]["completion_tokens"]
        tally.add("lost" if problem else "served", None if problem is None else f"{path} {req}: {problem}", tokens)
    except (ConnectionError, OSError, http.client.HTTPException, ValueError) as e:
        tally.add("lost", f"{type(e).__name__}: {e}")
    finally:
        c.close()


# ---------------------------------------------------------------------------- the server's side

def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (Linux)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except (OSError, StopIteration):
            pass
    return total


def metrics(port: int) -> Dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#") and not line.endswith("nan")}


def start(model_dir: str, port: int, log, extra: List[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "graphwrap", "serve", model_dir, "--port", str(port),
                             "--served-model-name", "soak", "--max-body-mb", "4", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} (its log: {log.name})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not start in time")


def soak(port: int, pid: Optional[int], vocab: int, context: int, requests: int, seconds: float, clients: int,
         hang_up: float, bad: float, seed: int, slack: float, timeout: float) -> dict:
    tally = Tally()
    rng = random.Random(seed)
    seeds = [rng.randrange(1 << 62) for _ in range(requests)]
    warm = max(1, requests // 10)
    memory: Dict[str, Optional[float]] = {}
    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        def run(i: int):
            if time.monotonic() - t0 > seconds:
                tally.add("not sent (past --seconds)")
                return
            # a steady pace: the requests spread over the seconds given
            due = t0 + seconds * i / requests
            time.sleep(max(0.0, due - time.monotonic()))
            one(port, random.Random(seeds[i]), vocab, context, hang_up, bad, tally, timeout)
            if i == warm:
                memory["rss_warm"] = _rss(pid) if pid else None
                memory["gpu_warm"] = metrics(port).get("graphwrap_gpu_memory_allocated_bytes")

        list(pool.map(run, range(requests)))
    wall = time.monotonic() - t0
    # nothing left in use once every client is done (the batch frees a row at its next step)
    left: Dict[str, float] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = metrics(port)
        left = {k: m.get("graphwrap_" + k, 0.0) for k in ("sequences_running", "sequences_queued", "cache_blocks_used",
                                                         "requests_running")}
        if not any(left.values()):
            break
        time.sleep(0.5)
    memory["rss_end"] = _rss(pid) if pid else None
    memory["gpu_end"] = metrics(port).get("graphwrap_gpu_memory_allocated_bytes")
    counts = tally.counts
    sent = sum(v for k, v in counts.items() if not k.startswith("not sent"))
    verdicts = {
        "no request lost, none answered 5xx, none refused": not any(
            counts.get(k) for k in counts if k not in ("served", "hung up", "bad input answered 4xx", "not sent (past "
                                                                                                        "--seconds)")),
        "every bad input answered 4xx": counts.get("bad input answered wrongly", 0) == 0,
        "nothing left in use": not any(left.values()),
    }
    for kind in ("rss", "gpu"):
        a, b = memory.get(f"{kind}_warm"), memory.get(f"{kind}_end")
        if a and b:
            verdicts[f"{kind} memory flat after warm-up (within {slack:.0%})"] = b <= a * (1 + slack)
    return {"sent": sent, "wall_s": round(wall, 1), "requests_per_s": round(sent / wall, 1), "counts": counts,
            "tokens": tally.tokens, "left_in_use": left, "memory": memory, "problems": tally.problems,
            "verdicts": verdicts, "passed": all(verdicts.values())}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "gpt2", "llama-1b"),
                    help="the shape made with random weights (serve_openai.py's)")
    ap.add_argument("--url", default=None, help="a server already running (http://127.0.0.1:PORT): no start, "
                                                "no memory check; --vocab and --context say its model")
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--seconds", type=float, default=600.0, help="the requests are spread over this long")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--hang-up", type=float, default=0.10)
    ap.add_argument("--bad", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-slack", type=float, default=0.10)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a client waits for its answer")
    ap.add_argument("--device", default=None)
    ap.add_argument("--server-args", default="", help="more arguments for python -m graphwrap serve")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out = a.out or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(out, exist_ok=True)
    proc = None
    if a.url:
        port = int(a.url.rsplit(":", 1)[1].split("/")[0])
        vocab, context = a.vocab or 1000, a.context or 1024
    else:
        import torch
        from serve_openai import make_model
        from transformers import AutoConfig

        device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model_dir = make_model(a.model, os.path.join(out, "model"), device)
        cfg = AutoConfig.from_pretrained(model_dir)
        vocab = cfg.vocab_size
        context = getattr(cfg, "n_positions", None) or cfg.max_position_embeddings
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = open(os.path.join(out, "server.log"), "w")
        proc = start(model_dir, port, log, a.server_args.split())
    try:
        result = soak(port, proc.pid if proc else None, vocab, context, a.requests, a.seconds, a.clients, a.hang_up,
                      a.bad, a.seed, a.memory_slack, a.timeout)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
            result_code = proc.returncode
        else:
            result_code = None
    result.update(model=a.model if not a.url else a.url, server_exit=result_code,
                  date=time.strftime("%Y-%m-%d"), python=sys.version.split()[0])
    if proc is not None:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        result["torch"] = torch.__version__
        result["server_exit_ok"] = result_code == 0
        result["passed"] = result["passed"] and result_code == 0
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"{result['sent']} requests in {result['wall_s']} s ({result['requests_per_s']}/s), {result['tokens']} tokens")
    for k, v in sorted(result["counts"].items()):
        print(f"  {k:30s} {v}")
    print(f"  left in use: {result['left_in_use']}; memory: {result['memory']}")
    for k, v in result["verdicts"].items():
        print(f"  {'PASS' if v else 'FAIL'}  {k}")
    for p in result["problems"][:10]:
        print(f"  problem: {p[:300]}")
    print(f"soak {'passed' if result['passed'] else 'FAILED'} ({out}/soak.json)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
