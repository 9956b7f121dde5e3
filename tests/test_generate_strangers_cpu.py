"""One request's settings harm no other request of the shared batch, on every path a sequence
takes into it (a joined prompt forward, a long prompt's pieces): values at their type's limits,
settings that cannot be written, an end-of-sequence id of 0 held by min_new_tokens, an output
that cannot be built. Each fails alone with its reason, or is served as ``model.generate``
serves it. Each test runs on the CPU and, with the marker ``cuda``, on a GPU (graphs replayed, no
request able to raise a device-side assert), fp32 with TF32 off."""

import pytest
import torch
from helpers import thread_results

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.decoding.engine import pieces as pieces_mod
from graphwrap.decoding.engine import server as server_mod
from graphwrap.decoding.engine.sampling import RowSettings

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
BIG = 2 ** 63  # one past int64
pytestmark = pytest.mark.filterwarnings("ignore:Unfeasible length constraints")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    if request.param == "cuda":
        request.getfixturevalue("fp32_exact")
    return request.param


def _model(device, eos=None, pad=0):
    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=128, bos_token_id=1,
                        eos_token_id=eos, pad_token_id=pad)
    return tr.AutoModelForCausalLM.from_config(cfg).to(device).eval()


def _alone(model, prompt, **kw):
    with torch.no_grad():
        return model.generate(input_ids=torch.tensor([prompt], device=model.device), **kw).cpu()


def _ids(rows, model):
    return torch.tensor(rows, device=model.device)


LONG = list(range(2, 32))  # 30 tokens: pieces of 8 where CHUNK is 8
SHORT = [5, 6, 7]


@pytest.mark.parametrize("long_prompt", [False, True], ids=["joined-prompt", "pieces"])
@pytest.mark.parametrize("setting", [dict(min_new_tokens=BIG), dict(do_sample=True, top_k=BIG),
                                     dict(min_length=BIG)])
def test_settings_at_int64_s_limit_are_served_and_end_no_other_call(monkeypatch, device, long_prompt, setting):
    """min_new_tokens (or top_k, min_length) of 2**63 overflowed an int64 where the batch wrote the
    row's settings; on the long-prompt path, outside any call's error handling, the decode thread
    died and every call in flight failed. Such a value means what the largest that fits means."""
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    model = _model(device, eos=9)
    gm = GraphedModule(model)
    prompt = LONG if long_prompt else SHORT
    plain = gm.submit_generate(_ids([[11, 12, 13, 14]], model), max_new_tokens=40, do_sample=False)
    kw = {"max_new_tokens": 12, "do_sample": False, **setting}
    out = gm.submit_generate(_ids([prompt], model), **kw).result(timeout=60).cpu()
    if not kw["do_sample"]:  # the eos held for every step, as model.generate holds it
        assert torch.equal(out, _alone(model, prompt, **kw))
    else:
        assert out.shape == (1, len(prompt) + 12) or out[0, -1] == 9
    assert torch.equal(plain.result(timeout=60).cpu(), _alone(model, [11, 12, 13, 14], max_new_tokens=40, do_sample=False))
    again = gm.generate(_ids([SHORT], model), max_new_tokens=5, do_sample=False)
    assert torch.equal(again.cpu(), _alone(model, SHORT, max_new_tokens=5, do_sample=False))
    assert gm.stats()["decode"]["failed"] == 0
    gm.close()


