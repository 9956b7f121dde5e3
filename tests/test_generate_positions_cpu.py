"""Calls that would run a model past its table of positions (graphwrap/loops/positions.py):
refused with a GraphwrapError before any forward, where ``model.generate`` raises from inside
the model (an IndexError here; on a GPU a device-side assert that ends the CUDA context of every
caller); calls that fit, left padding included, served as ``model.generate`` serves them."""

import pytest
import torch

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.loops.positions import position_tables

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")

SMALL = dict(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)


def _gpt2():
    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    return tr.GPT2LMHeadModel(cfg).eval()


def _bart():
    torch.manual_seed(0)
    return tr.BartForConditionalGeneration(tr.BartConfig(**SMALL, max_position_embeddings=32, forced_eos_token_id=None)).eval()


def _forwards(model):
    seen = []
    return seen, model.register_forward_pre_hook(lambda *a: seen.append(1))


def test_tables_of_positions_are_found_with_their_offsets_and_computed_positions_have_none():
    assert position_tables(_gpt2()) == [("transformer.wpe", 32)]
    assert position_tables(_bart()) == [("model.encoder.embed_positions", 32), ("model.decoder.embed_positions", 32)]
    opt = tr.OPTForCausalLM(tr.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         ffn_dim=64, max_position_embeddings=40, word_embed_proj_dim=32))
    assert position_tables(opt) == [("model.decoder.embed_positions", 40)]
    llama = tr.LlamaForCausalLM(tr.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=32))
    t5 = tr.T5ForConditionalGeneration(tr.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                   num_heads=4))
    assert position_tables(llama) == [] and position_tables(t5) == [], "rotary and relative positions: no table"


@pytest.mark.parametrize("decode", [False, None], ids=["decode-off", "a-setting-the-batch-leaves"])
def test_a_decoder_only_call_past_its_positions_fails_before_any_forward_and_one_that_fits_is_served(decode):
    """A table of 32 positions serves sequences of 33 tokens (the last one is never fed back):
    a prompt of 16 and 17 new tokens is served, 18 are refused, where ``model.generate`` raises
    from inside the model. With the batch on, a setting it leaves to the one-call loop."""
    model = _gpt2()
    gm = GraphedModule(model, decode=False) if decode is False else GraphedModule(model)
    extra = {} if decode is False else dict(no_repeat_ngram_size=3)
    ids = torch.randint(3, 60, (1, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(do_sample=False, **extra)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=17, min_new_tokens=17, **kw)
        with pytest.raises(IndexError):  # (what the check stands in front of)
            model.generate(ids, max_new_tokens=18, min_new_tokens=18, **kw)
    assert torch.equal(gm.generate(ids, max_new_tokens=17, min_new_tokens=17, **kw), want)
    seen, hook = _forwards(model)
    for past in (dict(max_new_tokens=18), dict(max_length=34), dict(max_new_tokens=100, max_length=20)):
        with pytest.raises(GraphwrapError, match=r"past the 32 of its table of positions \(transformer.wpe\)"):
            gm.generate(ids, **past, **kw)
    assert not seen, "refused before any forward"
    hook.remove()
    assert torch.equal(gm.generate(ids, max_length=33, min_new_tokens=17, **kw), want), "max_length 33: served"


def test_left_padding_counts_each_rows_own_positions():
    """Positions count from each row's first token (the mask's running sum): rows of 16 and 18
    tokens padded to 20, with 15 new tokens, make sequences of 33 at most, served as
    ``model.generate`` serves them; one more new token is refused."""
    model = _gpt2()
    gm = GraphedModule(model, decode=False)
    g = torch.Generator().manual_seed(2)
    ids = torch.cat([torch.zeros(2, 4, dtype=torch.long), torch.randint(3, 60, (2, 16), generator=g)], dim=1)
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    mask[1, 2:4] = 1  # (the second row 18 tokens long: the widest row sets the bound)
    ids[1, 2:4] = 7
    kw = dict(attention_mask=mask, do_sample=False)
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=15, min_new_tokens=15, **kw)
    assert torch.equal(gm.generate(ids, max_new_tokens=15, min_new_tokens=15, **kw), want)
    with pytest.raises(GraphwrapError, match="33 positions"):
        gm.generate(ids, max_new_tokens=16, **kw)


def test_an_encoder_decoders_encoder_and_decoder_are_each_held_to_their_table():
    """BART's tables (32 positions each, past an offset of 2): an input of 33 tokens is refused,
    as is a decoder of 34 tokens (its start and 33 new); 32 and 33 are served."""
    model = _bart()
    gm = GraphedModule(model)
    g = torch.Generator().manual_seed(3)
    long_input = torch.randint(3, 60, (1, 33), generator=g)
    ids = torch.randint(3, 60, (1, 8), generator=g)
    with torch.no_grad():
        with pytest.raises(IndexError):
            model.generate(long_input, max_new_tokens=4)
        with pytest.raises(IndexError):
            model.generate(ids, max_new_tokens=33, min_new_tokens=33)
        want = model.generate(ids, max_new_tokens=32, min_new_tokens=32)
        fits = model.generate(long_input[:, :32], max_new_tokens=4, min_new_tokens=4)
    seen, hook = _forwards(model)
    with pytest.raises(GraphwrapError, match=r"input_ids of 33 tokens are past the 32 positions of the model's "
                                             r"encoder \(model.encoder.embed_positions\)"):
        gm.generate(long_input, max_new_tokens=4)
    with pytest.raises(GraphwrapError, match=r"over 33 positions.*model.decoder.embed_positions"):
        gm.generate(ids, max_new_tokens=33, min_new_tokens=33)
    assert not seen
    hook.remove()
    assert torch.equal(gm.generate(ids, max_new_tokens=32, min_new_tokens=32), want)
    assert torch.equal(gm.generate(long_input[:, :32], max_new_tokens=4, min_new_tokens=4), fits)
