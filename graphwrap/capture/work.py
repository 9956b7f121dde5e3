"""A capture's work, for the engine's :class:`~graphwrap.capture.capturer.Capturer` and the
worker: :func:`capture_into` (a bucket's graph, captured off the engine's lock and installed
under it), the job a bucket needs, what a failure means for the key and the bucket, the
compiled forward to capture, owned-output slots, extra graphs for loops, and capturing every
bucket of a key. The race against eager is in ``racing``, the memory budget in ``budget``,
per-size kernels in ``tuning``.

The functions take the engine (its lock, store, grid and options) and run on the calling
thread or as the worker's jobs, under the engine's lock where they say so.
"""
import contextlib
import logging
import time
from typing import Optional

import torch

from ..core.compare import SAME_SHAPE_TOL, compare_leaves
from ..core.plans import fold
from ..core.records import Bucket, Key, Lease, Serves
from ..core.state import Saved
from ..core.tree import CONST, unflatten_inputs
from ..core.watch import forward_runs, reads_recorded
from ..errors import GraphwrapError
from .budget import budget_left, drop_least_used, large_budget, release_dropped
from .checks import CaptureFailed, Scope
from .compiled import CompiledForward, load_cache, save_cache, unavailable_reason
from .graph import Job, capture_bucket
from .racing import race
from .slots import ring_for
from .worker import stopping

logger = logging.getLogger("graphwrap")


@contextlib.contextmanager
def _guarded(engine, device):
    """Replays of graphs of the engine's pool: under its lock, on a stream ordered after the
    last call's work (graphs of one pool share memory: no two may run at once)."""
    with engine.lock:
        if device.type == "cuda":
            engine.order_stream(device)
        yield


def capture_into(engine, ks: Key, b: Bucket, leaves, n: int, L, forward=None, plain: bool = False,
                 timed: bool = True, evict: bool = True) -> Optional[Bucket]:
    """Capture a graph into bucket ``b`` of ``ks`` (marked as capturing, or a new bucket
    that the caller swaps in) outside the lock, and install it under the lock; ``b`` if it
    serves now. ``forward``: kernels to capture (default: the compiled forward, if any);
    ``evict``: whether less used graphs may be dropped to fit ``max_pool_bytes``.

    Whatever the caller's mode, graphwrap's own tensors (samples, static buffers, slots) are
    made outside ``torch.inference_mode``: inference tensors keep no version counter (the
    in-place checks read it) and refuse in-place writes outside that mode (every later call
    writes the static inputs)."""
    with torch.inference_mode(False), forward_runs():
        return _capture_into(engine, ks, b, leaves, n, L, forward, plain, timed, evict)


def _capture_into(engine, ks: Key, b: Bucket, leaves, n: int, L, forward, plain: bool, timed: bool,
                  evict: bool) -> Optional[Bucket]:
    saved = Saved(engine.module, ks.states)  # the call's state: every extra run of the capture is undone
    try:
        out = _capture_loop(engine, ks, b, leaves, n, L, forward, plain, timed, evict, saved)
    except BaseException as e:
        # The module's own error on the call's inputs (or an interrupt): the call raises it, and
        # the bucket is left to the next call to capture, not marked as capturing for good.
        with engine.lock:
            if b.serves is Serves.CAPTURING:
                b.serves = Serves.NOTHING
        saved.restore()
        if isinstance(e, Exception) and not isinstance(e, (CaptureFailed, GraphwrapError)) and saved.items:
            _raise_as_eager(engine, ks, leaves, saved)
        raise
    saved.restore()
    return out


def _raise_as_eager(engine, ks: Key, leaves, saved: Saved):
    """The module's error in a capture of a call with state: the capture's runs undone, the call
    runs once eagerly, so that it raises with the state as the module leaves it (a step that
    fails part-way has written what it wrote). Returns where that run does not raise."""
    args, kwargs = unflatten_inputs(ks.spec, leaves)
    engine.module(*args, **kwargs)
    saved.restore()  # it ran through: the capture's error stands, the state as before the call


