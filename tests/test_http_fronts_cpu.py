"""Several HTTP processes over one engine process (``serve --api-servers N``), on a CPU: the
engine's side of more connections than its parent's (each a worker; one that closes or goes away
detaches, its calls cancelled, and the batch serves on); ``--api-servers`` refused where it
cannot run; and the command itself: two HTTP processes on one port, every answer greedy
generate's, both serving, and one SIGTERM ending all three processes."""

import concurrent.futures
import time
from multiprocessing.connection import Client

import pytest
import torch

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
pytest.importorskip("uvicorn", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')

import tiny_lm  # noqa: E402
from helpers import Served  # noqa: E402

from graphwrap.serve.api import cli, engine_process, fronts  # noqa: E402

STEP = 0.01  # seconds each forward of the engine's model sleeps (so that a request is still running when its connection goes)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm")))


def _items(conn, want, seconds=60.0):
    """What the engine sent on ``conn`` until ``want(items so far)`` holds."""
    got = []
    deadline = time.monotonic() + seconds
    while not want(got):
        assert conn.poll(max(0.0, deadline - time.monotonic())), f"timed out; got {got}"
        got += conn.recv()
    return got


def _ends(got):
    return {i[1]: i for i in got if i[0] == "e"}


def test_other_connections_to_the_engine_are_served_and_detach_without_closing_the_batch(model_dir):
    from graphwrap import GraphedModule

    model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hook = model.register_forward_pre_hook(lambda m, a: time.sleep(STEP))
    gm = GraphedModule(model, decode={"rows": 4})
    info = {"eos": [], "generation": None, "context": 128, "vocab": 100}
    peers = []
    address, key = engine_process._listen(gm, engine_process.GcClock(), None, info, peers)
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        want = model.generate(torch.tensor([[5, 6, 7]]), **kw)[0, 3:].tolist()
    try:
        with pytest.raises(Exception):  # (a stranger without the key)
            Client(address, authkey=b"wrong").recv()
        a, b = Client(address, authkey=key), Client(address, authkey=key)
        assert a.recv() == ("ready", info) and b.recv() == ("ready", info)
        a.send(("submit", 1, [5, 6, 7], kw, None))
        b.send(("submit", 1, [5, 6, 7], kw, None))  # (the same id on another connection: its own)
        for conn in (a, b):
            got = _items(conn, lambda g: 1 in _ends(g))
            tokens = [t for i in got if i[0] == "T" for r, t in zip(i[1], i[2]) if r == 1]
            assert tokens == want and _ends(got)[1][2:] == (6, want[-1], None)
        b.send(("submit", 2, [5, 6, 7], dict(kw, max_new_tokens=100), None))  # (0.5 s or more)
        _items(b, lambda g: any(i[0] == "q" and i[1] == 2 for i in g))
        b.close()  # (an HTTP process gone: its request is cancelled, the batch serves on)
        deadline = time.monotonic() + 30
        # (the row is freed on the decode thread, the call counted cancelled on the delivery one)
        while gm.stats()["decode"]["rows_busy"] or not gm.stats()["decode"]["cancelled"]:
            assert time.monotonic() < deadline, "the gone connection's call was never cancelled"
            time.sleep(0.05)
        a.send(("stats", 7))
        (stats,) = [i for i in _items(a, lambda g: any(i[0] == "s" for i in g)) if i[0] == "s"]
        assert stats[2]["api_servers"] == [1, 2] and stats[2]["decode"]["cancelled"] >= 1
        a.send(("close", True, 10))  # (another HTTP process's close: it detaches)
        assert ("closed", True) in _items(a, lambda g: ("closed", True) in g)
        assert not gm.__dict__["_gw_decode"].closed, "the batch is the server's to close"
        c = Client(address, authkey=key)
        assert c.recv()[0] == "ready"
        c.send(("submit", 3, [5, 6, 7], kw, None))
        assert _ends(_items(c, lambda g: 3 in _ends(g)))[3][2] == 6
        c.close()
    finally:
        gm.close(cancel=True, timeout=30)
        hook.remove()


@pytest.mark.parametrize("argv, words", [
    (["--api-servers", "0"], "at least 1"),
    (["--api-servers", "2", "--engine", "thread"], "--engine process"),
])
def test_api_servers_is_refused_where_it_cannot_run(model_dir, argv, words, capsys):
    assert cli.main([model_dir] + argv) == 2
    assert words in capsys.readouterr().err
    assert fronts.refused(cli.parser().parse_args([model_dir])) is None


def _serve(model_dir):
    """``python -m graphwrap serve --api-servers 2`` started, once ``/health`` answers 200."""
    return Served(model_dir, "--api-servers", "2", "--rows", "8", "--capture", "lazy", "--log-level", "warning")


def _ended(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


needs_linux = pytest.mark.skipif(fronts.refused(cli.parser().parse_args([".", "--api-servers", "2"])) is not None,
                                 reason="--api-servers above 1 needs Linux")


@needs_linux
def test_two_http_processes_share_one_port_and_one_batch_and_stop_at_one_sigterm(model_dir):
    srv = _serve(model_dir)
    try:
        tok = tr.AutoTokenizer.from_pretrained(model_dir)
        model = tr.AutoModelForCausalLM.from_pretrained(model_dir).eval()
        prompts = [" ".join(["the", "quick", "brown", "dog", "jumps"][: 1 + i % 5]) + f" {i}" for i in range(24)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:  # (a connection each: spread by the kernel)
            got = list(pool.map(lambda p: srv.complete(p, 8), prompts))
        for p, (status, body) in zip(prompts, got):
            ids = tok(p)["input_ids"]
            with torch.no_grad():
                want = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                      pad_token_id=tok.eos_token_id)
            assert status == 200 and body["choices"][0]["text"] == tok.decode(want[0, len(ids):]), body
        shares = srv.metric("graphwrap_engine_requests_total")
        assert len(shares) == 2 and sum(shares.values()) == len(prompts) and min(shares.values()) > 0, shares
    finally:
        srv.stop()
    with pytest.raises(OSError):
        srv.get("/health")


@needs_linux
def test_the_server_killed_leaves_no_process_holding_the_port(model_dir):
    """SIGKILL to the server's process: the engine process closes its batch and exits, and the
    other HTTP process drains and exits (it must not keep answering on the port)."""
    srv = _serve(model_dir)
    proc = srv.proc
    children = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    assert len(children) >= 2, children  # (the engine process and the other HTTP process)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 60
    while not all(_ended(c) for c in children):
        assert time.monotonic() < deadline, [c for c in children if not _ended(c)]
        time.sleep(0.2)
    with pytest.raises(OSError):
        srv.get("/health")
