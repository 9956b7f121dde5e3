"""The step's sampler as a CUDA graph of its own (graphwrap/decoding/engine/sampler_graphs.py).

On a CPU: what a graph's key holds (every address and choice a capture freezes), when a key is
captured, replayed or left eager, and that the sampler's tokens do not change where a graph
serves (a stand-in graph that runs the captured work again). On a GPU: real graphs against the
eager sampler over steps whose logits, lengths and row settings change between replays."""

import logging
import threading

import pytest
import torch

from graphwrap.decoding.engine import sampler_graphs
from graphwrap.decoding.engine.grammar import RowMasks
from graphwrap.decoding.engine.sampler_graphs import Entry, SamplerGraphs, key
from graphwrap.decoding.engine.sampling import Active, RowSettings, SeqSettings
from graphwrap.process import CAPTURE_LOCK

VOCAB, ROWS = 500, 8


def _settings(device="cpu", rows=ROWS):
    return RowSettings(rows, 64, torch.device(device), VOCAB)


def _key(rs, logits, lengths, active, n=ROWS):
    return key(rs, logits, n, lengths, active)


def test_a_key_holds_every_choice_and_address_a_capture_freezes():
    rs = _settings()
    logits, lengths = torch.zeros(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long)
    active = Active(sample=True, top_k=50)
    k = _key(rs, logits, lengths, active)
    assert _key(rs, logits, lengths, active) == k
    # The log-probabilities are computed apart: asking for them needs no other graph.
    assert _key(rs, logits, lengths, Active(sample=True, top_k=50, logprobs=3)) == k
    others = [
        _key(rs, logits, lengths, active, n=4),
        _key(rs, torch.zeros(ROWS, VOCAB), lengths, active),  # other logits
        _key(rs, logits.half(), lengths, active),
        _key(rs, logits, torch.zeros(ROWS, dtype=torch.long), active),  # other lengths
        _key(rs, logits, lengths, Active(sample=True, top_k=40)),  # another largest top-k
        _key(rs, logits, lengths, Active(sample=True, top_k=50, top_p=True)),
        _key(rs, logits, lengths, Active(sample=True, top_k=50, grammar=True)),
    ]
    assert len({k, *others}) == len(others) + 1


def test_tables_a_request_replaces_change_the_key():
    """A request with more end-of-sequence ids or biased tokens than the tables hold widens them
    (new tensors), and the first with a penalty makes the token history: a graph captured before
    read the old ones."""
    rs = _settings()
    logits, lengths, active = torch.zeros(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long), Active()
    keys = [_key(rs, logits, lengths, active)]
    rs.write([0], [SeqSettings(max_new=4, eos=tuple(range(1, 10)))], [[1]], [0])  # 9 ids: a wider table
    keys.append(_key(rs, logits, lengths, active))
    rs.write([1], [SeqSettings(max_new=4, bias=tuple((t, 1.0) for t in range(1, 8)))], [[1]], [0])
    keys.append(_key(rs, logits, lengths, active))
    rs.write([2], [SeqSettings(max_new=4, penalty=1.3)], [[1, 2]], [0])  # the history is made
    keys.append(_key(rs, logits, lengths, active))
    rs.write([3], [SeqSettings(max_new=4, penalty=1.2, eos=(1,))], [[1]], [0])  # within the tables: no change
    keys.append(_key(rs, logits, lengths, active))
    assert len(set(keys)) == 4 and keys[3] == keys[4]


class StandIn:
    """A graph stand-in: its replay runs the captured work again and writes into its tokens."""

    def __init__(self, body, out):
        self.body, self.out, self.replays = body, out, 0

    def replay(self):
        self.out.copy_(self.body())
        self.replays += 1


class Graphs(SamplerGraphs):
    """Sampler graphs whose captures are stand-ins (or raise ``fail``)."""

    def __init__(self, fail=None):
        super().__init__(torch.device("cpu"))
        self.fail, self.captured = fail, []

    def _capture(self, body):
        if not CAPTURE_LOCK.acquire(blocking=False):
            return None
        try:
            if self.fail is not None:
                raise self.fail
            out = body().clone()
            graph = StandIn(body, out)
            self.captured.append(graph)
            return Entry(graph, out)
        finally:
            CAPTURE_LOCK.release()