def _capture_loop(engine, ks: Key, b: Bucket, leaves, n: int, L, forward, plain: bool, timed: bool,
                  evict: bool, saved: Saved) -> Optional[Bucket]:
    for _ in range(4):
        if engine.store.pool is None:  # a pool's anchor is a capture: made off the lock
            pool = engine.backend.new_pool(ks.device)
            with engine.lock:
                engine.store.pool = engine.store.pool or pool
        with engine.lock:
            if engine.store.keys.get(_key_tuple(engine, ks)) is not ks or ks.failed is not None:
                if b.serves is Serves.CAPTURING:
                    b.serves = Serves.NOTHING
                return None
            evict = evict and b.size <= engine.grid.top(b.seq)  # a batch above the grid never evicts
            job = make_job(engine, ks, b, leaves, n, L, plain, forward)
            job.restore, job.state, job.fixed = saved.restore, saved, ks.fixed
            epoch = engine.epoch
        try:
            got = capture_bucket(job, engine.backend.recorder)
            if _writes_state(engine, ks, b, saved, n, L):
                return None  # captured with padding: planned again at the call's own shape
            ring = ring_of(engine, ks, got, saved.restore) if engine.clone else None
        except CaptureFailed as e:
            with engine.lock:
                again = settle_failure(engine, ks, b, e, epoch, forward, evict)
            release_dropped(engine, ks.device)
            if e.scope is Scope.BUCKET:
                engine.backend.empty_cache()
            if again is None:
                return None
            plain = plain or again == "plain"
            continue
        with engine.lock:
            if engine.epoch != epoch:
                return None
            install(engine, ks, b, got, job.forward, ring)
        # No race for a forward that writes state: its timing runs would move a cache's position
        # past its end (and a step of a decode loop is worth a graph whatever eager costs).
        if timed and engine.eager_if_faster and not ks.fixed and engine.capturer.writes is None:
            race(engine, ks, b)
        return b
    return None


def _writes_state(engine, ks: Key, b: Bucket, saved: Saved, n: int, L) -> bool:
    """Note the module buffers the forward writes (put back by now); whether this bucket's graph
    must go because it pads a call of a module that does."""
    if not saved.written:
        return False
    if ks.fixed:  # a state input: its writes are the point, and nothing is padded
        return False
    with engine.lock:
        _note_writes(engine, saved.written)
        padded = b.size != n or (b.seq is not None and b.seq != L)
        if padded and ks.buckets.get(b.point) is b:
            del ks.buckets[b.point]
            b.serves = Serves.NOTHING
        return padded


def _key_tuple(engine, ks: Key):
    for k, v in engine.store.keys.items():
        if v is ks:
            return k
    return None


def compiled_forward(engine) -> Optional[CompiledForward]:
    """The compiled forward to capture, or None for the plain one. The caller holds the lock."""
    opts = engine.compile_opts
    if opts is None or engine.capturer.compile_off is not None:
        return None
    if engine.capturer.compiled is None:
        reason = unavailable_reason()
        if reason is not None:
            give_up_compile(engine, reason)
            return None
        if opts.get("cache"):
            load_cache(opts["cache"])
        engine.capturer.compiled = CompiledForward(engine.module, opts)
    return engine.capturer.compiled


def give_up_compile(engine, reason: str):
    engine.capturer.compile_off = reason
    msg = f"compile= given up ({reason}); capturing the plain forward"
    if engine.fallback == "raise":
        raise GraphwrapError(f"{msg}. Pass fallback=\"eager\" to accept the plain forward")
    engine.log_once(("compile",), logging.WARNING, msg)


def save_compile_cache(engine):
    if engine.compile_opts is not None and engine.compile_opts.get("cache") and engine.capturer.compiled is not None:
        save_cache(engine.compile_opts["cache"])


