"""The owned-output ring and its recycling rule, on the CPU with a plain copy as the fill."""

import gc
import threading
import time

import pytest
import torch

from graphwrap.capture import slots as outputs
from graphwrap.core.tree import BATCHED, CONST, WHOLE

pytestmark = pytest.mark.skipif(not outputs.available(), reason="this torch cannot count a storage's references")


def _copier(dsts, srcs):
    def fill():
        for d, s in zip(dsts, srcs):
            d.copy_(s)
    return fill


def _copies_of(static, kinds):
    """``make_fill(bases)`` that copies the static outputs into the slot."""
    srcs = [o for o, k in zip(static, kinds) if k != CONST]
    return lambda bases, warm=True: _copier(bases, srcs)


def _ring(static, kinds=None, max_slots=3):
    kinds = kinds or [BATCHED] * len(static)
    return outputs.OutputRing(static, kinds, 0, _copies_of(static, kinds), max_slots=max_slots)


def _take(ring, sid):
    """A free slot for ``sid``, or a new one while the ring may grow (what the engine's worker
    adds when a call found every slot held)."""
    slot = ring.take(sid)
    if slot is None and ring.can_grow():
        new = ring.make()
        if new is not None:
            ring.add(new)
            slot = ring.take(sid)
    return slot


def test_an_output_the_caller_holds_is_never_reused():
    static = torch.zeros(8, 4)
    ring = _ring([static])
    held = []
    for i in range(3):
        static.fill_(i)
        slot = _take(ring, "s")
        assert slot is not None
        slot.fill()
        held.append(slot.views(5)[0])
    assert len({t.data_ptr() for t in held}) == 3, "three held outputs, three slots"
    assert _take(ring, "s") is None, "every slot held: the caller clones"
    for i, t in enumerate(held):
        assert t.shape == (5, 4) and bool((t == i).all()), "held outputs keep their values"


def test_a_dropped_output_frees_its_slot_and_views_of_it_keep_it_held():
    static = torch.randn(4, 2)
    ring = _ring([static], max_slots=1)
    slot = _take(ring, "s")
    slot.fill()
    out = slot.views(4)[0]
    assert _take(ring, "s") is None
    row = out[1]  # a view of the output: the memory is still the caller's
    del out
    gc.collect()
    assert _take(ring, "s") is None
    del row
    assert _take(ring, "s") is slot


def test_a_slot_is_reused_only_on_the_stream_it_was_handed_out_on():
    ring = _ring([torch.randn(4, 2)], max_slots=2)
    a = _take(ring, "stream-1")
    b = _take(ring, "stream-2")
    assert a is not b and a.sid == "stream-1" and b.sid == "stream-2"
    assert _take(ring, "stream-1") is a and _take(ring, "stream-2") is b
    assert _take(ring, "stream-3") is None, "no free slot of that stream and no room for one"


def test_views_keep_whole_and_constant_outputs():
    batched, whole = torch.randn(6, 3), torch.randn(5)
    ring = _ring([batched, whole, "tag"], kinds=[BATCHED, WHOLE, CONST])
    slot = _take(ring, 0)
    slot.fill()
    b, w, c = slot.views(2)
    assert torch.equal(b, batched[:2]) and torch.equal(w, whole) and c == "tag"
    assert b.data_ptr() != batched.data_ptr() and w.data_ptr() != whole.data_ptr()


