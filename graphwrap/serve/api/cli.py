"""``python -m graphwrap serve MODEL``: load a Hugging Face causal LM and its tokenizer, wrap
the model, and serve the OpenAI API over HTTP until SIGTERM or Ctrl-C; then take no new
requests (503), let those running finish within ``--drain`` seconds, cut the rest (each stream
gets an error event and ``[DONE]``; a second signal cuts them at once), close the decode batch
and exit.
"""

import argparse
import concurrent.futures
import importlib.util
import logging
import os
import sys
from typing import Any, List, Optional

from .draining import CUT_GRACE, draining_server
from .loading import limits, over

logger = logging.getLogger("graphwrap.serve")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m graphwrap serve", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a Hugging Face model directory, or a hub id already in the local cache")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="the name clients ask for (default: MODEL)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32"),
                    help="auto: the checkpoint's dtype on a GPU, float32 on a CPU")
    ap.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    _batch_options(ap)
    ap.add_argument("--max-tokens-default", type=int, default=None,
                    help="new tokens of a chat request without max_tokens: the context left, at most this (default 2048)")
    ap.add_argument("--capture", default="first", choices=("first", "ahead", "lazy"),
                    help="first: capture the graphs of the step and prompt shapes a first burst meets at start (on "
                         "a GPU; the largest of each kind, which hold the others), the rest as requests need them, "
                         "beside the decode thread; ahead: every shape's at start (a later start); lazy: each when "
                         "first needed (the first requests run eagerly meanwhile)")
    ap.add_argument("--engine", default="process", choices=("process", "thread"),
                    help="process: the decode batch in a child process, the HTTP side's Python apart from it (the "
                         "faster); thread: both in one process")
    ap.add_argument("--api-servers", type=int, default=1,
                    help="HTTP processes over the one engine process, each taking a share of the connections on "
                         "the same port (Linux; with --engine process): for many streams, where one process's "
                         "event loop falls behind the batch")
    ap.add_argument("--data-parallel", type=int, default=1,
                    help="engine processes, each with the model and a decode batch of its own on its own GPU (engine "
                         "i sees the i-th alone; all on the CPU with --device cpu), behind the one server (with "
                         "--engine process)")
    ap.add_argument("--routing", default="prefix", choices=("prefix", "load"),
                    help="with --data-parallel, which engine takes a request: prefix: the one given a prompt that "
                         "starts alike (its prefix cache may hold it), else the least loaded; load: the least loaded")
    ap.add_argument("--drain", type=float, default=30.0, help="seconds running requests get to finish at shutdown")
    ap.add_argument("--api-key", default=os.environ.get("GRAPHWRAP_API_KEY"),
                    help="every request must carry 'Authorization: Bearer KEY' (401 otherwise; default: the "
                         "GRAPHWRAP_API_KEY variable, else none)")
    ap.add_argument("--api-key-everywhere", action="store_true",
                    help="the API key is asked on /health and /metrics too (by default they are open)")
    ap.add_argument("--max-body-mb", type=float, default=16.0, help="a request body's size, at most (413 past it)")
    ap.add_argument("--max-prompt-chars", type=int, default=None,
                    help="characters of a request's prompt text, at most, checked before it is tokenized "
                         "(default: 32 per position of the context)")
    ap.add_argument("--tool-call-parser", default="auto", choices=("auto", "hermes", "llama3_json", "none"),
                    help="how a chat's tool calls are read from the model's text with tool_choice auto (auto: the "
                         "format its chat template shows, hermes or llama3_json, else none)")
    ap.add_argument("--http", default="auto", choices=("auto", "h11", "httptools"),
                    help="uvicorn's HTTP parser (auto: httptools where it is installed)")
    ap.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                    help="uvicorn's event loop (auto: uvloop where it is installed)")
    ap.add_argument("--log-level", default="info")
    return ap