def make_job(engine, ks: Key, b: Bucket, leaves, n: int, L, plain: bool, forward) -> Job:
    """The capture job of bucket ``b``, sampled from the call's real rows (copied: the caller's
    tensors are never touched). The caller holds the lock."""
    store, device = engine.store, ks.device
    if engine.watch.ptrs is None:
        hooked = engine.watch.record().hooked()
        if hooked:
            engine.log_once(("hooks",), logging.WARNING,
                            f"forward hooks of {', '.join(hooked[:3])}{' ...' if len(hooked) > 3 else ''} "
                            "are captured into the graphs: they run at capture, and replays repeat what they do to "
                            "tensors, not what they do in Python (appending to a list, logging)")
    m = min(n, b.size)
    real = [(t if bd is None else t.narrow(bd, 0, m)).to(device, copy=True) for t, (bd, _, _) in zip(leaves, ks.roles)]
    budget = budget_left(engine)
    if b.size > engine.grid.top(b.seq) and device.type == "cuda":
        budget = large_budget(device, budget)
    compiled = forward if forward is not None else None if plain else compiled_forward(engine)
    if compiled is not None and engine.capturer.writes is not None:
        # Module buffers the forward writes (a gpt-fast style cache): on a GPU, calls with
        # compiled kernels over them got no graph at all (they ran eagerly, correctly). The
        # plain forward's graphs serve them.
        engine.log_once(("writes-compile",), logging.WARNING, "compile= is not used for a forward that "
                        "writes module buffers: its graphs capture the plain forward")
        compiled = None
    names = engine.decl.names(ks.spec)
    # The forward's reads are recorded around the reference run of a capture, by wrapping
    # nn.Module.__getattribute__ for that run; torch.compile tracing in another thread meanwhile
    # meets the wrapper and runs its code eagerly. A job given ``forward`` captures a bucket
    # captured before, at the same shape (kernels compiled for its size, on the tuner's thread
    # while the process serves; compiled graphs in place of plain ones; one more graph for a
    # loop): its reads were recorded then, and it runs without the wrapper.
    # The first capture of a signature warms up fully (cuBLAS, cuDNN and Triton set-up, autotuning);
    # later buckets of it need one run to settle their own shapes.
    warmup = engine.opts.warmup_iters if ks.kinds is None or compiled is not None else 1
    return Job(engine.module, compiled, device, store.pool, ks.spec, ks.roles, engine.batch_dim, real, b.size, b.seq,
               warmup, ks.autocast, engine.verify, ks.kinds, ks.seq_dims, ks.out_spec, budget,
               guard=lambda: _guarded(engine, device), describe=names.__getitem__, pad_check=ks.exact is None,
               observe=reads_recorded if forward is None else contextlib.nullcontext)


def settle_failure(engine, ks: Key, b: Bucket, e: CaptureFailed, epoch: int, forward, may_evict: bool = True
                   ) -> Optional[str]:
    """Record a failed capture; "plain" to capture the plain forward instead, "again" to try
    once more (memory was made), None to stop. The caller holds the lock."""
    if engine.epoch != epoch:
        b.serves = Serves.NOTHING
        return None
    if e.pool_lost:
        engine.store.pool = None  # graphs already in it keep their memory; new ones get a new pool
    if ks.buckets.get(b.point) is not b:  # a graph beside the served one: compiled, tuned, leased
        if e.scope is Scope.COMPILE and forward is not engine.capturer.static_forward:
            give_up_compile(engine, e.reason)
        else:
            logger.warning("a further graph of bucket %s of %s was not captured (%s); the bucket goes on "
                           "as it was", b.name, ks.label, e.reason)
        return None
    if e.scope is Scope.COMPILE:
        give_up_compile(engine, e.reason)
        return "plain"
    if e.scope is Scope.STATE:  # planned again at the call's own shape, from now on for every call
        _note_writes(engine, e.written)
        ks.buckets.pop(b.point, None)
        b.serves = Serves.NOTHING
        return None
    if e.scope is Scope.SEQ and ks.exact is None:
        ks.exact = e.reason
        ks.buckets.pop(b.point, None)
        fold(engine, ks, None)
        b.serves = Serves.NOTHING
        logger.warning("lengths of %s are not padded (%s); graphs are captured for each exact length",
                       ks.label, e.reason)
        return None
    if e.scope is Scope.BUDGET:
        if may_evict and drop_least_used(engine, e.pool_estimate, b):
            return "again"
        b.serves, b.reason, b.pool_estimate = Serves.OVER_BUDGET, e.reason, e.pool_estimate
        where = "are chunked or run eagerly" if b.size > engine.grid.top(b.seq) else "go to the next larger captured bucket"
        engine.log_once(("budget", ks.label, b.point), logging.INFO,
                        f"bucket {b.name} of {ks.label} not captured: {e.reason}; its batches {where}")
        return None
    b.serves, b.reason = Serves.FAILED, e.reason
    if e.scope is not Scope.BUCKET:
        ks.fail(e.reason)
        for shape, p in list(engine.fast.items()):
            if p.key is ks:
                del engine.fast[shape]
    msg = f"capture of bucket {b.name} for {ks.label} failed: {e.reason}"
    if engine.fallback == "raise":
        raise GraphwrapError(f"{msg}. Pass fallback=\"eager\" to run such inputs eagerly instead") from (e.cause or e)
    engine.log_once(("capture", ks.label, b.point if e.scope is Scope.BUCKET else None), logging.WARNING,
                    f"{msg}; running {'this bucket' if e.scope is Scope.BUCKET else 'these inputs'} eagerly")
    return None


