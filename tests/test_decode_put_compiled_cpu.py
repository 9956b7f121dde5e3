"""Writes into the paged pool while torch.compile traces (graphwrap/decoding/kernels/step_write.py's
``put``, torch's operator ``graphwrap::put_slots``): Inductor's code on the CPU writes into the
pools in place and the attention after it reads what was written. Traced as an indexed
assignment beside the attention's view of the same pool, Inductor copied the whole pool to a
buffer and back on every forward, which made ``compile=True``'s decode steps slower than plain
graphs on the GPU."""

import re

import pytest
import torch

from graphwrap.decoding.kernels import paged_attention, step_write

pytest.importorskip("torch._inductor", reason="needs torch's Inductor")


def _pools(blocks=512, block=16, heads=2, d=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(blocks, block, heads, d, generator=g), torch.randn(blocks, block, heads, d, generator=g))


def _step(keys, values, direct, where, offset, k, v, q, table, lengths):
    """A step's layer as the batch runs it: the new keys and values put into their slots, then
    the paged attention over the pools (the keys through a view of their own, as the kernel
    gets them)."""
    step_write.put(keys, values, where, offset, k, v)
    return paged_attention.attend(q, direct, values, table, lengths)


def _inputs(keys):
    n, heads, d = 3, keys.shape[2], keys.shape[3]
    g = torch.Generator().manual_seed(1)
    table = torch.tensor([[5, 9, 0, 0], [7, 2, 0, 0], [11, 3, 0, 0]])
    lengths = torch.tensor([20, 17, 32])
    pos = lengths - 1  # each row's new position
    where, offset = table[torch.arange(n), pos // 16], pos % 16
    k, v = torch.randn(n, heads, d, generator=g).half(), torch.randn(n, heads, d, generator=g).half()
    q = torch.randn(n, heads, 1, d, generator=g)
    return where, offset, k, v, q, table, lengths


def test_put_casts_to_the_pools_dtype_and_writes_each_slot():
    keys, values = _pools()
    where, offset, k, v, *_ = _inputs(keys)
    want_k, want_v = keys.clone(), values.clone()
    want_k[where, offset], want_v[where, offset] = k.float(), v.float()
    step_write.put(keys, values, where, offset, k, v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_a_compiled_step_writes_the_pools_in_place_and_attends_over_what_it_wrote():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    keys, values = _pools()
    ek, ev = keys.clone(), values.clone()
    args = _inputs(keys)
    want = _step(ek, ev, ek.view(ek.shape), *args)
    got, code = run_and_get_code(torch.compile(_step, fullgraph=True), keys, values, keys.view(keys.shape), *args)
    assert torch.equal(keys, ek) and torch.equal(values, ev), "every slot written, nothing else"
    assert torch.allclose(got, want, atol=1e-5), "the attention read the new keys and values"
    shape = ", ".join(str(s) for s in keys.shape)
    copies = [line for c in code for line in c.splitlines() if re.search(r"empty_strided\w*\(\(" + shape + r"\)", line)]
    assert not copies, f"a buffer of the pool's size in the compiled code: {copies}"


def _fp8_step(keys, values, direct, where, offset, k, v, q, table, lengths):
    """:func:`_step` over FP8 pools (graphwrap/decoding/cache/fp8.py): the write scales, the
    attention reads back with the same scales."""
    from graphwrap.decoding.cache.fp8 import Scales

    scales = Scales(0.05, 0.02)
    step_write.put(keys, values, where, offset, k, v, scales)
    return paged_attention.attend(q, direct, values, table, lengths, fp8_scales=scales)


def test_a_compiled_step_over_fp8_pools_writes_and_reads_them_as_eager_does():
    torch._dynamo.reset()
    keys, values = (t.to(torch.float8_e4m3fn) for t in _pools())
    ek, ev = keys.clone(), values.clone()
    args = _inputs(keys)
    want = _fp8_step(ek, ev, ek.view(ek.shape), *args)
    got = torch.compile(_fp8_step, fullgraph=True)(keys, values, keys.view(keys.shape), *args)
    assert torch.equal(keys.view(torch.uint8), ek.view(torch.uint8))
    assert torch.equal(values.view(torch.uint8), ev.view(torch.uint8))
    assert torch.allclose(got, want, atol=1e-5) and want.abs().sum() > 0
