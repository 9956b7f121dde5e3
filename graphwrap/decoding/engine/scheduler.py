"""Which sequence holds which row of the cache, what waits, and when each sequence ends.

Plain Python, no tensors: the server asks it what to admit and which rows a step covers, tells
it what each step produced, and does the GPU work those decisions need. A row is taken by a
sequence when its prompt is admitted and given back when the sequence is done launching steps
(it has all the tokens it may make, or it ended early); a step covers rows ``[0, n)`` with
``n`` a row bucket above the highest live row, and attends over ``span`` positions, a bucket
above the longest live row. Rows are handed out lowest first, so live rows stay low.

Where the cache is paged (:mod:`.pool`), a sequence is admitted with the blocks of its whole
length (its prompt and ``max_new_tokens``) where the pool has room for them, else with those its
prompt and first token need, taking more (up to :data:`GRANT` at once) each time its row grows
past its last, before the step that writes there; it gives them back with its row. The queue
is served in order, a sequence admitted only where the blocks it needs leave one free for each
running row (none is passed over for good). Where a running row cannot grow, the sequence admitted last is preempted:
its row and blocks are given back and it waits at the head of the queue, to be admitted again
with its prompt and the tokens it made so far as the prompt it prefills (recomputed; its later
tokens are those it would have made, since a step's sampling noise depends on the position).
"""

import collections
import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Counter, Deque, List, Optional, Sequence, Tuple, cast

from ..cache.pool import Blocks, blocks_for, chain_hashes
from ..callers.settings import SeqSettings

GRANT = 8  # blocks a growing row takes at once where the pool has room (one table write per 8 blocks, not per block)


@dataclass(eq=False)
class Seq:
    """One sequence's record, from its call's arrival to its end: what it asks, where it stands,
    and what it made. Each group of fields has one writer:

    - the request, set when its call is prepared: ``call`` (the future, the mailbox and sink its
      tokens and end go through), ``index``, ``prompt``, ``settings``, ``seed``, ``matcher`` (its
      grammar's state, moved on by each token read), ``submitted``;
    - its place, the scheduler's (:class:`Scheduler`): ``row``, ``blocks``, ``resume``, ``order``,
      ``preempted``, ``cached``, ``writes``, ``epoch``, and ``prefilled`` with the pieces' run;
    - what the device has queued, told to the scheduler by the turn's run (``launched``,
      ``advanced``, ``written``): ``length``, ``wrote``, ``launched``;
    - its output, the turn's processing (:mod:`.outputs`): ``tokens``, ``done`` (also set where its
      call ends early), ``first_at``, ``last_at``.

    It takes its row once per admission and lets go of it once (:meth:`Scheduler.release`),
    whether it ends, is cancelled, fails or is preempted."""

    call: Any  # the server's Call (this module knows no tensors and no futures)
    index: int  # its row in the call's input_ids
    prompt: List[int]
    settings: SeqSettings
    tokens: List[int] = field(default_factory=list)
    row: Optional[int] = None
    blocks: List[int] = field(default_factory=list)  # of the paged pool, held with the row
    resume: Optional[List[int]] = None  # preempted: its prompt and the tokens it made, prefilled when admitted again
    order: int = 0  # when it was last admitted (the one admitted last is preempted first)
    preempted: int = 0  # times it was preempted
    prefilled: Optional[int] = None  # a long prompt being prefilled in pieces: positions written so far
    cached: int = 0  # positions of its feed found in the pool's cached blocks when it was admitted
    writes: List[Tuple[int, int]] = field(default_factory=list)  # (block index, chained hash) its feed writes, not yet cached
    length: int = 0  # positions of the cache written (host's mirror of the row's length)
    wrote: int = 0  # positions whose forward is queued, known to hold its prompt's and tokens' keys
    epoch: int = 0  # the prefix cache's epoch when it was admitted (its blocks are cached only within it)
    launched: int = 0  # tokens whose computation has been queued on the device
    done: bool = False
    seed: int = 0  # of its sampling noise
    matcher: Any = None  # its place in its call's grammar (grammar.Matcher), where the call gave one
    submitted: float = field(default_factory=time.perf_counter)
    first_at: Optional[float] = None
    last_at: Optional[float] = None

    @property
    def feed(self) -> List[int]:
        """What its admission prefills: the prompt, and after a preemption the tokens made too."""
        return self.resume if self.resume is not None else self.prompt

    @property
    def needs_steps(self) -> bool:
        """Whether tokens beyond those already queued are wanted."""
        return not self.done and self.launched < self.settings.max_new