def _sampled_rows(rows=ROWS):
    settings = [SeqSettings(max_new=8, sample=True, top_k=20, temperature=0.7) for _ in range(rows)]
    settings[0] = SeqSettings(max_new=8)  # a greedy row beside
    settings[1] = SeqSettings(max_new=8, sample=True, top_p=0.9, penalty=1.2, presence=0.5, bias=((3, 2.0),))
    settings[2] = SeqSettings(max_new=8, min_new=4, eos=(0, 7))
    return settings


def test_the_second_sighting_captures_and_later_steps_replay_with_the_eager_tokens():
    rs, eager = _settings(), _settings()
    rs.graphs = Graphs()
    settings = _sampled_rows()
    for r in (rs, eager):
        r.write(list(range(ROWS)), settings, [[5, 6, 7]] * ROWS, list(range(ROWS)))
    active = Active.of(settings)
    logits, lengths = torch.zeros(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        logits.copy_(torch.randn(ROWS, VOCAB, generator=gen))
        lengths.fill_(3 + step)
        got = rs.next_tokens(logits, ROWS, lengths, active)
        want = eager.next_tokens(logits, ROWS, lengths, active)
        assert torch.equal(got, want), step
        assert torch.equal(rs.history, eager.history)
    c = rs.graphs.counts
    assert (c["eager"], c["captures"], c["replays"]) == (1, 1, 5)
    assert rs.graphs.captured[0].replays == 5


def test_rows_given_as_indices_sample_eagerly():
    """A prompt's first tokens (rows as a tensor of indices) never go through a graph."""
    rs = _settings()
    rs.graphs = Graphs()
    logits, lengths = torch.randn(3, VOCAB), torch.full((3,), 2, dtype=torch.long)
    for _ in range(3):
        rs.next_tokens(logits, torch.tensor([1, 4, 6]), lengths, Active())
    assert rs.graphs.counts == {"replays": 0, "captures": 0, "failed": 0, "eager": 0}


def test_no_capture_while_another_thread_captures_then_captured_later():
    rs = _settings()
    rs.graphs = Graphs()
    logits, lengths = torch.randn(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long)
    held, done = threading.Event(), threading.Event()

    def holder():
        with CAPTURE_LOCK:
            held.set()
            done.wait(10)
    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        for _ in range(4):
            rs.next_tokens(logits, ROWS, lengths, Active())
        assert rs.graphs.counts["captures"] == 0 and rs.graphs.counts["eager"] == 4
    finally:
        done.set()
        t.join()
    rs.next_tokens(logits, ROWS, lengths, Active())
    assert rs.graphs.counts["captures"] == 1 and rs.graphs.counts["replays"] == 1


def test_a_capture_that_fails_leaves_its_key_eager_and_says_so_once(caplog):
    rs = _settings()
    rs.graphs = Graphs(fail=RuntimeError("operation not permitted when stream is capturing"))
    logits, lengths = torch.randn(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long)
    caplog.set_level(logging.WARNING, logger="graphwrap")
    want = logits.argmax(-1)
    for _ in range(5):
        assert torch.equal(rs.next_tokens(logits, ROWS, lengths, Active()), want)
    assert rs.graphs.counts["failed"] == 1 and rs.graphs.counts["eager"] == 5
    assert len([r for r in caplog.records if "could not be captured" in r.getMessage()]) == 1


def test_a_capture_invalidated_from_outside_is_tried_again():
    rs = _settings()
    rs.graphs = Graphs(fail=RuntimeError("CUDA error: operation failed due to a previous error during capture"))
    logits, lengths = torch.randn(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long)
    for _ in range(3):
        rs.next_tokens(logits, ROWS, lengths, Active())
    assert rs.graphs.counts["failed"] == 0 and not rs.graphs.eager
    rs.graphs.fail = None
    rs.next_tokens(logits, ROWS, lengths, Active())
    assert rs.graphs.counts["captures"] == 1


def test_a_key_invalidated_from_outside_time_after_time_is_left_eager(monkeypatch, caplog):
    monkeypatch.setattr(sampler_graphs, "TRIES", 3)
    rs = _settings()
    rs.graphs = Graphs(fail=RuntimeError("CUDA error: operation failed due to a previous error during capture"))
    logits, lengths = torch.randn(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long)
    caplog.set_level(logging.WARNING, logger="graphwrap")
    for _ in range(8):  # the first sighting, three tries again, then eagerly for good
        assert torch.equal(rs.next_tokens(logits, ROWS, lengths, Active()), logits.argmax(-1))
    assert rs.graphs.counts["failed"] == 1 and len(rs.graphs.eager) == 1
    assert [r for r in caplog.records if "could not be captured" in r.getMessage()]


def test_past_the_most_graphs_steps_sample_eagerly(monkeypatch):
    monkeypatch.setattr(sampler_graphs, "MOST", 2)
    rs = _settings()
    rs.graphs = Graphs()
    lengths = torch.zeros(ROWS, dtype=torch.long)
    for n in (1, 2, 3, 4):
        logits = torch.randn(n, VOCAB)
        for _ in range(3):
            assert torch.equal(rs.next_tokens(logits, n, lengths[:n], Active()), logits.argmax(-1))
    assert rs.graphs.counts["captures"] == 2 and len(rs.graphs.entries) == 2


def test_a_cpu_batch_has_no_sampler_graphs():
    assert _settings().graphs is None


def _masks(rows, device):
    """A grammar's row masks without the grammar engine: every third token allowed in row 0."""
    m = RowMasks.__new__(RowMasks)
    words = (VOCAB + 31) // 32
    m.table = torch.full((rows, words), -1, dtype=torch.int32, device=device)
    ids = torch.arange(VOCAB, device=device)
    m.word, m.bit, m.kernel, m.constrained = ids >> 5, (ids & 31).to(torch.int32), False, set()
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[::3] = True
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[:VOCAB] = allowed.long()
    packed = (bits.view(words, 32) << torch.arange(32)).sum(1)
    m.table[0] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).to(device)
    return m


