"""Small helpers the tests keep using."""

import collections
import dataclasses
import threading
from collections import OrderedDict
from typing import Optional

import torch
from torch import nn


class MLP(nn.Module):
    """The seed notebook's model: Linear/ReLU stack."""

    def __init__(self, d_in=32, hidden=64, d_out=16):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
        )

    def forward(self, x):
        return self.layers(x)


class Slow(nn.Module):
    """Long compute next to tiny copies: ``depth`` layers of ``width`` (the host runs ahead of the device)."""

    def __init__(self, width: int = 64, depth: int = 200):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.depth = depth

    def forward(self, x):
        for _ in range(self.depth):
            x = torch.tanh(self.lin(x))
        return x


class KVCache:
    """A cache object as models return: tensors inside a class of its own, registered with
    torch.utils._pytree (below) and with no __eq__."""

    def __init__(self, keys, values):
        self.keys, self.values = list(keys), list(values)


class Opaque:
    """An object holding a tensor, not registered anywhere."""

    def __init__(self, t):
        self.t = t


class NeedsAName(dict):
    """A dict whose constructor wants a name first: ``t(d)`` makes an empty one named ``d``."""

    def __init__(self, name, *args):
        super().__init__(*args)
        self.name = name


_register = getattr(torch.utils._pytree, "register_pytree_node", None) or torch.utils._pytree._register_pytree_node
_register(KVCache, lambda c: ([c.keys, c.values], len(c.keys)), lambda children, n: KVCache(*children))


class WithCache(nn.Module):
    """An MLP that also returns a KVCache of two batched tensors per layer."""

    def __init__(self, d=32, layers=2):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        keys, values = [], []
        for lin in self.lins:
            x = torch.relu(lin(x))
            keys.append(x * 2)
            values.append(x.sum(-1, keepdim=True))
        return x, KVCache(keys, values)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: Optional[torch.Tensor] = None
    tag: str = "x"


class ModelOutputLike(OrderedDict):
    """Mimics transformers' ModelOutput: a dataclass and an OrderedDict of the fields set."""

    def __init_subclass__(cls):
        super().__init_subclass__()

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                self[f.name] = v


@dataclasses.dataclass
class HFOut(ModelOutputLike):
    last_hidden_state: Optional[torch.Tensor] = None
    pooler_output: Optional[torch.Tensor] = None
    attentions: Optional[torch.Tensor] = None


class MultiIO(nn.Module):
    """Several inputs, kwargs, constants and a nested, typed output."""

    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.register_buffer("bias", torch.randn(d))

    def forward(self, x, pair, *, scale=1.0, mode="sum", extra=None):
        y = self.a(x) * scale + self.b(pair[0]) + pair[1]["m"]
        if mode == "sum":
            y = y + self.bias
        out = {"y": y, "both": (y, x * 2), "w": self.bias * 3}
        if extra is not None:
            out["extra"] = extra + 1
        return Out(logits=y, hidden=x + 1), out, 7


class RowMixer(nn.Module):
    """Each row's output depends on the other rows: must never be padded."""

    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x - x.mean(0, keepdim=True))


def assert_same(a, b, tol=1e-5):
    """Recursively compare two outputs (tensors within ``tol``, everything else equal)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), (type(a), type(b))
        assert a.shape == b.shape, (a.shape, b.shape)
        assert a.dtype == b.dtype
        assert a.device == b.device, (a.device, b.device)
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    elif dataclasses.is_dataclass(a) and not isinstance(a, dict):
        assert type(a) is type(b)
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), tol)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a.keys()) == list(b.keys())
        for k in a:
            assert_same(a[k], b[k], tol)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, tol)
    elif type(a) in torch.utils._pytree.SUPPORTED_NODES:
        assert type(a) is type(b)
        flatten = torch.utils._pytree.SUPPORTED_NODES[type(a)].flatten_fn
        (ca, xa), (cb, xb) = flatten(a), flatten(b)
        assert xa == xb
        assert_same(list(ca), list(cb), tol)
    else:
        assert a == b, (a, b)


def gpu_mlp(**kw):
    """The test MLP on the GPU, in eval mode."""
    return MLP(**kw).to("cuda").eval()


def eager_answer(model, *args, **kwargs):
    """The module's own answer, as graphwrap must give it: the forward without grad."""
    with torch.no_grad():
        return model(*args, **kwargs)


def replays(gm) -> int:
    """How many calls the GraphedModule's graphs served, over all keys and buckets."""
    return sum(b["replays"] for k in gm.stats()["keys"] for b in k["buckets"].values())


