"""The garbage collector's pauses, which stall the decode thread like every thread
(graphwrap/decoding/engine/collector.py): one clock a process, each generation's collections
and pauses, reset by the server once serving begins, and read by ``stats()["decode"]``."""

import gc

import pytest
import torch

from graphwrap.decoding.engine import collector


def test_one_clock_a_process_counts_each_generations_collections_and_pauses():
    clock = collector.clock()
    assert collector.clock() is clock and clock in gc.callbacks
    clock.reset()
    assert clock.report()["gen2"] == {"collections": 0, "total_ms": 0.0, "max_ms": 0.0}
    junk = [[i] for i in range(200_000)]  # (objects for a full collection to walk; their making collects too)
    clock.reset()
    gc.collect()
    del junk
    got = clock.report()
    assert got["gen2"]["collections"] == 1, got
    assert got["gen2"]["max_ms"] > 0 and got["gen2"]["total_ms"] == got["gen2"]["max_ms"]
    clock.reset()
    assert clock.report()["gen2"]["collections"] == 0


def test_a_batchs_stats_say_the_collectors_pauses():
    tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    from graphwrap import GraphedModule

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=101, max_position_embeddings=64, eos_token_id=None,
                         pad_token_id=0)
    gm = GraphedModule(tr.AutoModelForCausalLM.from_config(cfg).eval())
    gm.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)
    before = gm.stats()["decode"]["collector_pauses"]["gen2"]["collections"]
    gc.collect()
    assert gm.stats()["decode"]["collector_pauses"]["gen2"]["collections"] == before + 1
    gm.close()