@pytest.mark.cuda
def test_sampler_graphs_give_the_eager_tokens_as_settings_and_inputs_change():
    """Real graphs: each step's logits and lengths are written in place (as a step's graph does),
    rows are given back and admitted with other settings between replays (read from the device
    tables at replay), and a grammar's mask applies inside the graph; every step's tokens, and the
    token history, equal the eager sampler's exactly."""
    dev, rows = "cuda", ROWS
    rs, eager = _settings(dev), _settings(dev)
    assert rs.graphs is not None
    eager.graphs = None
    settings = _sampled_rows()
    for r in (rs, eager):
        r.write(list(range(rows)), settings, [[5, 6, 7]] * rows, list(range(rows)))
        r.masks = _masks(rows, dev)
    active = Active.of(settings)
    active.grammar = True
    logits = torch.zeros(rows, VOCAB, dtype=torch.float16, device=dev)
    lengths = torch.zeros(rows, dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev).manual_seed(3)
    for step in range(24):
        logits.copy_(torch.randn(rows, VOCAB, generator=gen, device=dev))
        lengths.fill_(3 + step)
        if step == 10:  # row 5 given back and taken by a greedy sequence; row 6 hotter
            new = [SeqSettings(max_new=8), SeqSettings(max_new=8, sample=True, top_k=20, temperature=2.0)]
            for r in (rs, eager):
                r.release(torch.tensor([5, 6], device=dev))
                r.write([5, 6], new, [[1, 2]] * 2, [11, 12])
        got = rs.next_tokens(logits, rows, lengths, active)
        want = eager.next_tokens(logits, rows, lengths, active)
        assert torch.equal(got, want), step
        assert torch.equal(rs.history, eager.history), step
        assert bool((got[0] % 3 == 0).item())  # row 0's mask allows every third token only
    c = rs.graphs.counts
    assert c["captures"] == 1 and c["replays"] == 23 and c["failed"] == 0


