"""Ray Serve on GPUs, one Ray instance per run, clients in Ray actors of their own.

``python benchmarks/serve_race.py race``: BERT-base fp16 (random weights, a masked mean-pooled
embedding per row, the pooling inside the module) served by ``graphwrap.serve`` (``seq_dim=1``) against a plain Ray Serve
deployment of the eager model whose ``@serve.batch`` method pads each batch to its longest
request, on the same GPU (half of it each), the same clients in the same run: 64 clients in a
closed loop sending the text workload (300 requests of 1 to 8 rows, lengths lognormal, median
about 35), through deployment handles and over HTTP. Over HTTP 1% of the requests are malformed;
each must get a 4xx, every other answer must equal eager's (fp16 tolerance), and none may be lost.

``python benchmarks/serve_race.py replicas``: ``graphwrap.serve`` with one replica, then two (one
GPU each), through handles, on the seed MLP (requests of 1 to 8 rows) and on BERT-base.

Requests/s, p50 and p99 per row; results.json and a table under ``--out``. ``--smoke`` runs a tiny
model on the CPU in seconds (to check the script, not to measure anything).
"""

import argparse
import asyncio
import json
import os
import random
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402

CLIENTS = 64
BAD_BODIES = [b"{not json", b'{"nope": 1}', b'{"inputs": {"input_ids": [[1, 2], [3]]}}',
              b'{"inputs": {"input_ids": [[1, 99999999]], "attention_mask": [[1, 1]]}}',
              b'{"inputs": {"input_ids": [[1, 2]]}, "dtypes": {"input_ids": "__class__"}}']


# ------------------------------------------------------------------ models (built in each replica)