def num_graphs(gm) -> int:
    """How many graphs the GraphedModule holds, over all keys and buckets."""
    return sum(b["graphs"] for k in gm.stats()["keys"] for b in k["buckets"].values())


def run_threads(work, count: int = 8):
    """Run ``work(i)`` in ``count`` threads at once; the exceptions they raised, in a list."""
    errors = []

    def guarded(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - collected and asserted on by the caller
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def small_bert(tr, device):
    """A two-layer BertModel from its config (transformers module ``tr``), and the config."""
    cfg = tr.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
    return tr.BertModel(cfg).to(device).eval(), cfg


def check_bert(gm, model, cfg, sizes, device):
    """gm against eager on masked BERT inputs of each batch size: output type and both outputs."""
    for n in sizes:
        ids = torch.randint(0, cfg.vocab_size, (n, 16), device=device)
        mask = torch.ones(n, 16, dtype=torch.long, device=device)
        mask[:, 12:] = 0
        got = gm(input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask)
        assert type(got) is type(want)
        torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------------------
# A CPU stand-in for CUDA graphs: the engine's whole path (keys, buckets, padding, plans, joins,
# failures, the memory budget) runs on a CPU, with "graphs" that recompute on replay.


class RecomputeGraph:
    """replay() runs the recorded forward again on the static inputs and writes its outputs into
    the static outputs in place, as a graph replay would."""

    def __init__(self, run, static_out):
        self.run, self.static_out = run, static_out

    def replay(self):
        from graphwrap.core.tree import flatten_outputs

        with torch.no_grad():
            outs, _ = flatten_outputs(self.run())
        for dst, src in zip(self.static_out, outs):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


class RecomputeRecorder:
    """The recorder of graphwrap.capture.graph, for the CPU: nothing to lock, no streams."""

    def __init__(self):
        import contextlib
        self.session = lambda device: contextlib.nullcontext()
        self.records = 0

    @staticmethod
    def watch_random(fn):
        return fn(), False

    @staticmethod
    def check_budget(device, run, size, budget_left):
        from graphwrap.capture.checks import CaptureFailed, Scope
        from graphwrap.core.tree import flatten_outputs

        need = sum(o.numel() * o.element_size() for o in flatten_outputs(run())[0] if isinstance(o, torch.Tensor))
        if need > budget_left:
            err = CaptureFailed(f"bucket {size} needs {need} bytes, {budget_left} are left", scope=Scope.BUDGET)
            err.pool_estimate = need
            raise err
        return need

    def record(self, device, pool, run, draws, size):
        from graphwrap.core.tree import flatten_outputs

        self.records += 1
        out = run()
        leaves = flatten_outputs(out)[0]
        grown = sum(o.numel() * o.element_size() for o in leaves if isinstance(o, torch.Tensor))
        return RecomputeGraph(run, leaves), out, grown, None  # the "pool" grows by the outputs' bytes

    @staticmethod
    def verify(device, autocast, check):
        import time
        t0 = time.perf_counter()
        with torch.no_grad():
            check()
        return time.perf_counter() - t0


def _copier(dsts, srcs):
    def fill():
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    return fill


class CpuBackend:
    """The engine's backend for the CPU tests: graphs on the module's CPU, recomputed on replay."""

    kind = "cpu-test"

    def __init__(self):
        self.recorder = RecomputeRecorder()

    @staticmethod
    def device_for(module_device, leaves):
        return module_device if module_device is not None else torch.device("cpu")

    @staticmethod
    def new_pool(device):
        return None

    @staticmethod
    def slot_maker(device, pool, run, draws, kinds):
        """Slots whose fill runs the forward and writes its outputs into the slot, as on a GPU."""
        from graphwrap.core.tree import CONST, flatten_outputs

        def make_fill(bases, warm=True):
            from graphwrap.process import CAPTURE_LOCK

            with CAPTURE_LOCK:  # a slot's fill is a capture on a GPU: one at a time in the process
                pass

            def fill():
                with torch.no_grad():
                    outs = flatten_outputs(run())[0]
                for d, o in zip(bases, (o for o, k in zip(outs, kinds) if k != CONST)):
                    d.copy_(o)
            return fill
        return make_fill

    @staticmethod
    def sync(device=None):
        pass

    @staticmethod
    def timed(fn, k):
        import time
        t0 = time.perf_counter()
        fn(k)
        return (time.perf_counter() - t0) / k

    @staticmethod
    def empty_cache():
        pass


def on_cpu_graphs(gm):
    """``gm`` with its engine on the CPU stand-in for CUDA graphs; returns ``gm``."""
    gm.engine.backend = CpuBackend()
    gm.engine.where = None
    return gm


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cli(model_dir: str, *args: str, timeout: float = 120.0):
    """``python -m graphwrap serve model_dir --port P *args`` started as a user runs it, and
    waited for until ``/health`` answers 200: ``(process, port)`` (output on its stdout)."""
    import http.client
    import os
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "graphwrap", "serve", model_dir, "--port", str(port), *args],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while True:
        if p.poll() is not None or time.monotonic() >= deadline:
            p.kill()
            raise AssertionError(f"the server did not start: {p.communicate()[0]}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return p, port
        except OSError:  # (not listening yet)
            time.sleep(0.2)


class Served:
    """``python -m graphwrap serve MODEL_DIR --served-model-name tiny --port P *args`` (``cwd``
    the repository) started, its output gathered as it comes (so a talkative log never fills
    the pipe), once ``/health`` answers 200. ``stop()`` sends SIGTERM and returns the log, once
    it exited 0."""

    def __init__(self, model_dir: str, *args: str, timeout: float = 180.0):
        import os
        import subprocess
        import sys
        import time

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "graphwrap", "serve", model_dir, "--served-model-name",
                                      "tiny", "--port", str(self.port), *args], cwd=root, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.out: list = []
        threading.Thread(target=lambda: self.out.extend(self.proc.stdout), daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the server did not start:\n{self.log()[-3000:]}")
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:  # (not listening yet)
                time.sleep(0.2)

    def log(self) -> str:
        return b"".join(self.out).decode()

    def get(self, path: str):
        """``GET path``: (status, text)."""
        import http.client

        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()

    def metric(self, name: str) -> dict:
        """``{labels: value}`` of one labelled family of ``/metrics``."""
        out = {}
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + "{"):
                labels, value = line[len(name):].rsplit(" ", 1)
                out[labels] = float(value)
        return out

    def complete(self, prompt, max_tokens: int):
        """A greedy completion of ``prompt`` (text or ids), the end of sequence ignored, on a
        connection of its own: (status, JSON answer)."""
        import http.client
        import json

        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())

    def stop(self, timeout: float = 90.0) -> str:
        import signal
        import subprocess

        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"no exit {timeout:.0f} s after SIGTERM:\n{self.log()[-6000:]}") from None
        assert code == 0, self.log()[-3000:]
        return self.log()


