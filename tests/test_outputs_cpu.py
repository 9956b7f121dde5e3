"""The owned-output ring and its recycling rule, on the CPU with a plain copy as the fill."""

import gc

import pytest
import torch

from graphwrap import outputs
from graphwrap.tree import BATCHED, CONST, WHOLE

pytestmark = pytest.mark.skipif(not outputs.available(), reason="this torch cannot count a storage's references")


def _copier(dsts, srcs):
    def fill():
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    return fill


def _ring(static, kinds=None, max_slots=3):
    kinds = kinds or [BATCHED] * len(static)
    return outputs.OutputRing(static, kinds, 0, _copier, max_slots=max_slots)


def test_an_output_the_caller_holds_is_never_reused():
    static = torch.zeros(8, 4)
    ring = _ring([static])
    held = []
    for i in range(3):
        static.fill_(i)
        slot = ring.take("s")
        assert slot is not None
        slot.fill()
        held.append(slot.views(5)[0])
    assert len({t.data_ptr() for t in held}) == 3, "three held outputs, three slots"
    assert ring.take("s") is None, "every slot held: the caller clones"
    for i, t in enumerate(held):
        assert t.shape == (5, 4) and bool((t == i).all()), "held outputs keep their values"


def test_a_dropped_output_frees_its_slot_and_views_of_it_keep_it_held():
    static = torch.randn(4, 2)
    ring = _ring([static], max_slots=1)
    slot = ring.take("s")
    slot.fill()
    out = slot.views(4)[0]
    assert ring.take("s") is None
    row = out[1]  # a view of the output: the memory is still the caller's
    del out
    gc.collect()
    assert ring.take("s") is None
    del row
    assert ring.take("s") is slot


def test_a_slot_is_reused_only_on_the_stream_it_was_handed_out_on():
    ring = _ring([torch.randn(4, 2)], max_slots=2)
    a = ring.take("stream-1")
    b = ring.take("stream-2")
    assert a is not b and a.sid == "stream-1" and b.sid == "stream-2"
    assert ring.take("stream-1") is a and ring.take("stream-2") is b
    assert ring.take("stream-3") is None, "no free slot of that stream and no room for one"


def test_views_keep_whole_and_constant_outputs():
    batched, whole = torch.randn(6, 3), torch.randn(5)
    ring = _ring([batched, whole, "tag"], kinds=[BATCHED, WHOLE, CONST])
    slot = ring.take(0)
    slot.fill()
    b, w, c = slot.views(2)
    assert torch.equal(b, batched[:2]) and torch.equal(w, whole) and c == "tag"
    assert b.data_ptr() != batched.data_ptr() and w.data_ptr() != whole.data_ptr()


def test_no_ring_for_large_or_tensorless_outputs():
    assert outputs.ring_for(["a", 1], [CONST, CONST], 0, _copier) is None
    big = torch.empty(outputs.MAX_SLOT_BYTES // 4 + 1)
    assert outputs.ring_for([big], [WHOLE], 0, _copier) is None
    assert outputs.ring_for([torch.empty(3)], [WHOLE], 0, _copier) is not None


def test_a_fill_that_cannot_be_made_leaves_clones():
    tries = []

    def broken(dsts, srcs):
        tries.append(1)
        raise RuntimeError("no capture here")

    ring = outputs.OutputRing([torch.randn(2, 2)], [BATCHED], 0, broken)
    for _ in range(outputs.MAX_FAILURES + 2):
        assert ring.take(0) is None
    assert len(tries) == outputs.MAX_FAILURES and not ring.slots


def test_a_fill_that_failed_once_is_made_on_a_later_call():
    tries = []

    def flaky(dsts, srcs):
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("capture invalidated")
        return _copier(dsts, srcs)

    src = torch.randn(2, 2)
    ring = outputs.OutputRing([src], [BATCHED], 0, flaky)
    assert ring.take(0) is None
    slot = ring.take(0)
    assert slot is not None and len(tries) == 2
    slot.fill()
    assert torch.equal(slot.views(2)[0], src)