def install(engine, ks: Key, b: Bucket, got, compiled, ring):
    """A captured graph joins its bucket, which serves by graph from now on. The caller holds the lock."""
    ks.kinds, ks.seq_dims, ks.out_spec = got.kinds, got.seq_dims, got.out_spec
    if got.pool is not None:
        engine.store.pool = got.pool  # captured again in a new pool (see CudaRecorder.record)
    g = got.graph
    g.ring = ring
    b.graphs.append(g)
    b.serves, b.reason = Serves.GRAPH, None
    b.capture_s += got.capture_s
    b.verify_s += got.verify_s
    b.pool_bytes += got.pool_bytes
    b.pool_estimate = max(b.pool_estimate, got.pool_estimate)
    b.compile_s += got.compile_s
    b.compiled_graphs += got.compiled_graphs
    _mark_compiled(engine, ks, b, compiled, got.compiled_graphs, got.ran_ahead)
    if compiled is not None:
        how = (f"compiled, {got.compiled_graphs} graphs in {got.compile_s:.2f} s" if b.compiled
               else "NOT compiled: torch.compile compiled nothing for this shape")
        level = logging.INFO if b.compiled else logging.WARNING
    else:
        how, level = "plain forward", logging.INFO
    logger.log(level, "captured bucket %s of %s in %.1f ms (%s; verify %.1f ms), graph pool +%.1f MiB",
               b.name, ks.label, 1e3 * got.capture_s, how, 1e3 * got.verify_s, got.pool_bytes / 2**20)


def _mark_compiled(engine, ks: Key, b: Bucket, compiled, graphs: int, ran_ahead: bool = False):
    b.forward = compiled
    if compiled is None:
        b.compiled = False if engine.compile_opts is not None else None
        return
    b.kernels = "shared" if compiled.dynamic else "per-size"
    # Compiled kernels ran if this warm-up compiled a graph, or this shape (any shape, with
    # dynamic shapes) was compiled before, by this key or one whose static inputs look the
    # same (dynamo's cache outlives reset()), or it ran on these inputs just before the capture
    # (compiling them, or served by kernels compiled for another shape): otherwise dynamo ran
    # the forward uncompiled.
    seen = compiled.shapes
    ran = (graphs > 0 or (ks.seen_as, b.point) in seen or (ran_ahead and compiled.graphs > 0)
           or (compiled.dynamic and any(label == ks.seen_as for label, _ in seen)))
    if ran:
        seen.add((ks.seen_as, b.point))
    b.compiled = ran if b.compiled is None else (b.compiled and ran)


def _note_writes(engine, written):
    """The forward writes these module buffers: calls are planned at their own shape from now
    on. The caller holds the lock."""
    first = engine.capturer.writes is None
    engine.capturer.writes = tuple(sorted(set(engine.capturer.writes or ()) | set(written)))
    if first:
        logger.info("the forward writes the module's buffers %s: each call writes them once, as the "
                    "module does (the extra runs of a capture are undone); calls are served at their own batch "
                    "size and length, one by one, never padded, chunked or joined", ", ".join(engine.capturer.writes))
        for k in engine.store.keys.values():
            fold(engine, k, None)


