"""How long ``python -m graphwrap serve MODEL`` takes from its launch to its first ``/health`` 200,
started ``--repeats`` times, each time in a fresh process, for each tree of ``--trees`` in turn
(``name=path``: the checkout put first on ``PYTHONPATH``; two trees, say a commit and the one
before it, measured side by side). Each server is stopped with SIGTERM before the next starts.
The log of each start is kept beside ``--out``: its lines say where the time went (the engine's
``captured ...`` line, then the server's ``serving ...``).

``--others`` starts other servers of ``serve_openai.SERVERS`` (``transformers-graphs``:
``transformers serve --continuous-batching``) in the same turns. ``--cold`` gives each start an
empty Triton cache of its own (``TRITON_CACHE_DIR``), as on a machine that never ran these
kernels; without it, the starts share the user's cache, warm after the first.

    python benchmarks/serve_start.py --make-model gpt2 --model-dir /tmp/gpt2 \\
        --trees before=/tmp/old,after=. --repeats 3 --out start.json
    python benchmarks/serve_start.py --model-dir /tmp/gpt2 --others transformers-graphs --cold
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import serve_openai  # noqa: E402


def ready_after(cmd, env, port: int, log, timeout: float) -> float:
    """Seconds from launching ``cmd`` to its ``/health`` answering 200 (asked every 50 ms); the
    server is stopped after."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/tmp")
    try:
        serve_openai.wait_ready(port, proc, timeout, poll=0.05)
        return time.perf_counter() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--make-model", default=None, help="a shape of serve_openai.py's, made into --model-dir first")
    ap.add_argument("--trees", default=f"this={ROOT}", help="name=path,... (default: this checkout)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=8971)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--serve-args", default="", help="more arguments for serve, space-separated")
    ap.add_argument("--others", default="", help="servers of serve_openai.SERVERS to start in the same turns, "
                                                  "comma-separated (transformers-graphs, transformers)")
    ap.add_argument("--cold", action="store_true", help="each start with an empty Triton cache of its own")
    ap.add_argument("--out", default=None, help="a JSON file of the results (the logs go beside it)")
    a = ap.parse_args(argv)
    if a.make_model:
        import torch

        serve_openai.make_model(a.make_model, a.model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    trees = dict(t.split("=", 1) for t in a.trees.split(","))
    logs = os.path.dirname(os.path.abspath(a.out)) if a.out else "/tmp"
    cmd = [sys.executable, "-m", "graphwrap", "serve", os.path.abspath(a.model_dir), "--port", str(a.port),
           *a.serve_args.split()]
    starts = {name: (cmd, dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree),
                                                                        os.environ.get("PYTHONPATH", "")])))
              for name, tree in trees.items()}
    for name in filter(None, a.others.split(",")):
        starts[name] = (serve_openai.SERVERS[name](os.path.abspath(a.model_dir), a.port), dict(os.environ))
    seconds = {name: [] for name in starts}
    for r in range(a.repeats):
        for name, (argv_, env) in starts.items():  # (in turn: a drift of the machine falls on each alike)
            with tempfile.TemporaryDirectory() as cache, \
                    open(os.path.join(logs, f"start-{name}-{r}.log"), "w") as log:
                seconds[name].append(ready_after(argv_, dict(env, TRITON_CACHE_DIR=cache) if a.cold else env,
                                                 a.port, log, a.timeout))
            print(f"{name} {r}: ready in {seconds[name][-1]:.2f} s", flush=True)
    res = {"date": datetime.date.today().isoformat(), "cmd": cmd[1:], "trees": trees, "others": a.others, "cold": a.cold,
           "seconds": seconds,
           "median": {k: statistics.median(v) for k, v in seconds.items()}}
    for name, xs in seconds.items():
        print(f"{name}: median {statistics.median(xs):.2f} s [{min(xs):.2f}-{max(xs):.2f}]")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
