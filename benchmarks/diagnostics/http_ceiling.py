"""The HTTP side's own ceiling: ``python -m graphwrap serve``'s app over an engine that costs
nothing (a thread that makes one token for every live sequence each ``--step-ms``, handed over
as the shared batch hands them: one ``put_step`` a turn), so what the clients get is what the
HTTP process can deliver. Any machine, no GPU, no model (a word-level tokenizer is made).

Each configuration of uvicorn (its HTTP parser, h11 or httptools, and its event loop, asyncio or
uvloop) serves in a process of its own; ``benchmarks/bench_serve.py`` drives it (64 streams of
``--output-len`` tokens at once, ``--rounds`` times). Reported per configuration: output
tokens/s (median of the rounds) and the gaps between a stream's chunks, against what the fake
engine makes (rows x 1000 / step-ms tokens/s).

    python3 benchmarks/diagnostics/http_ceiling.py --step-ms 1.0 --rounds 5
"""

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, os.path.dirname(HERE)]


class FreeEngine:
    """The engine interface of ``graphwrap.serve.api.engines`` with no model: each live sequence
    gets its next token every ``step`` seconds, a turn's tokens for every sequence of a sink in
    one ``put_step``, and ends after its ``max_new_tokens``."""

    def __init__(self, step: float, vocab: int):
        from graphwrap.serve.api.engines import ModelInfo

        self.info = ModelInfo([vocab - 1], None, vocab)
        self.step, self.vocab = step, vocab
        self.lock = threading.Lock()
        self.live: List[list] = []  # [feed, left, made, future]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def gone(self) -> Optional[str]:
        return None

    async def queue(self, ids, kwargs, seed, feed) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.live.append([feed, kwargs["max_new_tokens"], 0, fut])
        return fut

    def _run(self):
        from graphwrap.serve.api.engines import Ended

        t = 0
        while True:
            time.sleep(self.step)
            t += 1
            with self.lock:
                live, ended = [s for s in self.live if not s[3].cancelled()], []
                for s in live:
                    s[1] -= 1
                    s[2] += 1
                self.live = [s for s in live if s[1] > 0]
                ended = [s for s in live if s[1] <= 0]
            by_sink: Dict[object, list] = {}
            for s in live:
                by_sink.setdefault(s[0].sink, []).append(s[0])
            token = 3 + t % (self.vocab - 10)
            for sink, feeds in by_sink.items():
                sink.put_step(feeds, [token] * len(feeds))
            for s in ended:
                s[0].end()
                s[3].set_result(Ended(s[2], token))

    def stats(self) -> dict:
        return {}

    def close(self, cancel: bool = True, timeout: Optional[float] = None) -> bool:
        return True


def serve(a):
    import uvicorn
    from transformers import AutoTokenizer

    from graphwrap.serve.api.app import Served, make_app

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    served = Served(FreeEngine(a.step_ms / 1e3, len(tok)), tok, "free", 4096)
    uvicorn.Server(uvicorn.Config(make_app(served), host="127.0.0.1", port=a.port, log_level="warning", http=a.http,
                                  loop=a.loop)).run()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default="h11/asyncio,httptools/asyncio,httptools/uvloop")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--http", default="h11", help=argparse.SUPPRESS)
    ap.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=8951)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.serve:
        return serve(a)
    import bench_serve
    import serve_openai

    work = tempfile.mkdtemp(prefix="http-ceiling-")
    tokdir = serve_openai.make_model("tiny", os.path.join(work, "m"), "cpu")
    made = a.streams * 1e3 / a.step_ms
    rows = []
    for config in a.configs.split(","):
        http, loop = config.split("/")
        proc = subprocess.Popen([sys.executable, __file__, "--serve", "--tokenizer", tokdir, "--http", http, "--loop",
                                 loop, "--port", str(a.port), "--step-ms", str(a.step_ms)],
                                env=dict(os.environ, PYTHONPATH=ROOT))
        try:
            serve_openai.wait_ready(a.port, proc, 120)
            reqs = bench_serve.dataset("random", a.streams, 0, 1000, 4096, 16, a.output_len)
            got = []
            for _ in range(a.rounds + 1):  # (the first round warms up)
                outcomes, wall = asyncio.run(bench_serve.run(f"http://127.0.0.1:{a.port}", "free", reqs,
                                                             lambda ids: ids, float("inf"), a.streams, 0, False,
                                                             120.0, None))
                got.append(bench_serve.report(outcomes, wall))
            warm = got[1:]
            rate = statistics.median(r["output_tokens_per_s"] for r in warm)
            rows.append({"http": http, "loop": loop, "tokens_per_s": rate,
                         "tokens_per_s_all": [r["output_tokens_per_s"] for r in warm],
                         "itl_ms_median": statistics.median(r["itl_ms"]["median"] for r in warm),
                         "itl_ms_p99": statistics.median(r["itl_ms"]["p99"] for r in warm),
                         "failed": sum(r["failed"] for r in warm)})
        finally:
            proc.terminate()
            proc.wait(30)
    import platform

    meta = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python":
            platform.python_version(), "date": time.strftime("%Y-%m-%d"), "step_ms": a.step_ms,
            "streams": a.streams, "engine_tokens_per_s": made}
    print(f"an engine of no cost: {a.streams} streams, a token each every {a.step_ms} ms ({made:,.0f} tokens/s made); "
          f"{meta['cores']} cores, Python {meta['python']}, {meta['date']}")
    print(f"{'http/loop':22s} {'tokens/s':>10s} {'of made':>8s} {'gap p50':>8s} {'gap p99':>8s}")
    for r in rows:
        print(f"{r['http'] + '/' + r['loop']:22s} {r['tokens_per_s']:10,.0f} {r['tokens_per_s'] / made:8.0%} "
              f"{r['itl_ms_median']:7.2f}ms {r['itl_ms_p99']:7.2f}ms  {r['failed']} failed")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