def ring_of(engine, ks: Key, got, restore=lambda: None):
    """The owned-output ring of a captured graph, with its first slot (its fill is a capture:
    made here, off the call path); None where outputs are better cloned. ``restore`` puts the
    module's state back between the runs that check the slot."""
    g = got.graph
    pool = got.pool if got.pool is not None else engine.store.pool
    ring = ring_for(g.static_outputs, g.kinds, engine.batch_dim,
                    engine.backend.slot_maker(ks.device, pool, g.run, g.draws, g.kinds), g.seq_dims)
    if ring is not None:
        slot = _checked_slot(engine, ks.device, g, ring, warm=False, restore=restore)  # this thread just warmed up
        if slot is not None:
            ring.add(slot)
        if ks.fixed:
            # A slot's fill and checks run the forward, which writes the call's state (a KV
            # cache): more slots would be made later, beside the calls, with nothing to put the
            # state back. Outputs held past the next call are cloned instead.
            ring.max_slots = len(ring.slots)
    return ring


def _checked_slot(engine, device, g, ring, warm: bool = True, restore=lambda: None):
    """A new slot of ``g``'s ring whose fill gives what the graph gives on the same inputs; None
    (counted as a failure of the ring) otherwise."""
    slot = ring.make(warm)
    restore()
    if slot is None:
        if getattr(ring.error, "pool_lost", False):
            with engine.lock:
                engine.store.pool = None  # later captures go to a new pool
        return None
    with _guarded(engine, device):
        g.replay()
        want = [o.clone() for o, k in zip(g.static_outputs, g.kinds) if k != CONST]
        restore()
        slot.fill()
        got = [b.clone() for b in slot.bases]
        restore()
    msg = compare_leaves(got, want, SAME_SHAPE_TOL)
    if msg:
        ring.failures += 1
        logger.warning("an owned-output graph differs from its bucket's graph (%s); outputs are cloned", msg)
        return None
    return slot


def add_slot(engine, graph, epoch: int):
    """A worker job: one more owned-output slot for ``graph``, whose slots were all held."""
    slot = None
    if engine.epoch == epoch:
        with torch.inference_mode(False), forward_runs():  # the slot's tensors are written by every later fill
            slot = _checked_slot(engine, graph.static_inputs[0].device, graph, graph.ring)
    with engine.lock:
        graph.ring.wanted = graph.ring.growing = False
        if slot is not None and engine.epoch == epoch:
            graph.ring.add(slot)


def add_graph(engine, ks: Key, b: Bucket) -> Optional[int]:
    """One more graph of a served bucket (for a loop's lease), sampled from the first graph's
    static inputs; its index, or None."""
    with engine.lock:
        if not b.graphs or b.serves is not Serves.GRAPH:
            return None
        sample = [t.clone() for t in b.graphs[0].static_inputs]
        forward, plain = (b.forward, False) if b.compiled else (None, True)
    extra = Bucket(b.size, b.seq)
    if capture_into(engine, ks, extra, sample, b.size, None, forward=forward, plain=plain, timed=False) is None:
        return None
    with engine.lock:
        if ks.buckets.get(b.point) is not b or b.serves is not Serves.GRAPH:
            return None
        b.graphs.append(extra.graphs[0])
        b.pool_bytes += extra.pool_bytes
        return len(b.graphs) - 1


def lease_graphs(engine, plan, count: int) -> Optional[Lease]:
    """``count`` graphs of a plan's bucket for one loop's sole use, captured as needed; None where
    ``gm(...)`` must serve the call (eager, chunked, sequences, not CUDA)."""
    if engine.backend.kind != "cuda" or plan.eager or plan.chunked or plan.L is not None:
        return None
    ks, b = plan.key, plan.bucket
    if ks.fixed or engine.capturer.writes is not None:
        return None  # another graph's capture would run the forward beside calls that write its state
    with engine.lock:
        free = [i for i in range(1, len(b.graphs)) if i not in b.leased][:count]
        b.leased.update(free)
    while len(free) < count:
        i = add_graph(engine, ks, b)
        with engine.lock:
            if i is None:
                b.leased.difference_update(free)
                return None
            b.leased.add(i)
        free.append(i)
    with engine.lock:
        return Lease(ks, b, [b.graphs[i] for i in free])