@pytest.mark.parametrize("long_prompt", [False, True], ids=["joined-prompt", "pieces"])
def test_a_row_whose_settings_cannot_be_written_fails_alone(monkeypatch, device, long_prompt):
    """Settings the device's tables refuse (a temperature of 0.77 here, refused by a stand-in)
    fail that call with the error; the calls admitted in the same turn are served."""
    monkeypatch.setattr(server_mod, "CHUNK", 8)
    monkeypatch.setattr(pieces_mod, "WHOLE", 0)  # (these long prompts go in pieces, found alone or not)
    write = RowSettings.write

    def refuses(self, rows, settings, *args, **kwargs):
        if any(s.temperature == 0.77 for s in settings):
            raise OverflowError("Overflow when unpacking long long")
        return write(self, rows, settings, *args, **kwargs)

    monkeypatch.setattr(RowSettings, "write", refuses)
    model = _model(device)
    gm = GraphedModule(model)
    prompts = [[11, 12, 13], [20, 21], LONG if long_prompt else [30, 31, 32], [40, 41, 42, 43]]

    def run(i):
        kw = dict(max_new_tokens=10, do_sample=i == 2, temperature=0.77 if i == 2 else 1.0)
        try:
            return gm.generate(_ids([prompts[i]], model), **kw)
        except OverflowError as e:
            return e

    got = thread_results(run, 4)
    assert isinstance(got[2], OverflowError)
    for i in (0, 1, 3):
        assert torch.equal(got[i].cpu(), _alone(model, prompts[i], max_new_tokens=10, do_sample=False))
    d = gm.stats()["decode"]
    assert d["failed"] == 1 and d["done"] == 3 and d["rows_busy"] == 0
    gm.close()


def test_min_new_tokens_holds_an_end_of_sequence_id_of_0(device):
    """GPT-NeoX, Pythia and StarCoder end with id 0. The row's table of end ids is padded with -1,
    clamped to 0 where the scores are read: the padding wrote id 0's score back over the held
    -inf, and min_new_tokens was ignored."""
    model = _model(device, eos=0, pad=0)
    free = _alone(model, SHORT, max_new_tokens=12, do_sample=False)[0, 3:].tolist()
    t = free[2]
    with torch.no_grad():  # id 0 scores as the third token does (a tie goes to the lower id): made at step 3
        model.transformer.wte.weight[0] = model.transformer.wte.weight[t]
    ended = _alone(model, SHORT, max_new_tokens=12, do_sample=False)
    assert 0 in ended[0, 3:].tolist(), "the end id is made early without min_new_tokens"
    held = _alone(model, SHORT, max_new_tokens=12, min_new_tokens=8, do_sample=False)
    gm = GraphedModule(model)
    assert torch.equal(gm.generate(_ids([SHORT], model), max_new_tokens=12, do_sample=False).cpu(), ended)
    assert torch.equal(gm.generate(_ids([SHORT], model), max_new_tokens=12, min_new_tokens=8, do_sample=False).cpu(),
                       held)
    gm.close()


def test_a_pad_id_past_the_vocabulary_is_refused_and_an_output_that_cannot_be_built_fails(device):
    """pad_token_id=2**63 on rows that end at different steps: the output could not be built, the
    call never ended, and stats() counted it done. Now it is refused before it queues (as
    generate's own loop refuses it), and a result that cannot be built fails the call."""
    model = _model(device, eos=None, pad=None)
    gm = GraphedModule(model)
    with pytest.raises(GraphwrapError, match="pad_token_id"):
        gm.generate(_ids([SHORT], model), max_new_tokens=4, do_sample=False, pad_token_id=BIG)
    # an output that cannot be built (rows padded with an end id past int64)
    free = _alone(model, SHORT, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, 3:].tolist()
    eos = [BIG, free[1]]  # (no pad_token_id: the first end id pads)
    fut = gm.submit_generate(_ids([SHORT, [40, 41, 42]], model), max_new_tokens=8, do_sample=False,
                             eos_token_id=eos, pad_token_id=None)
    with pytest.raises(GraphwrapError, match="could not be built"):
        fut.result(timeout=60)
    d = gm.stats()["decode"]
    assert d["failed"] == 1 and d["rows_busy"] == 0
    assert torch.equal(gm.generate(_ids([SHORT], model), max_new_tokens=4, do_sample=False).cpu(),
                       _alone(model, SHORT, max_new_tokens=4, do_sample=False, pad_token_id=0))
    gm.close()