def test_the_batch_stats_say_what_the_sampler_graphs_did():
    from graphwrap.decoding.engine.report import _sampler

    assert _sampler(None) is None  # (a CPU batch samples eagerly)
    rs = _settings()
    rs.graphs = Graphs()
    logits, lengths = torch.randn(ROWS, VOCAB), torch.zeros(ROWS, dtype=torch.long)
    for _ in range(4):
        rs.next_tokens(logits, ROWS, lengths, Active())
    assert _sampler(rs.graphs) == {"replays": 3, "captures": 1, "failed": 0, "eager": 1, "graphs": 1}


def test_a_cpu_batch_reports_no_sampler_graphs():
    tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    from graphwrap import GraphedModule

    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=1,
                        eos_token_id=None, pad_token_id=0)
    gm = GraphedModule(tr.AutoModelForCausalLM.from_config(cfg).eval())
    try:
        gm.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
        assert gm.stats()["decode"]["sampler_graphs"] is None
    finally:
        gm.close()


def test_a_step_of_more_scores_than_the_bound_samples_eagerly(monkeypatch):
    """The pool keeps its largest graph's working memory: steps past MOST_SCORES (rows x vocabulary)
    are never captured."""
    monkeypatch.setattr(sampler_graphs, "MOST_SCORES", 4 * VOCAB)
    rs = _settings()
    rs.graphs = Graphs()
    lengths = torch.zeros(ROWS, dtype=torch.long)
    for n in (4, 5):
        logits = torch.randn(n, VOCAB)
        for _ in range(3):
            assert torch.equal(rs.next_tokens(logits, n, lengths[:n], Active()), logits.argmax(-1))
    assert len(rs.graphs.entries) == 1 and rs.graphs.counts["eager"] == 1 + 3


def test_a_batch_that_ends_gives_its_sampler_graphs_back(monkeypatch):
    """A batch's sampler graphs go when its decode thread ends, with the engines' graphs, not when
    the batch is collected (a CPU batch given sampler graphs that capture nothing themselves, as a
    CPU step's keys may repeat or not with the allocator, and then hold a stand-in)."""
    tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    from graphwrap import GraphedModule
    from graphwrap.decoding.engine import sampling

    made = []
    init = sampling.RowSettings.__init__

    class Eager(Graphs):
        def _capture(self, body):
            return None  # (as where another capture is under way: the step samples eagerly)

    def with_graphs(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.graphs = Eager()
        made.append(self.graphs)

    monkeypatch.setattr(sampling.RowSettings, "__init__", with_graphs)
    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=1,
                        eos_token_id=None, pad_token_id=0)
    gm = GraphedModule(tr.AutoModelForCausalLM.from_config(cfg).eval())
    want = gm.module.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=6, do_sample=False)
    try:
        got = gm.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=6, do_sample=False)
        assert torch.equal(got, want)
        graphs = gm.__dict__["_gw_decode"].settings.graphs
        assert graphs in made
        graphs.entries[("a key",)] = Entry(StandIn(lambda: torch.zeros(1), torch.zeros(1)), torch.zeros(1))
        graphs.pool = object()
        assert gm.stats()["decode"]["sampler_graphs"]["graphs"] == 1
    finally:
        assert gm.close(timeout=30)
    assert graphs.entries == {} and graphs.pool is None


@pytest.mark.cuda
def test_a_gpu_batch_that_ends_gives_its_sampler_graphs_back():
    """On a GPU: sampled steps capture the sampler, and closing the batch gives its graphs and their
    pool back."""
    tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    from graphwrap import GraphedModule

    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=1,
                        eos_token_id=None, pad_token_id=0)
    gm = GraphedModule(tr.AutoModelForCausalLM.from_config(cfg).to("cuda").eval())
    try:
        for _ in range(2):
            out = gm.generate(torch.tensor([[3, 4, 5]], device="cuda"), max_new_tokens=12, do_sample=True, top_k=8)
            assert out.shape == (1, 15)
        graphs = gm.__dict__["_gw_decode"].settings.graphs
        assert graphs is not None and graphs.counts["captures"] >= 1 and graphs.counts["replays"] >= 1
    finally:
        assert gm.close(timeout=60)
    assert graphs.entries == {} and graphs.pool is None