class Embedder(torch.nn.Module):
    """A BertModel and the masked mean of its last hidden state: one embedding per row. The pooling
    is part of the module, so graphwrap captures it with the model."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert
        self.config = bert.config

    def forward(self, input_ids, attention_mask):
        return pooled(self.bert(input_ids=input_ids, attention_mask=attention_mask), {"attention_mask": attention_mask})


def bert_base(small: bool = False):
    import transformers

    torch.manual_seed(0)
    cfg = (transformers.BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
           if small else transformers.BertConfig())
    m = Embedder(transformers.BertModel(cfg)).eval()
    return m if small else m.half()


def small_bert():
    return bert_base(small=True)


def seed_mlp():
    from workloads import SeedMLP

    torch.manual_seed(0)
    return SeedMLP().eval()


def pooled(out, inputs):
    """One embedding per row: the mean of the last hidden state over the positions the mask keeps."""
    m = inputs["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)
    return (out.last_hidden_state * m).sum(1) / m.sum(1)


# ------------------------------------------------------------------ the plain deployment

def plain_app(factory, max_batch_size: int, wait_s: float, gpus: float):
    """Ray Serve without graphwrap: ``@serve.batch`` joins requests, each batch padded to its
    longest request, the eager model on the GPU."""
    from ray import serve

    # max_ongoing_requests: Ray's default (5) would cap every batch at 5 requests; Ray's guide
    # asks for at least max_batch_size.
    @serve.deployment(name="plain", ray_actor_options={"num_gpus": gpus},
                      max_ongoing_requests=max(2 * max_batch_size, CLIENTS))
    class Plain:
        def __init__(self):
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self.model = factory().to(self.device)

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=wait_s)
        async def run(self, reqs):
            L = max(ids.shape[1] for ids, _ in reqs)
            ids = torch.cat([torch.nn.functional.pad(i, (0, L - i.shape[1])) for i, _ in reqs]).to(self.device)
            mask = torch.cat([torch.nn.functional.pad(m, (0, L - m.shape[1])) for _, m in reqs]).to(self.device)
            with torch.no_grad():
                emb = self.model(input_ids=ids, attention_mask=mask).cpu()
            return list(emb.split([i.shape[0] for i, _ in reqs]))

        async def infer(self, input_ids, attention_mask):
            return await self.run((input_ids, attention_mask))

        async def __call__(self, request):
            body = await request.json()
            x = body["inputs"]
            out = await self.run((torch.tensor(x["input_ids"]), torch.tensor(x["attention_mask"])))
            return {"outputs": out.tolist()}

    return Plain.bind()


# ------------------------------------------------------------------ clients

def client_actor():
    import ray

    @ray.remote(num_cpus=0)
    class Clients:
        """``k`` coroutines in a closed loop; latencies, statuses, answers that differ from eager."""

        def __init__(self, requests, expected):
            self.requests, self.expected = requests, expected
            self.bodies = [json.dumps({"inputs": {k: v.tolist() for k, v in r.items()}}).encode()
                           if isinstance(r, dict) else json.dumps({"inputs": r.tolist()}).encode() for r in requests]

        def _check(self, i, got, tally):
            want = self.expected[i] if self.expected is not None else None
            if want is None:
                return
            got = torch.as_tensor(got, dtype=torch.float32)
            diff = float((got - want.float()).abs().max()) if got.shape == want.shape else float("inf")
            tally["max_diff"] = max(tally["max_diff"], diff)
            if not diff <= 2e-2 + 2e-2 * float(want.float().abs().max()):
                tally["wrong"] += 1

        async def run(self, target, app, k, seconds, seed, bad_share=0.0, check=True):
            from ray import serve

            handle = serve.get_app_handle(app) if target == "handle" else None
            session = None
            if target != "handle":
                import aiohttp

                session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            lat, tally = [], {"ok": 0, "status": {}, "lost": 0, "wrong": 0, "max_diff": 0.0, "errors": []}
            stop = time.perf_counter() + seconds

            async def one(rng):
                while time.perf_counter() < stop:
                    i = rng.randrange(len(self.requests))
                    bad = rng.random() < bad_share
                    t0 = time.perf_counter()
                    try:
                        if handle is not None:
                            r = self.requests[i]
                            got = await (handle.infer.remote(**r) if isinstance(r, dict) else handle.infer.remote(r))
                            status = 200
                        else:
                            body = BAD_BODIES[rng.randrange(len(BAD_BODIES))] if bad else self.bodies[i]
                            async with session.post(target, data=body,
                                                    headers={"Content-Type": "application/json"}) as resp:
                                status = resp.status
                                got = (await resp.json())["outputs"] if status == 200 else None
                    except Exception as e:  # noqa: BLE001 - a request without an answer: lost
                        tally["lost"] += 1
                        tally["errors"].append(f"{type(e).__name__}: {e}"[:200])
                        continue
                    lat.append(time.perf_counter() - t0)
                    tally["status"][status] = tally["status"].get(status, 0) + 1
                    if bad and not 400 <= status < 500:
                        tally["wrong"] += 1
                    if not bad and status != 200:
                        tally["wrong"] += 1
                    if not bad and status == 200 and check:
                        self._check(i, got, tally)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(random.Random(seed * 1000 + j)) for j in range(k)))
            wall = time.perf_counter() - t0
            if session is not None:
                await session.close()
            tally["errors"] = tally["errors"][:5]
            return lat, wall, tally

    return Clients


def race_row(actors, target, app, seconds, bad_share=0.0, check=True):
    import ray

    k = CLIENTS // len(actors)
    outs = ray.get([a.run.remote(target, app, k, seconds, s, bad_share, check) for s, a in enumerate(actors)])
    lat = sorted(v for o in outs for v in o[0])
    wall = max(o[1] for o in outs)
    tally = {"lost": sum(o[2]["lost"] for o in outs), "wrong": sum(o[2]["wrong"] for o in outs),
             "max_diff": max(o[2]["max_diff"] for o in outs), "status": {},
             "errors": [e for o in outs for e in o[2]["errors"]][:5]}
    for o in outs:
        for s, n in o[2]["status"].items():
            tally["status"][s] = tally["status"].get(s, 0) + n
    q = lambda p: 1e3 * lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")  # noqa: E731
    return {"requests": len(lat), "req_s": len(lat) / wall, "p50_ms": q(0.5), "p99_ms": q(0.99), **tally}


# ------------------------------------------------------------------ the runs

def _start(gpus):
    import ray
    from ray import serve

    path = os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])
    ray.init(num_gpus=gpus, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
             log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def _expected(factory, requests, device):
    model = factory().to(device)
    out = []
    with torch.no_grad():
        for r in requests:
            r = {k: v.to(device) for k, v in r.items()}
            out.append(model(**r).float().cpu())
    del model
    return out


def _print(name, row):
    print(f"  {name:58s} {row['req_s']:8.0f} req/s  p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms  "
          f"lost {row['lost']}  wrong {row['wrong']}  status {row['status']}  max diff {row['max_diff']:.2e}"
          + (f"  errors {row['errors']}" if row["errors"] else ""), flush=True)


def race(a, rows):
    from ray import serve
    from text import workload

    import graphwrap.serve

    cuda = torch.cuda.is_available()
    factory = small_bert if a.smoke else bert_base
    vocab = 30522
    requests = workload(vocab, "cpu", 300 if not a.smoke else 30)
    port = _start(1 if cuda else 0)
    gpus = 0.5 if cuda else 0
    expected = _expected(factory, requests, "cuda" if cuda else "cpu")
    sample = requests[0]
    graphed = {"seq_dim": 1, "max_batch_size": 64}
    serve.run(graphwrap.serve.deployment(factory, name="gw", sample=sample, num_gpus=gpus, graphed=graphed),
              name="gw", route_prefix="/gw")
    actors = [client_actor().remote(requests, expected) for _ in range(a.client_actors)]
    plains = [tuple(float(v) for v in c.split(":")) for c in a.plain.split(",")]
    for mb, wait in plains:
        serve.run(plain_app(factory, int(mb), wait, gpus), name="plain", route_prefix="/plain")
        for target, label in (("handle", "handles"), (f"http://127.0.0.1:{port}/plain", "HTTP")):
            race_row(actors, target, "plain", min(2.0, a.seconds))  # warm-up
            row = race_row(actors, target, "plain", a.seconds)
            name = f"plain @serve.batch(max_batch_size={int(mb)}, batch_wait_timeout_s={wait}), {label}"
            rows.append({"row": name, **row})
            _print(name, row)
        serve.delete("plain")
    for target, label, bad in (("handle", "handles", 0.0), (f"http://127.0.0.1:{port}/gw", "HTTP", 0.0),
                               (f"http://127.0.0.1:{port}/gw", "HTTP, 1% malformed", 0.01)):
        race_row(actors, target, "gw", min(2.0, a.seconds))
        row = race_row(actors, target, "gw", a.seconds, bad)
        name = f"graphwrap.serve (seq_dim=1, max_batch_size=64), {label}"
        rows.append({"row": name, **row})
        _print(name, row)
    stats = serve.get_app_handle("gw").stats.remote().result(timeout_s=60)
    b = stats["batcher"]
    print(f"  graphwrap replica: {b['requests']} requests in {b['module_calls']} module calls, eager calls "
          f"{stats['graphs']['eager_calls']}, padded tokens {stats['graphs']['padded_token_share']:.1%}, "
          f"http {stats['http_status']}", flush=True)
    rows.append({"row": "graphwrap replica stats", "requests": b["requests"], "module_calls": b["module_calls"],
                 "eager_calls": stats["graphs"]["eager_calls"], "http_status": stats["http_status"]})


def replicas(a, rows):
    from ray import serve
    from text import workload

    import graphwrap.serve

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    port = _start(gpus)
    del port
    g = torch.Generator().manual_seed(0)
    mlp_reqs = [torch.randn(random.Random(i).randint(1, 8), 1024, generator=g) for i in range(300)]
    text_reqs = workload(30522, "cpu", 300 if not a.smoke else 30)
    models = [("seed MLP", seed_mlp, mlp_reqs, {"max_batch_size": 64}),
              ("BERT-base fp16" if not a.smoke else "small BERT", small_bert if a.smoke else bert_base, text_reqs,
               {"seq_dim": 1, "max_batch_size": 64})]
    for label, factory, reqs, graphed in [m for m, k in zip(models, ("mlp", "bert")) if k in a.models.split(",")]:
        actors = [client_actor().remote(reqs, None) for _ in range(a.client_actors)]
        for n in (1, 2):
            if n > max(gpus, 1):
                print(f"  {label}: {n} replicas need {n} GPUs, this machine has {gpus}", flush=True)
                continue
            sample = reqs[0] if isinstance(reqs[0], dict) else (reqs[0],)
            serve.run(graphwrap.serve.deployment(factory, name="gw", sample=sample, num_replicas=n,
                                                 num_gpus=1 if cuda else 0, graphed=graphed),
                      name="gw", route_prefix="/gw")
            race_row(actors, "handle", "gw", min(2.0, a.seconds), check=False)
            row = race_row(actors, "handle", "gw", a.seconds, check=False)
            name = f"{label}: graphwrap.serve, {n} replica{'s' if n > 1 else ''} ({n} GPU{'s' if n > 1 else ''}), handles"
            rows.append({"row": name, **row})
            _print(name, row)
            serve.delete("gw")
        for x in actors:
            import ray

            ray.kill(x)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("race", "replicas"))
    ap.add_argument("--seconds", type=float, default=8.0, help="timed seconds per row (default 8)")
    ap.add_argument("--client-actors", type=int, default=8, help="processes the 64 clients are spread over")
    ap.add_argument("--plain", default="16:0.005,64:0.01",
                    help="the plain deployment's max_batch_size:batch_wait_timeout_s settings, comma-separated")
    ap.add_argument("--models", default="mlp,bert", help="models of the replicas mode: mlp, bert or both")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check the script")
    ap.add_argument("--out", default=None, help="folder for results.json and results.md")
    a = ap.parse_args(argv)
    from harness import environment

    env = environment()
    import ray

    print(f"serve_race {a.mode}: {env['device']} x{max(torch.cuda.device_count(), 1)}, torch {env['torch']}, "
          f"ray {ray.__version__}, graphwrap {env['graphwrap']}, {env['date']}", flush=True)
    rows = []
    try:
        (race if a.mode == "race" else replicas)(a, rows)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"env": {**env, "ray": ray.__version__}, "mode": a.mode, "seconds": a.seconds,
                       "clients": CLIENTS, "rows": rows}, f, indent=1, default=str)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write(f"## serve_race {a.mode} ({env['device']}, torch {env['torch']}, ray {ray.__version__}, "
                    f"{env['date']}; {CLIENTS} clients, {a.seconds:.0f} s per row)\n\n"
                    "| row | req/s | p50 ms | p99 ms | lost | wrong | statuses |\n|---|---|---|---|---|---|---|\n")
            for r in rows:
                if "req_s" in r:
                    f.write(f"| {r['row']} | {r['req_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['lost']} "
                            f"| {r['wrong']} | {r['status']} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