def test_no_ring_for_large_or_tensorless_outputs():
    assert outputs.ring_for(["a", 1], [CONST, CONST], 0, _copier) is None
    big = torch.empty(outputs.MAX_SLOT_BYTES // 4 + 1)
    assert outputs.ring_for([big], [WHOLE], 0, _copier) is None
    assert outputs.ring_for([torch.empty(3)], [WHOLE], 0, _copies_of([torch.empty(3)], [WHOLE])) is not None


def test_a_fill_that_cannot_be_made_leaves_clones():
    tries = []

    def broken(bases, warm=True):
        tries.append(1)
        raise RuntimeError("no capture here")

    ring = outputs.OutputRing([torch.randn(2, 2)], [BATCHED], 0, broken)
    for _ in range(outputs.MAX_FAILURES + 2):
        assert _take(ring, 0) is None
    assert len(tries) == outputs.MAX_FAILURES and not ring.slots and not ring.can_grow()


def test_a_fill_that_failed_once_is_made_on_a_later_call():
    tries = []

    src = torch.randn(2, 2)

    def flaky(bases, warm=True):
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("capture invalidated")
        return _copier(bases, [src])

    ring = outputs.OutputRing([src], [BATCHED], 0, flaky)
    assert _take(ring, 0) is None
    slot = _take(ring, 0)
    assert slot is not None and len(tries) == 2
    slot.fill()
    assert torch.equal(slot.views(2)[0], src)


def test_a_slot_never_handed_out_goes_to_any_stream_and_views_cut_the_sequence():
    static = torch.arange(2 * 6.0).view(2, 6)
    ring = outputs.OutputRing([static], [BATCHED], 0, _copies_of([static], [BATCHED]), seq_dims=[(1,)])
    ring.add(ring.make())
    slot = ring.take("stream-7")
    assert slot is not None and slot.sid == "stream-7"
    slot.fill()
    (v,) = slot.views(1, 4)
    assert v.shape == (1, 4) and torch.equal(v, static[:1, :4])
    del v
    assert ring.take("stream-8") is None, "handed out on another stream"
    assert ring.take("stream-7") is slot


def test_a_call_that_finds_every_slot_held_clones_and_another_slot_is_made_off_the_lock():
    from helpers import MLP, on_cpu_graphs

    from graphwrap import GraphedModule

    model = MLP().eval()
    gm = on_cpu_graphs(GraphedModule(model, buckets=[4], eager_if_faster=False))
    x = torch.randn(3, 32)
    held = [gm(x) for _ in range(outputs.MAX_SLOTS + 3)]
    with torch.no_grad():
        want = model(x)
    for h in held:
        torch.testing.assert_close(h, want)
    (ks,) = gm.engine.store.keys.values()
    ring = ks.buckets[(4, None)].graphs[0].ring
    assert len(ring.slots) == outputs.MAX_SLOTS, "each call that cloned had another slot made, up to the most"
    assert len({h.data_ptr() for h in held}) == len(held), "no output a caller holds is handed out again"


def test_slots_asked_for_under_another_capture_are_made_by_the_worker():
    from helpers import MLP, on_cpu_graphs

    from graphwrap import GraphedModule
    from graphwrap.process import CAPTURE_LOCK

    model = MLP().eval()
    gm = on_cpu_graphs(GraphedModule(model, buckets=[4], eager_if_faster=False))
    x = torch.randn(3, 32)
    held = [gm(x)]
    (ks,) = gm.engine.store.keys.values()
    ring = ks.buckets[(4, None)].graphs[0].ring
    got = threading.Event()
    threading.Thread(target=lambda: (CAPTURE_LOCK.acquire(), got.set(), time.sleep(0.3), CAPTURE_LOCK.release()),
                     daemon=True).start()
    assert got.wait(5)
    t0 = time.perf_counter()
    held.append(gm(x))  # every slot held while another capture runs: a clone, at once
    assert time.perf_counter() - t0 < 0.2 and len(ring.slots) == 1
    assert gm.wait(10) and len(ring.slots) == 2, "the worker made it once the capture was over"
    held += [gm(x) for _ in range(2)]
    assert len({h.data_ptr() for h in held}) == 4


def test_the_list_handed_out_holds_the_slot_until_the_caller_lets_go():
    # Between the engine's lock and the caller taking its tensors out of the list, another
    # thread must not find the slot free.
    static = torch.randn(4, 2)
    ring = _ring([static], max_slots=1)
    slot = _take(ring, "s")
    slot.fill()
    outs = slot.views(3)
    assert ring.take("s") is None, "the caller holds the list"
    t = outs[0]
    del outs
    assert ring.take("s") is None, "the caller holds the tensor"
    del t
    assert ring.take("s") is slot


def test_threads_calling_with_every_output_structure_each_get_their_own():
    from helpers import MultiIO, assert_same, on_cpu_graphs, run_threads

    from graphwrap import GraphedModule

    model = MultiIO().eval()
    gm = on_cpu_graphs(GraphedModule(model, buckets=[2, 4, 8], eager_if_faster=False))

    def work(i):
        g = torch.Generator().manual_seed(i)
        for _ in range(60):
            n = int(torch.randint(1, 9, (1,), generator=g))
            x = torch.randn(n, 8, generator=g)
            pair = (torch.randn(n, 8, generator=g), {"m": torch.randn(n, 8, generator=g)})
            got = gm(x, pair, scale=0.5)
            with torch.no_grad():
                assert_same(got, model(x, pair, scale=0.5))

    assert not run_threads(work, count=6)


def test_a_slot_is_reused_after_views_of_other_sizes_were_made():
    # Handing out n rows makes views of the slot's tensors, which adds references to them: the
    # resting counts of the sizes handed out before must follow, or their slot is never free.
    static = torch.randn(8, 4, 6)
    ring = outputs.OutputRing([static], [BATCHED], 0, _copies_of([static], [BATCHED]), max_slots=1,
                              seq_dims=[(1,)])
    ring.add(ring.make())
    for n, L in [(8, 4), (3, 4), (8, 4), (5, 2), (8, 4), (3, 4), (1, 1)] * 2:
        slot = ring.take("s")
        assert slot is not None, (n, L)
        slot.fill()
        (out,) = slot.views(n, L)
        assert out.shape == (n, L, 6) and torch.equal(out, static[:n, :L])
        del out


def test_a_caller_that_keeps_every_output_costs_one_check_and_a_slot_freed_out_of_turn_is_found(monkeypatch):
    static = torch.zeros(4, 2)
    ring = _ring([static], max_slots=3)
    held = []
    for _ in range(3):
        slot = _take(ring, "s")
        slot.fill()
        held.append(slot.views(4)[0])
    checks = []
    free = outputs.Slot.free
    monkeypatch.setattr(outputs.Slot, "free", lambda self: checks.append(1) or free(self))
    assert ring.take("s") is None and len(checks) == 1, "the oldest slot held: the look ends there"
    del held[1]  # freed out of turn: found when the turn comes to it
    gc.collect()
    assert ring.take("s") is None
    del held[0]
    gc.collect()
    got = [ring.take("s") for _ in range(3)]
    assert got[:2] == ring.slots[:2] and got[2] is None, "slots 0 and 1 in turn, then 2, still held"


def test_calls_that_find_every_slot_held_run_eagerly_where_the_race_said_so():
    from helpers import MLP, on_cpu_graphs

    from graphwrap import GraphedModule

    model = MLP().eval()
    gm = on_cpu_graphs(GraphedModule(model, buckets=[4], eager_if_faster=False))
    x = torch.randn(3, 32)
    gm(x)
    eng = gm.engine
    (ks,) = eng.store.keys.values()
    b = ks.buckets[(4, None)]
    with eng.lock:
        b.eager_when_held = True
        from graphwrap.core.plans import fold
        fold(eng, ks, b)
    kept = [gm(torch.randn(3, 32)) for _ in range(12)]
    xs = [torch.randn(3, 32) for _ in range(12)]
    kept = [(x, gm(x)) for x in xs]
    with torch.no_grad():
        for x, out in kept:
            torch.testing.assert_close(out, model(x))
    assert len({out.data_ptr() for _, out in kept}) == 12, "no output the caller holds is written again"
    stats = gm.stats()["keys"][0]["buckets"][4]
    assert stats["eager_held_calls"] >= 8 and stats["eager_when_held"]
    del kept
    gc.collect()
    before = stats["replays"]
    for _ in range(5):
        x = torch.randn(3, 32)
        with torch.no_grad():
            torch.testing.assert_close(gm(x), model(x))
    assert gm.stats()["keys"][0]["buckets"][4]["replays"] == before + 5, "outputs dropped: slots again"
