"""Several HTTP processes over one engine process: ``python -m graphwrap serve --api-servers N``.

Every token of every stream is an event and a socket write on an HTTP process's one event loop.
With many streams that loop, not the batch, sets the pace (docs/serving.md has the figures). So
the server can run N HTTP processes (Linux), each with its own event loop, all serving the one
batch of the engine process:

- **The server's own process** binds the port with ``SO_REUSEPORT``, starts N - 1 more HTTP
  processes (spawned: none holds CUDA), and starts the engine process, as with one. The others
  import what they serve with and load the tokenizer meanwhile. Once the engine is ready each
  connects to it and binds the same port, and the server listens after them. The kernel spreads
  new connections over the N sockets.
- **Each other process** connects to the engine over a local socket, with a key made for this
  start, and gets a worker of its own there (``engine_process._listen``). Its requests, tokens
  and cancellations go over that connection alone.
- **Shutdown.** A SIGTERM to the server is passed on to the others (Ctrl-C reaches every process
  of the group). Each drains its own streams as one server would. The server waits for them,
  then closes the batch.
- **If one of the others ends,** the engine cancels its requests in flight, and the batch serves
  the rest. Its socket is gone, so new connections go to the processes left. **If the server's
  own process ends** (even killed), the engine process closes its batch and the others drain and
  exit, so that none holds the port.

Each process answers ``/metrics`` with its own HTTP counters and the batch's figures.
``graphwrap_requests_total`` therefore counts the requests of the process that answered the
scrape. The batch's ``stats()`` has ``api_servers``: the requests each process sent.
"""

import argparse
import logging
import multiprocessing
import socket
import sys
from typing import Any, List, Optional, Sequence

logger = logging.getLogger("graphwrap.serve")
START_TIMEOUT = 300.0  # seconds the other HTTP processes get to listen


def refused(a: argparse.Namespace) -> Optional[str]:
    """Why ``--api-servers`` cannot be as asked here (None where it can)."""
    n = getattr(a, "api_servers", 1)
    if n < 1:
        return f"--api-servers must be at least 1, got {n}"
    if n == 1:
        return None
    if a.engine != "process":
        return "--api-servers above 1 needs --engine process (the HTTP processes share the engine process's batch)"
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        return f"--api-servers above 1 needs Linux (SO_REUSEPORT spreads the connections), not {sys.platform}"
    return None


def listening(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that other processes may bind too (``SO_REUSEPORT``);
    port 0 takes a free one, which the others then bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Others:
    """The other ``a.api_servers - 1`` HTTP processes of a start, and the socket they share with
    the server. They start at once, each importing what it serves with and loading the tokenizer
    while the engine process loads the model; :meth:`serve` then hands them the engine's socket
    and waits until each listens."""

    def __init__(self, a: argparse.Namespace):
        self.sock = listening(a.host, a.port)
        self.port = self.sock.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        self.ready: List[Any] = []
        for i in range(1, a.api_servers):
            ours, theirs = ctx.Pipe()
            self.ready.append(ctx.Event())
            p = ctx.Process(target=run, args=(i, a, theirs, self.port, self.ready[-1]), name=f"graphwrap-http-{i}")
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)

    def serve(self, engine: Any):
        """Hand each the engine process's ``(address, key)`` and wait until each listens (the
        server listens after them: connections are spread over listening sockets only)."""
        import time

        if engine is None:
            raise RuntimeError("the engine process opened no socket for other HTTP processes")
        for conn in self.conns:
            conn.send(engine)
        t0 = time.monotonic()
        for p, r in zip(self.procs, self.ready):
            while not r.wait(0.5):
                if not p.is_alive() or time.monotonic() - t0 > START_TIMEOUT:
                    raise RuntimeError(f"HTTP process {p.name} did not start (exit code {p.exitcode}): its log "
                                       "says why")

    def stop(self, timeout: float):
        """Those still waiting for the engine told to go; all waited for up to ``timeout`` seconds
        (they drain as the server does), then killed."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        wait(self.procs, timeout)


def wait(procs: Sequence[Any], timeout: float):
    """Wait up to ``timeout`` seconds in all for the other HTTP processes to end (they drain as
    the server does); those still running then are killed."""
    import time

    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            logger.warning("HTTP process %s did not end in time: killed", p.name)
            p.kill()
            p.join(5)


def run(index: int, a: argparse.Namespace, conn: Any, port: int, ready: Any = None):
    """Another HTTP process's entry: the same app, over the engine process's batch (its socket
    sent on ``conn`` once the engine is ready; None: stop), on the shared port, until a signal
    drains it (``ready`` set once it listens)."""
    import uvicorn
    from transformers import AutoTokenizer

    from .app import make_app
    from .draining import CUT_GRACE, draining_server
    from .loading import over
    from .remote import Remote

    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s %(name)s[http {index}] %(levelname)s %(message)s")
    _follow_parent()
    tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    try:
        engine = conn.recv()
    except (EOFError, OSError):
        return
    if engine is None:
        return
    if isinstance(engine, list):  # (--data-parallel: each engine's socket; this process routes its own requests)
        from .routed import Routed

        served = over(a, Routed([Remote.connect(*e) for e in engine], a.routing), tok)
    else:
        served = over(a, Remote.connect(*engine), tok)
    config = uvicorn.Config(make_app(served), log_level=a.log_level, timeout_graceful_shutdown=1, http=a.http,
                            loop=a.loop)
    sock = listening(a.host, port)
    sock.listen(config.backlog)
    if ready is not None:
        ready.set()
    draining_server()(config, served, a.drain).run(sockets=[sock])
    served.engine.close(cancel=True, timeout=CUT_GRACE)


def _follow_parent():
    """A thread that drains this process (a SIGTERM to itself) once the server's process has
    ended, however it ended: the others must not hold the port after it."""
    import os
    import signal
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        parent.join()
        logger.warning("the server's process ended: this HTTP process stops")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="graphwrap-follow-parent", daemon=True).start()
