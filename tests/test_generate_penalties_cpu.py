"""Biases and the API's additive penalties in the shared batch, per row: ``sequence_bias`` of
single tokens gives ``model.generate``'s own tokens (transformers' order: the bias, then
``repetition_penalty``); ``presence_penalty`` and ``frequency_penalty`` (graphwrap's keywords: the
batch alone serves them) give the tokens of a reference processor that applies them as the API
defines them, over the tokens made (not the prompt's). Rows beside them, and the next sequence in
a row, are untouched. On the CPU and, with the marker ``cuda``, on a GPU."""

import pytest
import torch

from graphwrap import GraphedModule, GraphwrapError

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda":
        request.getfixturevalue("fp32_exact")
    return request.param


def _model(device):
    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=128, bos_token_id=1,
                        eos_token_id=None, pad_token_id=0)
    return tr.AutoModelForCausalLM.from_config(cfg).to(device).eval()


class Additive(tr.LogitsProcessor):
    """The API's presence and frequency penalties over the tokens after the prompt."""

    def __init__(self, start: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids, scores):
        made = input_ids[:, self.start:]
        counts = torch.zeros_like(scores).scatter_add_(1, made, torch.ones_like(made, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


PROMPTS = [[5, 6, 7, 8], [11, 12, 13], [20, 21, 22, 23, 24, 25]]


def _generate(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=30, do_sample=False,
                              **kw).cpu()


def test_single_token_sequence_bias_gives_generate_s_tokens_beside_plain_rows(device):
    model = _model(device)
    gm = GraphedModule(model)
    bias = [[[17], 4.0], [[42], -100.0], [[3], 2.5]]
    kws = [dict(sequence_bias=bias), dict(sequence_bias=bias, repetition_penalty=1.5), {}]
    want = [_generate(model, p, **kw) for p, kw in zip(PROMPTS, kws)]
    assert not torch.equal(want[0][:, 4:], _generate(model, PROMPTS[0])[:, 4:])  # (the bias changes them)
    futures = [gm.submit_generate(torch.tensor([p], device=device), max_new_tokens=30, do_sample=False, **kw)
               for p, kw in zip(PROMPTS, kws)]
    for f, w in zip(futures, want):
        assert torch.equal(f.result(timeout=120).cpu(), w)
    assert gm.stats()["generate"] == {"graphwrap's shared decode batch": 3}
    # (the rows given back: the next call in each is generate's, unbiased)
    for p in PROMPTS:
        assert torch.equal(gm.generate(torch.tensor([p], device=device), max_new_tokens=30, do_sample=False).cpu(),
                           _generate(model, p))


@pytest.mark.parametrize("presence, frequency", [(0.0, 1.5), (2.0, 0.0), (0.7, 0.9), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_are_the_api_s(device, presence, frequency):
    model = _model(device)
    gm = GraphedModule(model)
    want = [_generate(model, p, logits_processor=[Additive(len(p), presence, frequency)]) for p in PROMPTS]
    futures = [gm.submit_generate(torch.tensor([p], device=device), max_new_tokens=30, do_sample=False,
                                  presence_penalty=presence, frequency_penalty=frequency) for p in PROMPTS]
    plain = gm.submit_generate(torch.tensor([PROMPTS[0]], device=device), max_new_tokens=30, do_sample=False)
    for f, w in zip(futures, want):
        assert torch.equal(f.result(timeout=120).cpu(), w)
    assert torch.equal(plain.result(timeout=120).cpu(), _generate(model, PROMPTS[0]))
    assert any(not torch.equal(w, _generate(model, p)) for w, p in zip(want, PROMPTS))  # (they change tokens)


def test_what_the_batch_cannot_serve(device):
    model = _model(device)
    gm = GraphedModule(model)
    ids = torch.tensor([PROMPTS[0]], device=device)
    with pytest.raises(GraphwrapError, match="shared batch only"):  # (beams: the one-call loop's, which has none)
        gm.generate(ids, max_new_tokens=5, num_beams=2, presence_penalty=1.0)
    with pytest.raises(GraphwrapError, match="outside the model's vocabulary"):
        gm.generate(ids, max_new_tokens=5, sequence_bias=[[[500], 1.0]])
    # A bias of two tokens is the one-call loop's: generate's tokens, in turn.
    two = [[[17, 18], 5.0]]
    assert torch.equal(gm.generate(ids, max_new_tokens=12, do_sample=False, sequence_bias=two).cpu(),
                       _generate(model, PROMPTS[0], sequence_bias=two)[:, :16])
    assert gm.stats()["generate"].get("graphwrap's shared decode batch", 0) == 0
