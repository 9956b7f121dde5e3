"""Why a streamer's tokens fell behind the decode steps: the interpreter's lock, on any machine.

The shared batch hands each token to its streamer on a delivery worker
(``graphwrap/decoding/callers/delivery.py``) through ``calls.put_token``. This runs that path with no
model: one thread stands in for the decode thread (Python work for ``--step-ms`` a step, then
one token for each of ``--rows`` calls, posted as the batch posts them), for ``--seconds``, and
reports each token's wait from its post to its streamer, p50/p99/max, and how many arrived. Two
streamers, each in a fresh process:

- ``tensor``: a streamer with ``put`` alone gets a tensor per token, which it reshapes and
  turns into a list (as the server's streamer did). Each torch call gives up the lock, and the
  worker waits for it again while the stand-in runs Python (up to the switch interval, 5 ms).
- ``ints``: a streamer with ``put_ids`` gets a list of ints, no torch call.

On the 2-core CPU machine (2026-11-27, Python 3.11, the defaults): ``tensor`` delivered 18,331
of 100,224 tokens by 0.2 s after the last post (those at p50 46 ms, p99 196 ms), the rest still
queued; ``ints`` all 123,904, p50 0.91 ms, p99 1.60 ms. On an H200 the server's clients saw the
same shape: gaps of 260-465 ms at p99 between chunks, the streams served one every 4-5 ms
(``benchmarks/results/h200-2026-11-27-serve-delivery/``).

    python3 benchmarks/diagnostics/delivery_gil.py [--rows 64] [--step-ms 1.5] [--seconds 3]
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run(mode: str, rows: int, step_s: float, seconds: float):
    import torch

    from graphwrap.decoding.callers.calls import put_token
    from graphwrap.decoding.callers.delivery import OUTBOX, Mailbox

    class Tensors:  # generate's streamer protocol, as the server's streamer had it
        def put(self, value):
            value.reshape(-1).tolist()

    class Ints:
        def put_ids(self, ids):
            pass

    streamer = Tensors() if mode == "tensor" else Ints()
    calls = [types.SimpleNamespace(error=None, future=concurrent.futures.Future()) for _ in range(rows)]
    boxes = [Mailbox(lambda e: None) for _ in range(rows)]
    lag: list = []
    posted = 0
    end = time.perf_counter() + seconds
    torch.zeros(1).tolist()  # (torch's first call out of the timing)
    while time.perf_counter() < end:
        t = time.perf_counter()
        while time.perf_counter() - t < step_s:  # the decode thread's own Python work
            sum(i * 2 for i in range(50))
        made = time.perf_counter()
        OUTBOX.post_many([(box, lambda c=c, k=k: put_token(c, streamer, k, made, lag))
                          for k, (c, box) in enumerate(zip(calls, boxes))])
        posted += rows
    time.sleep(0.2)
    got = sorted(lag)
    pct = lambda q: 1e3 * got[min(len(got) - 1, int(q * len(got)))]  # noqa: E731
    print(f"{mode:6}: {len(got):,} of {posted:,} tokens delivered; wait p50 {pct(0.5):.2f} ms, p99 {pct(0.99):.2f} ms, "
          f"max {1e3 * got[-1]:.2f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=1.5)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--mode", choices=("tensor", "ints"), help=argparse.SUPPRESS)  # (one mode, in this process)
    a = ap.parse_args()
    if a.mode:
        run(a.mode, a.rows, a.step_ms / 1e3, a.seconds)
        os._exit(0)  # (the delivery workers are daemon threads still draining: not waited for)
    print(f"{a.rows} calls, a token each every {a.step_ms} ms of the stand-in's Python work, {a.seconds} s; "
          f"Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d')}")
    for mode in ("tensor", "ints"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(a.rows), "--step-ms", str(a.step_ms),
                        "--seconds", str(a.seconds)], check=True)


if __name__ == "__main__":
    main()
