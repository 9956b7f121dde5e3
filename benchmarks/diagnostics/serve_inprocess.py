"""What a graphwrap.serve replica costs without Ray: 64 asyncio clients in one process calling the
replica's Batcher with inputs on the GPU, with host inputs, and ``Server.infer`` (host inputs,
outputs back to the host). BERT-base fp16 with masked mean pooling in the module, the text
workload. Beside the Ray figures of ``serve_race.py``, it shows what Ray adds.

``python benchmarks/diagnostics/serve_inprocess.py``
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from serve_race import bert_base  # noqa: E402
from text import _coroutines, workload  # noqa: E402

from graphwrap.serve import Server  # noqa: E402


def clients(fn, requests, seconds=5.0):
    """Requests/s, p50 and p99 (ms) of 64 coroutines calling ``fn`` in a closed loop."""
    lat, wall = _coroutines(fn, requests, 64, seconds)
    lat.sort()
    return len(lat) / wall, 1e3 * lat[len(lat) // 2], 1e3 * lat[int(0.99 * len(lat))]


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    host = workload(30522, "cpu", 300)
    dev = [{k: v.cuda() for k, v in r.items()} for r in host]
    server = Server(bert_base, sample=host[0], graphed={"seq_dim": 1, "max_batch_size": 64})
    b = server.batcher
    with torch.no_grad():
        clients(b.acall, dev, seconds=3.0)  # warm-up: the join probe, the device inputs' buckets
        clients(b.acall, host, seconds=2.0)
        rows = [("Batcher.acall, inputs on the GPU", lambda: clients(b.acall, dev)),
                ("Batcher.acall, host inputs", lambda: clients(b.acall, host)),
                ("Server.infer, host inputs, outputs to the host", lambda: clients(server.infer, host))]
        for name, fn in rows:
            s0 = b.stats()
            rps, p50, p99 = fn()
            s1 = b.stats()
            per = (s1["requests"] - s0["requests"]) / max(1, s1["module_calls"] - s0["module_calls"])
            print(f"  {name:50s} {rps:7.0f} req/s  p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  {per:.1f} requests per call",
                  flush=True)
    print(f"  eager calls: {server.gm.stats()['eager_calls']}", flush=True)


if __name__ == "__main__":
    main()
