"""The public API called as the README and the docstrings call it, for the type checker only
(``python -m mypy``, run by ``.ci/run``; nothing here is run). Each documented form of an option
must check; the lines marked ``type: ignore[...]`` must be errors: with ``warn_unused_ignores``,
an annotation loosened until they pass fails the check."""

import asyncio
import concurrent.futures
from typing import Any, Iterator, List, Tuple

import torch
from torch import nn

import graphwrap


def documented_forms(model: nn.Module, x: torch.Tensor) -> None:
    gm = graphwrap.GraphedModule(model)
    out: Any = gm(x)
    gm = graphwrap.GraphedModule(model, buckets="exact", max_batch_size=64)
    gm = graphwrap.GraphedModule(model, buckets=graphwrap.Adaptive(k=4))
    gm = graphwrap.GraphedModule(model, buckets=[1, 8, 32], outputs="view", fallback="raise")
    gm = graphwrap.GraphedModule(model, buckets=range(1, 9))
    gm = graphwrap.GraphedModule(model, seq_dim=1, seq_buckets="default", max_tokens=8192)
    gm = graphwrap.GraphedModule(model, seq_dim={"input_ids": 1, "attention_mask": 1}, seq_buckets=[32, 64, 128],
                                 pad_values={"input_ids": 0, "attention_mask": 0})
    gm = graphwrap.GraphedModule(model, batch_dim={"pos": None}, state="past_key_values")
    gm = graphwrap.GraphedModule(model, state=["cache", 2], compile=True, decode={"rows": 32})
    gm = graphwrap.GraphedModule(model, compile={"mode": "max-autotune-no-cudagraphs", "dynamic": "batch"},
                                 max_pool_bytes=1 << 30, eager_if_faster=False, verify=False, decode=False)
    buckets: Tuple[int, ...] = gm.buckets
    stats: dict = gm.capture(x)
    done: bool = gm.wait(timeout=5.0)
    outs: Iterator[Any] = gm.pipeline([x, x], to_host=True)
    fut: "concurrent.futures.Future[Any]" = gm.submit_generate(x, max_new_tokens=4)
    gm.reset()
    del out, buckets, stats, done, outs, fut


def the_loops(model: nn.Module, x: torch.Tensor) -> None:
    gm = graphwrap.GraphedModule(model)
    with graphwrap.Batcher(gm, max_delay_ms=0.5, max_queue=128) as batcher:
        out: Any = batcher(x)
        fut: "concurrent.futures.Future[Any]" = batcher.submit(x, block=False)
        asyncio.run(batcher.acall(x))
    with graphwrap.Replicas(lambda device: model.to(device), ["cuda:0", torch.device("cuda", 1)],
                            batcher={"max_delay_ms": 0.2}, buckets=[1, 8]) as replicas:
        stats: List[dict] = replicas.capture(x)
        out = replicas(x)
    table = graphwrap.BucketTable("exact", max_batch_size=8)
    del out, fut, stats, table


def refused(model: nn.Module) -> None:
    graphwrap.GraphedModule(model, buckets="powers")  # type: ignore[arg-type]
    graphwrap.GraphedModule(model, buckets=3.5)  # type: ignore[arg-type]
    graphwrap.GraphedModule(model, outputs="copy")  # type: ignore[arg-type]
    graphwrap.GraphedModule(model, fallback=None)  # type: ignore[arg-type]
    graphwrap.GraphedModule(model, verify="yes")  # type: ignore[arg-type]
    graphwrap.GraphedModule(model, seq_dim="1")  # type: ignore[arg-type]
    graphwrap.GraphedModule(model, decode={"rows": "64"})  # type: ignore[dict-item]
    graphwrap.GraphedModule(model, max_keys=None)  # type: ignore[arg-type]
    graphwrap.BucketTable("powers")  # type: ignore[arg-type]
