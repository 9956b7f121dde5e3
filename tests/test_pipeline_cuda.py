"""gm.pipeline on a GPU: every output against eager, races, and clean stops."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import MLP, MultiIO, Slow, assert_same
from torch import nn

import graphwrap
from graphwrap import GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"


def _batches(count, d, pinned, seed=0, top=40):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, top, (count,), generator=g).tolist()
    xs = [torch.randn(n, d, generator=g) for n in sizes]
    return [x.pin_memory() for x in xs] if pinned else xs


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("to_host", [False, True])
def test_500_random_batches(pinned, to_host, monkeypatch):
    staged = []
    stage = graphwrap.loops.pipeline._stage
    monkeypatch.setattr(graphwrap.loops.pipeline, "_stage", lambda *a: staged.append(1) or stage(*a))
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8, 16, 32])
    xs = _batches(500, 32, pinned)
    outs = list(gm.pipeline(xs, to_host=to_host))
    assert len(outs) == 500
    # Pageable batches go through the loop's pinned buffers, pinned ones not; those above the
    # largest bucket too, since they get graphs of their own size class.
    assert len(staged) == (0 if pinned else len(xs))
    for x, o in zip(xs, outs):
        with torch.no_grad():
            want = model(x.to(DEV))
        if to_host:
            assert o.device.type == "cpu" and o.is_pinned()
            want = want.cpu()
        assert_same(o, want)
    assert gm.stats()["eager_calls"] == {}


def test_to_host_with_every_output_on_the_third_stream(monkeypatch):
    # Outputs above D2H_INLINE_BYTES are cloned and copied on a stream of their own; here all are.
    monkeypatch.setattr(graphwrap.loops.pipeline, "D2H_INLINE_BYTES", -1)
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8, 16, 32])
    xs = _batches(500, 32, pinned=True, seed=4)
    outs = list(gm.pipeline(xs, to_host=True))
    torch.cuda.synchronize()
    for x, o in zip(xs, outs):
        assert not o.is_cuda and o.is_pinned()
        with torch.no_grad():
            assert_same(o, model(x.to(DEV)).cpu())


def test_view_outputs_are_right_when_yielded():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8, 16, 32], outputs="view")
    xs = _batches(500, 32, pinned=True, seed=3)
    kept = []
    for x, o in zip(xs, gm.pipeline(xs)):
        with torch.no_grad():
            assert_same(o, model(x.to(DEV)))  # checked before asking for the next batch
        kept.append(o)
    assert gm.stats()["eager_calls"] == {}
    # Views are not the caller's: later batches overwrite them, as the documentation says.
    with torch.no_grad():
        stale = sum(not torch.allclose(o, model(x.to(DEV))) for x, o in zip(xs, kept))
    assert stale > 0


def test_structured_items_and_batches_above_the_largest_bucket():
    model = MultiIO().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 8])
    items = []
    for n in (1, 7, 20, 3):
        x = torch.randn(n, 8).pin_memory()
        pair = (torch.randn(n, 8, device=DEV), {"m": torch.randn(n, 8)})
        items.append(graphwrap.Inputs(x, pair, scale=0.5))
    for it, o in zip(items, gm.pipeline(items)):
        want = model(*[a.to(DEV) if torch.is_tensor(a) else a for a in it.args[:1]], (it.args[1][0], {"m": it.args[1][1]["m"].to(DEV)}), scale=0.5)
        assert_same(o, want)


class Wide(nn.Module):
    """Long copies next to tiny compute; long copies back too with ``out_cols=None``."""

    def __init__(self, out_cols=8):
        super().__init__()
        self.out_cols = out_cols

    def forward(self, x):
        return x[:, : self.out_cols] * 2 + 1


@pytest.mark.parametrize("kind", ["slow", "wide", "wide-out"])
def test_races(kind):
    if kind == "slow":
        model, d = Slow().to(DEV).eval(), 64
    else:
        model, d = Wide(8 if kind == "wide" else None).to(DEV).eval(), 1 << 18
    gm = GraphedModule(model, buckets=[4, 8])
    xs = _batches(60, d, pinned=True, top=9)
    for to_host in (False, True):
        for x, o in zip(xs, gm.pipeline(xs, to_host=to_host)):
            with torch.no_grad():
                want = model(x.to(DEV))
            assert_same(o.to(DEV), want, tol=1e-5)


def test_under_launch_blocking():
    code = (
        "import torch, graphwrap, sys; sys.path.insert(0, 'tests'); from helpers import MLP\n"
        "m = MLP().cuda().eval(); gm = graphwrap.GraphedModule(m, buckets=[4, 16])\n"
        "xs = [torch.randn(n, 32).pin_memory() for n in (1, 4, 9, 16, 3) * 10]\n"
        "for to_host in (False, True):\n"
        "    for x, o in zip(xs, gm.pipeline(xs, to_host=to_host)):\n"
        "        torch.testing.assert_close(o.cuda(), m(x.cuda()).detach())\n"
        "print('ok')\n"
    )
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_break_and_exceptions_leave_it_usable():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[4, 8])
    xs = _batches(30, 32, pinned=True, top=9)
    for i, _ in enumerate(gm.pipeline(xs)):
        if i == 5:
            break

    def bad_iter():
        yield from xs[:4]
        raise ValueError("source failed")

    with pytest.raises(ValueError, match="source failed"):
        for _ in gm.pipeline(bad_iter(), to_host=True):
            pass
    with pytest.raises(KeyError):
        for i, _ in enumerate(gm.pipeline(xs)):
            if i == 3:
                raise KeyError("body failed")
    gen = gm.pipeline(xs, to_host=True)
    next(gen)
    del gen
    x = torch.randn(6, 32, device=DEV)
    assert_same(gm(x), model(x).detach())
    for x, o in zip(xs, gm.pipeline(xs)):
        assert_same(o, model(x.to(DEV)).detach())


def test_memory_stays_flat():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 2, 4])
    xs = [torch.randn(n, 32).pin_memory() for n in (1, 2, 3, 4)]

    def stream(k):
        for i in range(k):
            yield xs[i % 4]

    for _ in gm.pipeline(stream(200), to_host=True):
        pass
    torch.cuda.synchronize()
    start = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), _rss())
    count = sum(1 for _ in gm.pipeline(stream(100_000), to_host=True))
    torch.cuda.synchronize()
    end = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), _rss())
    print(f"\npipeline of {count} batches on {torch.cuda.get_device_name()}: device allocated "
          f"{start[0] / 2**20:.1f} -> {end[0] / 2**20:.1f} MiB, reserved {start[1] / 2**20:.1f} -> "
          f"{end[1] / 2**20:.1f} MiB, host RSS {start[2] / 2**20:.0f} -> {end[2] / 2**20:.0f} MiB")
    assert count == 100_000
    assert end[0] - start[0] <= 1 << 20 and end[1] - start[1] <= 2 << 20
    assert end[2] - start[2] <= 32 << 20


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_weights_replaced_inside_the_loop_take_effect_from_the_next_batch():
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[4, 8])
    xs = _batches(80, 32, pinned=True, seed=5, top=9)
    junk = []
    for i, (x, o) in enumerate(zip(xs, gm.pipeline(xs))):
        with torch.no_grad():
            assert_same(o, model(x.to(DEV)))
        if i % 20 == 4:  # a new Parameter: the old weight's memory is freed and refilled
            model.layers[0].weight = nn.Parameter(torch.randn_like(model.layers[0].weight))
        elif i % 20 == 9:  # a .data swap behind the wrapper's back
            model.layers[2].weight.data = torch.randn_like(model.layers[2].weight)
        elif i % 20 == 14:
            gm.reset()
        elif i % 20 == 19:  # in place: the same memory, new values, no recapture needed
            with torch.no_grad():
                model.layers[4].bias.uniform_(-1, 1)
        torch.cuda.empty_cache()
        junk.append(torch.full((1 << 16,), float("nan"), device=DEV))
    assert gm.stats()["eager_calls"] == {}


@pytest.mark.parametrize("to_host", [False, True])
def test_one_pinned_buffer_refilled_in_place_for_every_batch(to_host):
    # A common loop: one pinned buffer, refilled for each batch as soon as the loop asks for the
    # next item. A copy still pending at that moment would read the next batch's rows.
    model = Slow().to(DEV).eval()  # long replays: copies queue behind them
    gm = GraphedModule(model, buckets=[8])
    xs = [torch.randn(8, 64) for _ in range(40)]
    buf = torch.empty(8, 64).pin_memory()

    def refilled():
        for x in xs:
            buf.copy_(x)
            yield buf

    outs = list(gm.pipeline(refilled(), to_host=to_host))
    with torch.no_grad():
        for x, o in zip(xs, outs):
            assert_same(o.to(DEV), model(x.to(DEV)), tol=1e-5)


@pytest.mark.parametrize("outputs", ["clone", "view"])
def test_one_pinned_buffer_refilled_in_the_loop_body(outputs):
    # The other common loop: the body refills the pinned buffer for the next batch as soon as it
    # has an output. The copy that read the buffer must be over before the output is yielded.
    model = Slow().to(DEV).eval()
    gm = GraphedModule(model, buckets=[8], outputs=outputs)
    xs = [torch.randn(8, 64) for _ in range(40)]
    buf = torch.empty(8, 64).pin_memory()
    buf.copy_(xs[0])
    outs = []
    for i, o in enumerate(gm.pipeline(buf for _ in xs)):
        outs.append(o.clone())
        if i + 1 < len(xs):
            buf.copy_(xs[i + 1])
    with torch.no_grad():
        for x, o in zip(xs, outs):
            assert_same(o, model(x.to(DEV)), tol=1e-5)


def test_host_inputs_in_any_layout():
    # Inputs whose memory is not their rows in order: a transposed view, a negated view (its
    # bytes hold the values with the other sign), a strided slice; pageable and pinned.
    model = MLP().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 4, 8])
    g = torch.Generator().manual_seed(7)
    items = []
    for i, n in enumerate((3, 8, 1, 5, 2, 7) * 4):
        base = torch.randn(32, n, generator=g)
        x = base.t()  # not contiguous
        if i % 3 == 1:
            x = torch._neg_view(torch.randn(n, 32, generator=g))
        elif i % 3 == 2:
            x = torch.randn(n, 64, generator=g)[:, ::2]
        items.append(x.pin_memory() if i % 2 else x)
    for x, o in zip(items, gm.pipeline(items)):
        with torch.no_grad():
            assert_same(o, model(x.to(DEV)))