def buckets_upto(limit: int, first: Sequence[int]) -> List[int]:
    """``first`` then steps of half the last power of two, up to and including ``limit``."""
    out = [b for b in first if b < limit]
    if not out:
        return [limit]
    b = out[-1]
    while b < limit:
        p = 1 << (b.bit_length() - 1)
        b += max(p // 2, 1)
        out.append(min(b, limit))
    if not out or out[-1] != limit:
        out.append(limit)
    return sorted(set(out))


def bucket_of(x: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= x:
            return b
    raise ValueError(f"{x} is above the largest bucket {buckets[-1]}")


class Scheduler:
    """The rows of the cache and the queue of sequences waiting for one."""

    def __init__(self, rows: int, max_len: int, row_buckets: Sequence[int], span_buckets: Sequence[int],
                 pool: Optional[Blocks] = None, block: int = 1, whole: Optional[int] = None):
        self.rows, self.max_len = rows, max_len
        self.whole_feed = whole  # feeds up to this long are prefilled whole, in one batch (see cacheable)
        self.pool, self.block = pool, block
        self.short = 0  # blocks the oldest waiting sequence lacks (0: none is waiting for blocks)
        self.row_buckets, self.span_buckets = list(row_buckets), list(span_buckets)
        self.free: List[int] = list(range(rows))
        heapq.heapify(self.free)
        self.queue: Deque[Seq] = deque()
        self.holders: List[Optional[Seq]] = [None] * rows
        self.chunking: Deque[Seq] = deque()  # admitted long prompts, prefilled a piece a turn, oldest first
        self.writing: Counter[int] = collections.Counter()  # chained hashes of full blocks admitted feeds write
        self.admitted = 0  # admissions so far (each sequence's ``order``)
        self.released = 0  # rows given back so far (retired or preempted): ``admitted`` once none is held
        self.epoch = 0  # prefix caches dropped so far (drop_prefixes)

    def enqueue(self, seqs: Sequence[Seq]):
        self.queue.extend(seqs)

    def needs(self, s: Seq) -> int:
        """Blocks of the pool that ``s`` takes when admitted (what it prefills, and the position
        its first token takes)."""
        return blocks_for(len(s.feed) + 1, self.block) if self.pool is not None else 0

    def whole(self, s: Seq) -> int:
        """Blocks of the pool that every position ``s`` may reach takes (its prompt and
        ``max_new_tokens``)."""
        return blocks_for(len(s.prompt) + s.settings.max_new, self.block) if self.pool is not None else 0

    def admit(self, limit: Optional[int] = None, tokens: Optional[int] = None) -> List[Seq]:
        """Queued sequences given a free row (and their blocks) each, oldest first (at most
        ``limit``, and with ``tokens``, prompts of at most that many tokens in all: the first is
        admitted whatever its length); stops at the first whose blocks, with one left for each
        running row, are not free (``self.short`` says how many it lacks)."""
        out: List[Seq] = []
        self.short = 0
        taken = 0
        pieced = bool(self.chunking)  # (a cached feed's rest goes in pieces, a prompt a turn: see cacheable)
        while self.queue and self.free and (limit is None or len(out) < limit):
            s = self.queue[0]
            if s.done:
                self.queue.popleft()
                continue
            cost = len(s.feed)  # (a feed past the chunk and the budget goes in pieces: a chunk of it this turn)
            if tokens is not None and self.whole_feed is not None and cost > tokens:
                cost = min(cost, self.whole_feed)
            if tokens is not None and out and taken + cost > tokens:
                break
            taken += cost
            if self.pool is not None:
                prefixes = self.pool.prefixes
                looks = prefixes is not None and self.cacheable(s, pieced)
                # Its leading full blocks found cached (never its last token: its logits are wanted)
                most = (len(s.feed) - 1) // self.block
                chain = prefixes.match(s.feed, most) if looks and prefixes is not None else []
                hashes = chain_hashes(s.feed, self.block, len(s.feed) // self.block) if prefixes is not None else []
                if looks and len(chain) < most and hashes[len(chain)] in self.writing and not self.fits(s):
                    break  # (a sequence admitted before it writes its next block: it takes it cached, a turn on)
                pieced = pieced or bool(chain) or not self.fits(s)  # (a long feed goes in pieces either way)
                need, whole = self.needs(s) - len(chain), self.whole(s) - len(chain)
                spare = self.rows - len(self.free)  # a block left for each running row to grow into
                free = self.pool.available - (sum(b in prefixes.idle for b in chain) if prefixes is not None else 0)
                if need + spare > free:
                    self.short = need + spare - free
                    break
                if prefixes is not None:
                    prefixes.share(chain)
                    prefixes.queries += len(s.feed)
                    prefixes.hits += len(chain) * self.block
                # Its whole length where the pool has room for it (its row never waits for a
                # block), else its prompt's blocks (it takes more as it grows)
                s.blocks = chain + cast(List[int], self.pool.take(whole if whole + spare <= free else need))
                s.cached = len(chain) * self.block
                s.writes = list(enumerate(hashes))[len(chain):]
                self.writing.update(h for _, h in s.writes)
            self.queue.popleft()
            s.row = heapq.heappop(self.free)
            self.holders[s.row] = s
            s.length = len(s.feed)
            s.epoch = self.epoch
            self.admitted += 1
            s.order = self.admitted
            out.append(s)
        return out

    def cacheable(self, s: Seq, pieced: bool) -> bool:
        """Whether ``s``'s admission looks for its feed's blocks in the cache. A feed found
        cached goes in pieces from where its cached blocks end, one prompt's piece a turn, while
        feeds of at most :attr:`whole_feed` positions that are not are prefilled together in one
        batch: such a feed looks only where no other goes in pieces now (``pieced``: one admitted
        earlier, or this turn). Otherwise a burst of short prompts that share a prefix would be
        admitted a prompt a turn (on a Llama-3-8B shape, 256 repeated prompts of 128 tokens ran
        at a third of the pace of the same prompts uncached), or wait behind a long prompt's
        pieces; it is prefilled whole instead, as with no cache (its blocks cached after
        those that hold the same tokens already, none shared)."""
        return not self.fits(s) or not pieced

    def fits(self, s: Seq) -> bool:
        """Whether ``s``'s feed is prefilled whole where its blocks are not found cached (a
        short one does not wait a turn for blocks another sequence writes)."""
        return self.whole_feed is not None and len(s.feed) <= self.whole_feed

    def written(self, seqs: Sequence[Seq], upto: Optional[int] = None):
        """The forwards that write ``seqs``' feeds (up to position ``upto``: a long prompt's pieces
        so far) are queued: their full blocks are cached, where the pool caches prefixes (readers
        come later on the same stream)."""
        prefixes = self.pool.prefixes if self.pool is not None else None
        if prefixes is None:
            return
        for s in seqs:
            feed = s.feed if upto is None else s.feed[:upto]
            s.wrote = len(feed)
            if s.epoch == self.epoch:
                prefixes.register(s.blocks, feed)
            self._unwrite(s, len(feed) // self.block)

    def drop_prefixes(self):
        """Forget every cached block (the model's values changed in place): those no sequence
        holds are free again, and what sequences admitted before now write is not cached (nor
        waited on)."""
        prefixes = self.pool.prefixes if self.pool is not None else None
        if prefixes is None:
            return
        cast(Blocks, self.pool).free.extend(prefixes.clear())
        self.epoch += 1
        for s in self.holders:
            if s is not None:
                s.writes = []
        self.writing.clear()

    def _keep(self, s: Seq):
        """``s`` gives its blocks back: the full blocks its steps wrote (the tokens it made, read
        so far) are cached too, after its prompt's, so that a conversation's next turn or its own
        resumption finds them. Not where its call failed (a failed step may have left them half
        written)."""
        prefixes = self.pool.prefixes if self.pool is not None else None
        if prefixes is None or getattr(s.call, "error", None) is not None or s.epoch != self.epoch:
            return
        known = s.prompt + s.tokens  # (position p holds the keys of token p: a resumed feed is a prefix of it)
        prefixes.register(s.blocks, known[:min(s.wrote, len(known))])

    def _unwrite(self, s: Seq, below: Optional[int] = None):
        """``s`` no longer writes its full blocks before index ``below`` (all: it wrote them, or left)."""
        gone = [w for w in s.writes if below is None or w[0] < below]
        if gone:
            s.writes = [w for w in s.writes if below is not None and w[0] >= below]
            self.writing.subtract(h for _, h in gone)
            self.writing += collections.Counter()  # (drops the hashes no sequence writes now)

    def short_of(self, s: Seq) -> bool:
        """Whether ``s``'s row needs another block before its next step writes."""
        return self.pool is not None and len(s.blocks) < blocks_for(s.length + 1, self.block)

    def grant(self, s: Seq) -> int:
        """How many blocks ``s``'s row takes now that it needs one: up to :data:`GRANT`, never
        more than its prompt and ``max_new_tokens`` need, nor than leave a block for each running
        row; at least one."""
        assert self.pool is not None
        spare = self.rows - len(self.free)
        return max(1, min(GRANT, self.whole(s) - len(s.blocks), self.pool.available - spare))

    def newest(self) -> Optional[Seq]:
        """The running sequence admitted last (the first to be preempted)."""
        held = [s for s in self.holders if s is not None and not s.done]
        return max(held, key=lambda s: s.order) if held else None

    def preempt(self, s: Seq) -> int:
        """``s`` gives back its row and blocks and waits at the head of the queue, to prefill its
        prompt and the tokens it made so far when admitted again; its row (for the caller to
        release on the device). Every token it launched must have been read."""
        row = self.release(s)
        if s in self.chunking:
            self.chunking.remove(s)
        s.prefilled = None
        s.resume = s.prompt + s.tokens
        s.length = s.wrote = 0
        s.preempted += 1
        self.queue.appendleft(s)
        return row

    def live(self) -> List[Seq]:
        """Sequences the next step serves (those whose prompt is all in)."""
        return [s for s in self.holders if s is not None and s.needs_steps and s.prefilled is None]

    def step_shape(self, live: Sequence[Seq]) -> Tuple[int, int]:
        """``(rows, span)`` of the next step over ``live`` (every row below the highest, and
        positions up to the longest plus the one this step writes)."""
        n = bucket_of(max(cast(int, s.row) for s in live) + 1, self.row_buckets)
        span = bucket_of(max(s.length for s in live) + 1, self.span_buckets)
        return n, span

    def launched(self, seqs: Sequence[Seq]):
        """A step (or a prompt's forward) was queued for ``seqs``: one more token each."""
        for s in seqs:
            s.launched += 1

    def advanced(self, seqs: Sequence[Seq]):
        """The step wrote one position of each of ``seqs``' rows."""
        for s in seqs:
            if s.wrote == s.length:
                s.wrote += 1
            s.length += 1

    def retire(self) -> List[int]:
        """Rows whose sequences want no further step: given back (the caller releases them on
        the device before the next step)."""
        return [self.release(s) for s in self.holders if s is not None and not s.needs_steps]

    def release(self, s: Seq) -> int:
        """The one way a sequence lets go of its row and blocks (retired or preempted): the row
        is free again, its full blocks written are cached (:meth:`_keep`), the others go back to
        the pool; its row (for the caller to release on the device). Once per admission: a
        sequence that holds no row is a bug of the caller's."""
        row = s.row
        if row is None or self.holders[row] is not s:
            raise AssertionError(f"a sequence released twice, or never admitted (row {row})")
        self.holders[row] = None
        heapq.heappush(self.free, row)
        if self.pool is not None:
            self._keep(s)
            self.pool.give(s.blocks)
        self._unwrite(s)
        s.blocks, s.row = [], None
        self.released += 1
        return row

    def drop_queued(self, pred) -> List[Seq]:
        """Take queued sequences for which ``pred`` holds out of the queue."""
        gone = [s for s in self.queue if pred(s)]
        if gone:
            self.queue = deque(s for s in self.queue if not pred(s))
        return gone

    @property
    def busy(self) -> int:
        return self.rows - len(self.free)
