"""The logits processors of graphwrap's decode loop: generate's own, each signature read once a
request, the masking ones (suppressed tokens, minimum lengths) with their masks made once and
joined into one torch.where a step; the scores always the processors' own. Needs transformers
(skipped with the reason without it)."""

import pytest
import torch

from graphwrap.loops import processors as P

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
lp = pytest.importorskip("transformers.generation.logits_process", reason="needs transformers")

VOCAB = 40


def _masking_processors():
    """One of each masking processor graphwrap knows, each masking at some lengths only."""
    return [
        lp.MinLengthLogitsProcessor(6, eos_token_id=[2, 7]),
        lp.MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=3, min_new_tokens=5, eos_token_id=2),
        lp.SuppressTokensAtBeginLogitsProcessor([0, 5, 9], begin_index=4),
        lp.SuppressTokensLogitsProcessor([11, 12, 30]),
    ]


def _scores(rows=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, VOCAB, generator=g).to(dtype)


def test_the_installed_transformers_masking_processors_are_recognised():
    """A release that changes one of these processors' __call__ fails here: its fingerprint in
    graphwrap/loops/processors.py wants a look (until then that processor keeps its own call)."""
    for p in _masking_processors():
        assert P.masking(p) is not None, (
            f"{type(p).__name__}.__call__ of transformers {tr.__version__} is not the one graphwrap knows "
            f"(fingerprint {P.body_print(type(p).__call__)}): read it and add its fingerprint if it masks as before")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("index", range(4))
def test_each_masking_processor_gives_its_own_scores_at_every_length(index, dtype):
    p = _masking_processors()[index]
    fast = P.processing(lp.LogitsProcessorList([p]))
    scores = _scores(dtype=dtype)
    for length in range(1, 12):
        ids = torch.zeros(3, length, dtype=torch.long)
        want = p(ids, scores.clone())
        got = fast(ids, scores.clone())
        assert got.dtype == want.dtype and torch.equal(got, want), (type(p).__name__, length)


def test_a_list_of_masking_and_other_processors_gives_the_lists_scores_with_masks_made_once(monkeypatch):
    """Masking processors on either side of a temperature: two runs, each one where a step; the
    scores are the list's at every length, and isin runs only when a new set of masks applies."""
    procs = _masking_processors()
    mixed = lp.LogitsProcessorList(procs[:2] + [lp.TemperatureLogitsWarper(0.7)] + procs[2:])
    fast = P.processing(mixed)
    scores = _scores()
    calls = []
    isin = torch.isin

    def counted(*a, **k):
        calls.append(1)
        return isin(*a, **k)

    monkeypatch.setattr(torch, "isin", counted)
    for length in range(1, 12):
        ids = torch.zeros(3, length, dtype=torch.long)
        theirs = len(calls)
        want = mixed(ids, scores.clone())
        theirs = len(calls) - theirs
        ours = len(calls)
        got = fast(ids, scores.clone())
        ours = len(calls) - ours
        assert torch.equal(got, want), length
        assert theirs == 4, "the list's processors make their masks every step"
        assert ours <= 3, f"step {length}: {ours} isin calls"
    # First run: both apply (lengths below 6: 2 isin), then MinNewTokens alone (lengths 6 and 7:
    # 1), then neither. Second run: suppress alone (1), suppress with begin (length 4: 2). Six
    # in all, where the list made 44.
    assert len(calls) - 4 * 11 == 6


def test_processors_with_nothing_to_mask_leave_the_scores_as_they_are():
    p = lp.SuppressTokensLogitsProcessor([])
    fast = P.processing(lp.LogitsProcessorList([p]))
    scores, ids = _scores(), torch.zeros(3, 4, dtype=torch.long)
    assert torch.equal(fast(ids, scores), p(ids, scores))


def test_a_subclass_or_a_changed_call_keeps_the_processors_own_call(monkeypatch):
    class Softer(lp.SuppressTokensLogitsProcessor):
        def __call__(self, input_ids, scores):
            return torch.where(torch.isin(torch.arange(scores.shape[-1]), self.suppress_tokens), -5.0, scores)

    scores, ids = _scores(), torch.zeros(3, 4, dtype=torch.long)
    soft = Softer([11, 12])
    assert P.masking(soft) is None
    assert torch.equal(P.processing(lp.LogitsProcessorList([soft]))(ids, scores), soft(ids, scores))

    def other(self, input_ids, scores):  # a release whose processor masks otherwise
        return torch.where(torch.isin(torch.arange(scores.shape[-1]), self.suppress_tokens), -1.0, scores)

    monkeypatch.setattr(lp.SuppressTokensLogitsProcessor, "__call__", other)
    p = lp.SuppressTokensLogitsProcessor([11, 12])
    assert P.masking(p) is None
    got = P.processing(lp.LogitsProcessorList([p]))(ids, scores)
    assert torch.equal(got, p(ids, scores)) and got[0, 11] == -1.0


def test_logits_processors_run_as_transformers_list_runs_them():
    """The loop reads each processor's signature once, not every step: the same scores, and a
    list with a processor that wants more arguments keeps the list's own call and error."""
    procs = lp.LogitsProcessorList([lp.MinLengthLogitsProcessor(5, eos_token_id=2), lp.TemperatureLogitsWarper(0.7)])
    ids, scores = torch.randint(0, 10, (2, 3)), torch.randn(2, 10)
    fast = P.processing(procs)
    assert fast is not procs and torch.equal(fast(ids, scores), procs(ids, scores))

    class WantsMore:
        def __call__(self, input_ids, scores, cur_len):
            return scores

    picky = lp.LogitsProcessorList([lp.TemperatureLogitsWarper(0.7), WantsMore()])
    assert P.processing(picky) is picky
    with pytest.raises(ValueError, match="required parameters"):
        P.processing(picky)(ids, scores)