_RAY_PORT: list = []  # the local Ray instance's Serve port, once started (one per test process)


def ray_serving() -> int:
    """The test process's local Ray instance with Serve, started on first use (this repository and
    its tests on the replicas' path; :func:`ray_stop` ends it at the session's end): its HTTP
    port. One instance a process: each start and shutdown of Ray's core leaves threads behind for
    the interpreter's exit."""
    import os

    import ray
    from ray import serve

    if not _RAY_PORT:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join([root, os.path.join(root, "tests"), os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
        _RAY_PORT.append(free_port())
        serve.start(http_options={"host": "127.0.0.1", "port": _RAY_PORT[0]})
    return _RAY_PORT[0]


def ray_generation(model_dir: str, name: str, **options):
    """``graphwrap.serve.generation_deployment(model_dir, **options)`` served as ``name`` at ``/``
    on :func:`ray_serving`'s instance: yields the HTTP port, then deletes the application (a
    fixture's body)."""
    from ray import serve

    import graphwrap.serve

    port = ray_serving()
    serve.run(graphwrap.serve.generation_deployment(model_dir, **options), name=name, route_prefix="/")
    try:
        yield port
    finally:
        serve.delete(name)


def ray_stop():
    """Serve and Ray shut down, where :func:`ray_generation` started them."""
    if _RAY_PORT:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        _RAY_PORT.clear()


def post_json(port: int, body, route: str, timeout: float = 120):
    """POST ``body`` (an object sent as JSON, or bytes as they are) to ``/route``: (status, JSON answer)."""
    import json
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/{route}", data=data,
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Scales(nn.Module):
    """Preprocesses its input in place (divides it by 255), then a Linear layer."""

    def __init__(self, d=4):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        x.div_(255.0)
        return self.lin(x)


class Counter(nn.Module):
    """Counts its calls in a buffer and scales its output by the count: state the forward writes."""

    def __init__(self, d=4):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.steps += 1
        return self.fc(x) * self.steps


class RowCache(nn.Module):
    """Keeps each row's last input in a buffer and adds the previous one: state kept per row."""

    def __init__(self, rows=8, d=4):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("last", torch.zeros(rows, d))

    def forward(self, x):
        n = x.shape[0]
        prev = self.last[:n].clone()
        self.last[:n] = x
        return self.fc(x) + prev


class TensorCache(nn.Module):
    """A decode step whose KV cache comes in as a tensor it writes at ``pos`` (gpt-fast style,
    the cache held by the caller)."""

    def __init__(self, d=8):
        super().__init__()
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, cache, pos):
        cache.index_copy_(1, pos, self.kv(x))
        scores = self.q(x) @ cache.transpose(1, 2)
        mask = torch.arange(cache.shape[1], device=x.device) <= pos[-1]
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ cache


def thread_results(fn, n: int) -> list:
    """``fn(i)`` for i in range(n), each in a thread of its own, all at once; the results in
    order (a thread's exception fails the caller)."""
    out = [None] * n

    def work(i):
        out[i] = fn(i)

    errors = run_threads(work, n)
    assert not errors, errors
    return out


class IdsStreamer:
    """A streamer as graphwrap's server makes them: the batch's tokens as ints (``put_ids``), and
    with ``logprobs = k`` (None: none asked) each token's log-probabilities beside it; ``put``
    gets the prompt alone."""

    def __init__(self, logprobs=None):
        self.logprobs, self.ids, self.lps = logprobs, [], []

    def put(self, value):
        pass

    def put_ids(self, ids, logprobs=None):
        self.ids += ids
        self.lps += logprobs or [None] * len(ids)

    def end(self):
        pass


def same_or_near_tie(model, ids, out, k: int):
    """``out`` is ``model.generate``'s greedy ``k`` tokens after ``ids``, or parts from them where
    eager's two best logits were within four fp16 steps of each other (a tie to rounding)."""
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=k, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
    if torch.equal(out, want.sequences):
        return
    at = int((out[0] != want.sequences[0]).nonzero()[0]) - ids.shape[1]
    top2 = want.logits[at][0].float().topk(2).values
    assert top2[0] - top2[1] <= 4 * 2 ** -10 * top2[0].abs().clamp(min=1), (at, top2)


# ------------------------------------------------------------------ joined turns (graphwrap/decoding/callers/turns.py)


def hold_turn(t):
    """The turn held: calls that come queue for it."""
    with t.cond:
        t.busy = True


def release_turn(t, waiting):
    """The turn let go once ``waiting`` calls wait for it."""
    for _ in range(60_000):  # (a minute at most)
        with t.cond:
            if len(t.waiting) >= waiting:
                t.busy = False
                t.cond.notify_all()
                return
        threading.Event().wait(0.001)
    with t.cond:
        t.busy = False
        t.cond.notify_all()
    raise AssertionError(f"{len(t.waiting)} calls waited for the turn, not {waiting}")


def held_turn(t, n, fn, waiting=None):
    """``fn(i)`` in ``n`` threads, each queued while the turn is held (``waiting`` of them: all
    unless given), then the turn let go: what each returned, or the error it raised."""
    hold_turn(t)
    got = {}

    def go(i):
        try:
            got[i] = fn(i)
        except Exception as e:  # noqa: BLE001
            got[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    release_turn(t, n if waiting is None else waiting)
    for th in threads:
        th.join()
    return [got[i] for i in range(n)]


def generate_alone(model, calls, kw):
    out = []
    for c in calls:
        with torch.no_grad():
            out.append(model.generate(**c, **kw))
    return out


def ending_eos(model, name, calls, kw):
    """``kw`` with an end-of-sequence id that ends the calls' rows at different places (a token
    the rows make, tried by how many rows make it), and ``model.generate``'s output of each call
    alone with it."""
    rows = collections.Counter()
    for out in generate_alone(model, calls, dict(kw, min_new_tokens=kw["max_new_tokens"])):
        for row in out[:, out.shape[1] - kw["max_new_tokens"]:].tolist():
            rows.update(set(row))
    for token, _ in rows.most_common(8):
        ends = dict(kw, eos_token_id=token, pad_token_id=token) if name == "whisper" else dict(kw, eos_token_id=token)
        want = generate_alone(model, calls, ends)
        if len({w.shape[1] for w in want}) > 1:
            return ends, want
    raise AssertionError("no token ends these calls at different places")


def varied_weights(model):
    """Weights large enough that each input makes tokens of its own (at the initial scale these
    tiny models make one token over and over, whatever the input)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model