def return_graphs(engine, lease: Lease):
    """A lease's graphs back to their bucket."""
    with engine.lock:
        for g in lease.graphs:
            for i, mine in enumerate(lease.bucket.graphs):
                if mine is g:
                    lease.bucket.leased.discard(i)


# ---------------------------------------------------------------------------------- every bucket


def capture_all(engine, ks: Key, sample, n: int, L, background: bool) -> dict:
    """Capture every bucket of ``ks``, largest first, with ``sample`` (the plain forward first
    when ``background``, then the compiled one bucket by bucket); the key's stats."""
    from ..core.stats import key_stats

    t0 = time.perf_counter()
    try:
        done = _every_bucket(engine, ks, sample, n, L, plain=background)
        if background:
            ks.warming = False
            _compile_each(engine, ks, sample, n, L)
        logger.info("captured %d buckets of %s in %.2f s", done, ks.label, time.perf_counter() - t0)
        save_compile_cache(engine)
    except Exception as e:  # noqa: BLE001 - in the background: reported; calls go on with what was captured
        if not background:
            raise
        logger.warning("background capture of %s stopped: %s: %s", ks.label, type(e).__name__, e)
        engine.capturer.background_error = f"{type(e).__name__}: {e}"
    finally:
        ks.warming = False
        if background:
            engine.capturer.background_state = "done"
    with engine.lock:
        return key_stats(ks)


def _points(engine, ks: Key, L):
    if not ks.has_seq:
        return engine.grid.points()
    if ks.exact is not None:
        return engine.grid.points([L])
    return engine.grid.points(engine.grid.seq_buckets())


def _every_bucket(engine, ks: Key, sample, n, L, plain: bool) -> int:
    points = _points(engine, ks, L)
    done = 0
    for i, (size, S) in enumerate(points, 1):
        if stopping():
            break
        with engine.lock:
            if ks.failed is not None:
                break
            if ks.exact is not None and S is not None and S != L:
                continue
            b, go = engine.capturer.claim(ks, size, S, True)
        # capture() takes the largest buckets first: one over the budget is left out (a larger
        # one serves its batches), never captured in place of those taken before it.
        if go and capture_into(engine, ks, b, sample, n, L, plain=plain, evict=False) is not None:
            done += 1
            logger.info("capture %d/%d of %s done", i, len(points), ks.label)
    return done


def _compile_each(engine, ks: Key, sample, n, L):
    """Replace each bucket's plain graph by one of the compiled kernels (plans are rebuilt on
    the next call; loops holding the old graphs go on replaying them)."""
    if engine.compile_opts is None or engine.capturer.compile_off is not None:
        return
    engine.capturer.background_state = "compiling"
    with engine.lock:
        cf = compiled_forward(engine)
    if cf is None:
        return
    engine.capturer.background_state = "replacing plain graphs by compiled ones"
    for point in sorted(list(ks.buckets), key=lambda p: (p[0] * (p[1] or 1)), reverse=True):
        if stopping():
            break
        with engine.lock:
            old = ks.buckets.get(point)
            if old is None or not old.graphs or old.compiled or ks.failed is not None:
                continue
            sample_b = [t.clone() for t in old.graphs[0].static_inputs]
        new = Bucket(old.size, old.seq)
        if capture_into(engine, ks, new, sample_b, old.size, old.seq, forward=cf) is not None:
            with engine.lock:
                if ks.buckets.get(point) is old:
                    swap(engine, ks, old, new)


def swap(engine, ks: Key, old: Bucket, new: Bucket):
    """``new`` serves ``old``'s batches from the next call, with its counts; plans are rebuilt
    (loops holding the old graphs go on replaying them). The caller holds the lock."""
    fold(engine, ks, old)
    # The old graphs' memory stays in the pool (for later captures): still counted here.
    new.pool_bytes += old.pool_bytes
    new.capture_s += old.capture_s
    new.compile_s += old.compile_s
    for name in ("replays", "rows", "padded_rows", "tokens", "padded_tokens", "eager_calls"):
        setattr(new, name, getattr(new, name) + getattr(old, name))
    ks.buckets[old.point] = new