def _batch_options(ap: argparse.ArgumentParser):
    """The shared decode batch's own options (``GraphedModule(model, decode={...})``) and the weights'."""
    ap.add_argument("--rows", type=int, default=None, help="sequences a decode step may hold (default: as many as the cache holds 512 positions for, 64 to 1,024, on a GPU; 64 on a CPU)")
    ap.add_argument("--max-len", type=int, default=None, help="positions a sequence may hold (default: the model's)")
    ap.add_argument("--max-queue", type=int, default=None, help="sequences waiting for a row before 429 (default 4096)")
    ap.add_argument("--cache-memory", type=float, default=None,
                    help="share of the GPU memory free after the weights that the KV cache takes (default 0.7)")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="keep the KV cache's full blocks by their content and reuse them for prompts that start "
                         "alike (on by default; docs/serving.md)")
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="prompt positions a turn may prefill in pieces of long prompts, beside the decoding rows' "
                         "step (default 2,048; 0: one piece a turn, the shortest gaps between other streams' tokens)")
    ap.add_argument("--prefill-whole", type=int, default=None,
                    help="positions up to which a long prompt that finds no row decoding is prefilled in one "
                         "forward (default 8,192; 0: always in pieces, so a request that comes meanwhile never waits "
                         "for it)")
    ap.add_argument("--prefill-beside", type=int, default=None,
                    help="prompt tokens a turn admits while other rows decode, so that a burst's prompts do not "
                         "hold those rows' next token for seconds (default 8,192; 0: no bound)")
    ap.add_argument("--quantization", default=None, choices=("fp8", "int8", "int4"),
                    help="the model's linear layers in FP8 (compute capability 8.9 or later), or int8 or int4 "
                         "weight-only (graphwrap's own, fp16 or bf16): graphwrap.quantize")
    ap.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8"),
                    help="the KV cache's dtype: auto (the model's) or fp8 (E4M3 with scales per layer: half the "
                         "memory a position, twice the positions; docs/quantization.md)")


def load(a: argparse.Namespace, engine: Optional[str] = None):
    """The :class:`~.app.Served` of these arguments: the model loaded, wrapped and its decode
    batch made, in this process (``engine="thread"``) or in a child (``"process"``; default:
    ``a.engine``)."""
    if (engine or getattr(a, "engine", "thread")) == "process":
        return _over_engines(a)
    from .loading import load_here

    return limits(a, load_here(a))


def _over_engines(a: argparse.Namespace):
    """The engine processes started and the tokenizer loaded here meanwhile, on a thread, the HTTP
    side's modules imported there too (after them, those imports and the tokenizer's load were
    time on the way to ready); if the tokenizer fails, the engines are closed and its error
    raised."""
    from . import routed
    from .remote import Remote

    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphwrap-tokenizer") as pool:
        tok = pool.submit(_http_side, a)
        remote: Any = (routed.start(a, lambda mine: Remote(mine, a.log_level)) if getattr(a, "data_parallel", 1) > 1
                       else Remote(a, a.log_level))
        try:
            return over(a, remote, tok.result())
        except BaseException:
            remote.close(cancel=True, timeout=5)
            raise


def _http_side(a: argparse.Namespace):
    """The tokenizer, loaded while the engine process starts, and the HTTP side's modules
    imported meanwhile (FastAPI, pydantic, uvicorn)."""
    import uvicorn  # noqa: F401

    from . import app  # noqa: F401
    from .loading import tokenizer_of

    return tokenizer_of(a)


def main(argv: Optional[List[str]] = None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if any(importlib.util.find_spec(m) is None for m in ("uvicorn", "fastapi", "transformers")):
        print("python -m graphwrap serve needs FastAPI, uvicorn and transformers: from a clone, "
              "python3 -m pip install -e '.[http]'", file=sys.stderr)
        return 2
    from . import fronts, routed

    why = fronts.refused(a) or routed.refused(a)
    if why is not None:
        print(f"python -m graphwrap serve: {why}", file=sys.stderr)
        return 2
    # The engine process starts first: this process has imported neither torch nor the HTTP side
    # yet (graphwrap's packages import their names on first use), and imports them meanwhile.
    others = fronts.Others(a) if a.api_servers > 1 else None  # (they start while the engine loads)
    try:
        served = load(a)
    except BaseException:
        if others is not None:
            others.stop(5)
        raise
    import uvicorn

    from .app import make_app

    Draining = draining_server()
    app = make_app(served)
    if a.engine == "thread":  # (the engine process does the same for itself)
        from .loading import freeze_startup

        freeze_startup()

    config = uvicorn.Config(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=1,
                            http=a.http, loop=a.loop)
    if others is not None:
        try:
            others.serve(served.engine.fronts)
        except RuntimeError as e:
            logger.error("%s", e)
            others.stop(0)
            served.engine.close(cancel=True, timeout=a.drain)
            return 1
    logger.info("serving %s at http://%s:%d/v1%s%s", served.name, a.host, others.port if others else a.port,
                f" from {a.api_servers} HTTP processes" if others else "",
                f" over {a.data_parallel} engine processes ({a.routing} routing)" if a.data_parallel > 1 else "")
    Draining(config, served, a.drain, others.procs if others else ()).run(
        sockets=[others.sock] if others is not None else None)
    if others is not None:
        others.stop(a.drain + CUT_GRACE + 5)
    done = served.engine.close(cancel=True, timeout=a.drain)
    logger.info("stopped%s", "" if done else " (the decode batch was still finishing)")
    return 0
