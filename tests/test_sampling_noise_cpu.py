"""The shared batch's sampling noise (graphwrap/decoding/engine/sampling.py): Gumbel noise from a hash of
each row's seed, position and token id. It must be finite for every hash: an infinite draw makes
its token the sample whatever its score, and turns a token top-k, top-p or a grammar removed
(-inf) into NaN, which argmax takes."""

import torch

from graphwrap.decoding.engine.sampling import Active, RowSettings, SeqSettings, gumbel, uniform


def test_uniform_is_strictly_inside_zero_and_one_for_every_32_bit_value():
    edges = torch.tensor([0, 1, 511, 512, (1 << 31) - 1, 1 << 31, 0xFFFFFE00, 0xFFFFFFFF], dtype=torch.long)
    u = uniform(edges)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    every = torch.arange(1 << 23, dtype=torch.long) << 9 | 511  # every value of the bits kept, with the rest set
    assert torch.isfinite(-torch.log(-torch.log(uniform(every)))).all()


def test_noise_is_finite_over_many_seeds_positions_and_ids():
    seeds = torch.arange(64, dtype=torch.long) * 7919
    g = gumbel(seeds, torch.arange(64, dtype=torch.long), 50_000)
    assert torch.isfinite(g).all()


def test_a_sampled_row_never_takes_a_token_set_to_minus_inf():
    """Top-k of 1 is the greedy token, whatever the noise, at every position of many seeds."""
    vocab, rows = 4096, 32
    rs = RowSettings(rows, 256, torch.device("cpu"), vocab)
    settings = [SeqSettings(max_new=8, sample=True, top_k=1) for _ in range(rows)]
    rs.write(list(range(rows)), settings, [[1]] * rows, list(range(rows)))
    active = Active.of(settings)
    torch.manual_seed(0)
    for position in range(0, 200, 7):
        logits = torch.randn(rows, vocab)
        tokens = rs.next_tokens(logits, rows, torch.full((rows,), position, dtype=torch.long), active)
        assert torch.equal(tokens, logits.argmax(-1))
