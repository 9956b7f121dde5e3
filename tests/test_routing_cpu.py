"""Which replica takes a generate call (graphwrap/serve/routing.py): prompts that start alike go
to the replica that served the first of them, unless it is loaded past the slack (or, under a
heavy load, past half the least loaded one's calls beyond them); a match of a small share of the
prompt, and prompts alike in nothing, go to the least loaded; of replicas that match alike, the
less loaded; what each replica remembers is bounded. And ``Replicas.generate`` on a CPU."""

import pytest
import torch

from graphwrap.serve.routing import BLOCK, PrefixRouter, block_hashes


def _prompt(system: int, question: int, blocks: int = 4):
    g = torch.Generator().manual_seed(system)
    head = torch.randint(1, 1000, (blocks * BLOCK,), generator=g).tolist()  # (no pad id 0: every call the batch's)
    return head + [question + 1] * 5


def test_block_hashes_cover_every_token_before_them():
    a, b = _prompt(1, 0), _prompt(1, 0)
    b[3] += 1
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 4 and ha != hb and all(x != y for x, y in zip(ha, hb)), "a change shows in every later block"
    assert block_hashes(a[:BLOCK - 1]) == []


def test_prompts_that_start_alike_go_where_the_first_went_and_others_spread():
    r = PrefixRouter(4)
    load = [0, 0, 0, 0]
    homes = {}
    for system in range(4):  # each group's first call: the least loaded, in turn
        i = r.pick(_prompt(system, 0), load, start=system)
        homes[system] = i
        load[i] += 1
    assert sorted(homes.values()) == [0, 1, 2, 3]
    for q in range(1, 6):
        for system in range(4):
            assert r.pick(_prompt(system, q), load) == homes[system]
    assert r.routed["prefix"] == 20 and r.routed["load"] == 4


def test_a_loaded_replica_gives_its_matches_to_the_least_loaded():
    r = PrefixRouter(2, slack=2)
    home = r.pick(_prompt(7, 0), [0, 0])
    load = [0, 0]
    load[home] = 2
    assert r.pick(_prompt(7, 1), load) == home, "within the slack: the match"
    load[home] = 3  # past the slack
    assert r.pick(_prompt(7, 2), load) == 1 - home


def test_under_a_heavy_load_a_group_stays_on_its_replica_up_to_half_the_least_loaded_ones_calls_beyond():
    r = PrefixRouter(2)
    load = [40, 40]  # (calls of other prompts in flight on both)
    home = r.pick(_prompt(5, 0), load)
    load[home] += 1
    for q in range(1, 21):  # a group's calls, one after another, none ended
        assert r.pick(_prompt(5, q), load) == home, f"call {q}: within 40 + max(8, 20) of the least loaded"
        load[home] += 1
    assert load[home] == 61
    assert r.pick(_prompt(5, 99), load) == 1 - home, "past it: the least loaded"


def test_a_match_of_a_small_share_of_the_prompt_goes_to_the_least_loaded():
    r = PrefixRouter(2)
    template = _prompt(9, 0, blocks=1)[:BLOCK]  # (one block alike in every prompt, as a chat template's)
    first = r.pick(template + _prompt(10, 0, blocks=10), [0, 0])
    load = [0, 0]
    load[first] = 1
    assert r.pick(template + _prompt(11, 0, blocks=10), load) == 1 - first, "1 block of 11 matched: under 30%"
    assert r.routed == {"load": 2}
    load = [0, 0]
    load[first] = 1
    assert r.pick(template + _prompt(10, 0, blocks=10)[:4 * BLOCK], load) == first, "5 of 5 matched"


def test_of_replicas_that_match_alike_the_less_loaded_takes_it():
    r = PrefixRouter(2)
    a = r.pick(_prompt(3, 0), [0, 0])
    b = r.pick(_prompt(3, 1), [9, 0] if a == 0 else [0, 9])  # (past the slack: the other, which then holds it too)
    assert b == 1 - a
    assert r.pick(_prompt(3, 2), [5, 2]) == 1, "both hold its 4 blocks: the less loaded"
    assert r.pick(_prompt(3, 3), [2, 5]) == 0


def test_the_longest_match_wins_and_memory_is_bounded():
    r = PrefixRouter(2, remembered=8)
    a = r.pick(_prompt(1, 0, blocks=2) + _prompt(2, 0, blocks=2), [0, 0])
    b = r.pick(_prompt(1, 0, blocks=2), [0, 1] if a == 0 else [1, 0], start=1 - a)
    assert len(r.seen[a]) == 4
    long_again = r.pick(_prompt(1, 0, blocks=2) + _prompt(2, 0, blocks=2), [0, 0])
    assert long_again == a, "4 blocks matched beat 2"
    for s in range(10, 13):
        r.pick(_prompt(s, 0), [0, 1] if a == 0 else [1, 0], start=a)
    assert all(len(seen) <= 8 for seen in r.seen)
    assert b in (0, 1)


def test_replicas_generate_routes_and_answers_as_generate():
    tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    from graphwrap import Replicas

    torch.manual_seed(0)
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128, eos_token_id=None,
                        pad_token_id=0)
    model = tr.GPT2LMHeadModel(cfg).eval()
    reps = Replicas(model, devices=["cpu"], decode={"prefix_caching": True})
    try:
        for q in range(3):
            ids = torch.tensor([_prompt(3, q)])
            got = reps.generate(ids, max_new_tokens=5, do_sample=False)
            with torch.no_grad():
                assert torch.equal(got, model.generate(ids, max_new_tokens=5, do_sample=False))
        assert reps.routed == {"load": 1, "prefix": 2}
        d = reps.modules[0].stats()["decode"]["prefix_cache"]
        assert d["prefix_cache_hits"] == 2 * 4 * BLOCK
        assert reps.stats()["cpu"]["inflight"] == 0
    finally:
        reps.close()


def test_replicas_take_load_routing_and_refuse_an_unknown_one():
    from graphwrap import GraphwrapError, Replicas

    model = torch.nn.Linear(4, 4)
    with pytest.raises(GraphwrapError, match="routing must be one of"):
        Replicas(model, devices=["cpu"], routing="round-robin")
    reps = Replicas(model, devices=["cpu"], routing="load")
    try:
        assert reps.routing == "load"
    finally:
        reps.close()
