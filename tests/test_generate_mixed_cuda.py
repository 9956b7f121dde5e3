"""A long prompt's piece inside the decoding rows' step forward on a GPU (graphwrap/decoding/engine/steps.py):
the probe with the Triton kernels, and long prompts beside decoding rows through the mixed
shapes' graphs (captured ahead), against ``model.generate`` alone."""

import threading

import pytest
import torch
from helpers import same_or_near_tie

pytestmark = pytest.mark.cuda
pytest.importorskip("triton", reason="needs Triton (torch's CUDA wheels bring it)")
tr = pytest.importorskip("transformers", reason="needs transformers")


def _model(kind, dtype):
    torch.manual_seed(0)
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048, bos_token_id=1,
                 eos_token_id=None, pad_token_id=0)
    if kind == "gpt2":
        cfg = tr.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000, n_positions=2048, bos_token_id=1,
                            eos_token_id=None, pad_token_id=0)
    elif kind == "mistral":
        cfg = tr.MistralConfig(**shape, sliding_window=256)
    else:
        cfg = tr.LlamaConfig(**shape)
    return tr.AutoModelForCausalLM.from_config(cfg).to("cuda", dtype).eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_mixed_probe_passes_with_the_kernels(kind, dtype):
    from graphwrap.decoding.engine.probe import probe_mixed

    assert probe_mixed(_model(kind, dtype), "cuda") is None


@pytest.mark.parametrize("budget", [None, 2048], ids=["a-piece-a-turn", "budget-2048"])
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_long_prompts_beside_decoding_rows_go_inside_their_steps_graphs(kind, budget, monkeypatch):
    """Each long prompt's first piece of a turn goes inside the rows' step; with one piece a turn
    (no budget) all of them do, with the budget the rest of the turn's go alone beside it."""
    from graphwrap import GraphedModule
    from graphwrap.decoding.engine import pieces

    monkeypatch.setattr(pieces, "BUDGET", budget)
    model = _model(kind, torch.float16)
    gm = GraphedModule(model)
    gm.generate(input_ids=torch.tensor([[5, 6]], device="cuda"), max_new_tokens=2)
    server = gm.__dict__["_gw_decode"]
    assert server.mixed_engine is not None, "the probe passed"
    gm.capture_generate()
    ready = gm.stats()["decode"]["shapes"]
    assert ("mixed", 8, server.piece) in ready, ready
    g = torch.Generator().manual_seed(3)
    short = [torch.randint(2, 1000, (1, n), generator=g).cuda() for n in (5, 17, 40, 9)]
    long = [torch.randint(2, 1000, (1, n), generator=g).cuda() for n in (700, 1300)]
    outs = {}

    def run(i):
        with torch.no_grad():
            outs[i] = gm.generate(input_ids=short[i], max_new_tokens=120, do_sample=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(short))]
    for t in threads:
        t.start()
    while len(server.sched.live()) < len(short):
        threading.Event().wait(0.001)
    got = [gm.generate(input_ids=p, max_new_tokens=8, do_sample=False) for p in long]
    for t in threads:
        t.join()
    d = gm.stats()["decode"]
    if budget is None:
        assert d["mixed_steps"] >= 5 and not d["mixed_failed"], d
    else:
        assert d["mixed_steps"] >= 2 and d["budget_pieces"] >= 1 and not d["mixed_failed"], d
    assert not d["eager_forwards"].get("mixed") and not d["capture_failed"], d
    for i, ids in enumerate(short):
        same_or_near_tie(model, ids, outs[i], 120)
    for ids, out in zip(long, got):
        same_or_near_tie(model, ids, out, 8)
    gm.close()
