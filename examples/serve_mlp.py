"""Serve a small MLP with graphwrap behind Ray Serve, locally, in one command.

    python examples/serve_mlp.py             # starts Ray and Serve, answers on http://127.0.0.1:8000/
    curl -s -X POST http://127.0.0.1:8000/ -d '{"inputs": [[0.1, 0.2, 0.3, 0.4]]}'

    python examples/serve_mlp.py --dry-run   # no Ray: one request through the same Server class

The model goes to the GPU if there is one; on a machine without CUDA it runs eagerly.
"""

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))


class _Request:
    """What Ray Serve hands a replica for an HTTP request, as far as Server reads it."""

    def __init__(self, body: str):
        self._body = body.encode()

    async def body(self) -> bytes:
        return self._body


def dry_run() -> int:
    from graphwrap.serve import Server

    server = Server(make_model, sample=torch.randn(1, 4))
    body = json.dumps({"inputs": [[0.1, 0.2, 0.3, 0.4], [1.0, 0.0, -1.0, 0.5]]})
    answer = asyncio.run(server(_Request(body)))
    print(json.dumps(answer))
    want = make_model()(torch.tensor(json.loads(body)["inputs"])).tolist()
    ok = all(abs(a - b) < 1e-4 for ra, rb in zip(answer["outputs"], want) for a, b in zip(ra, rb))
    print("answers equal eager:", ok)
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Serve a small MLP through graphwrap and Ray Serve on this machine.")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port on 127.0.0.1 (default 8000)")
    ap.add_argument("--seconds", type=float, default=0, help="stop after this long (default: until Ctrl-C)")
    ap.add_argument("--dry-run", action="store_true", help="no Ray: one request through the same Server class")
    a = ap.parse_args(argv)
    if a.dry_run:
        return dry_run()
    import ray
    from ray import serve

    import graphwrap.serve

    ray.init(include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(graphwrap.serve.deployment(make_model, sample=torch.randn(1, 4)), name="mlp", route_prefix="/")
    print(f"serving on http://127.0.0.1:{a.port}/ ; try: curl -s -X POST http://127.0.0.1:{a.port}/ "
          "-d '{\"inputs\": [[0.1, 0.2, 0.3, 0.4]]}'", flush=True)
    try:
        deadline = time.monotonic() + a.seconds if a.seconds else None
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
