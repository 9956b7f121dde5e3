"""The capture checks, run on the CPU with a stand-in graph that recomputes on replay: output
kinds and sequence dims, verification of rows and padded positions, writes into inputs, rebuilds."""

import contextlib

import pytest
import torch
from helpers import MLP, HFOut, KVCache, NeedsAName, RecomputeRecorder, RowMixer, Scales
from torch import nn

from graphwrap.capture.checks import CaptureFailed, Scope, check_rebuild, shape_leaf, tile_rows
from graphwrap.capture.graph import Job, capture_bucket
from graphwrap.core.tree import BATCHED, WHOLE, flatten_inputs, flatten_outputs


def _capture(module, leaves, size, seq=None, roles=None, pad_check=True):
    """capture_bucket with the recompute recorder; the Captured record."""
    spec = flatten_inputs(tuple(leaves), {})[1]
    roles = roles or tuple((0, None, 0) for _ in leaves)
    job = Job(module.eval(), None, torch.device("cpu"), None, spec, roles, 0, [t.clone() for t in leaves], size, seq,
              guard=contextlib.nullcontext, pad_check=pad_check)
    return capture_bucket(job, RecomputeRecorder())


def test_tile_rows_repeats_real_rows():
    x = torch.arange(3).view(3, 1)
    assert tile_rows(x, 3, 7, 0).flatten().tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert tile_rows(x.t(), 2, 5, 1).flatten().tolist() == [0, 1, 0, 1, 0]


def test_shape_leaf_tiles_rows_and_cuts_or_pads_the_sequence():
    x = torch.arange(6).view(2, 3) + 1
    padded = shape_leaf(x, (0, 1, -1), 3, 5)
    assert padded.tolist() == [[1, 2, 3, -1, -1], [4, 5, 6, -1, -1], [1, 2, 3, -1, -1]]
    assert shape_leaf(x, (0, 1, 0), 2, 2).tolist() == [[1, 2], [4, 5]]
    same = shape_leaf(x, (0, None, 0), 2, None)
    assert torch.equal(same, x) and same.data_ptr() != x.data_ptr(), "always a tensor of its own"


@pytest.mark.parametrize("m,size", [(3, 8), (1, 4), (4, 4), (1, 1)])
def test_row_independent_model_verifies(m, size):
    got = _capture(MLP(), [torch.randn(m, 32)], size)
    assert got.kinds == [BATCHED] and got.graph.static_inputs[0].shape == (size, 32)


@pytest.mark.parametrize("m,size", [(3, 8), (4, 4), (2, 4)])
def test_row_mixing_model_is_caught(m, size):
    with pytest.raises(CaptureFailed, match="mixes rows of the batch"):
        _capture(RowMixer(), [torch.randn(m, 8)], size)


def test_verify_leaves_valid_padding_behind():
    sample = torch.randn(3, 32)
    got = _capture(MLP(), [sample], 8)
    assert torch.equal(got.graph.static_inputs[0], tile_rows(sample, 3, 8, 0))


def test_stale_graph_is_caught():
    class Frozen(nn.Module):
        """Ignores its inputs after the first run, as a capture of host-side work would."""

        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 16)
            self.runs = 0

        def forward(self, x):
            self.runs += 1
            return self.lin(x) if self.runs <= 5 else torch.ones(x.shape[0], 16)

    with pytest.raises(CaptureFailed, match="replay differs from eager"):
        _capture(Frozen(), [torch.randn(2, 32)], 4)


def test_batch_dependent_outputs_are_refused():
    class Sizes(nn.Module):
        def forward(self, x):
            return x * 2, x.shape[0]

    class Pooled(nn.Module):
        def forward(self, x):
            return x * 2, x.sum(0)

    with pytest.raises(CaptureFailed, match="depends on the batch"):
        _capture(Sizes(), [torch.randn(3, 4)], 8)
    with pytest.raises(CaptureFailed, match="changes with the batch"):
        _capture(Pooled(), [torch.randn(3, 4)], 8)


def test_whole_outputs_are_kept_whole():
    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(5))

        def forward(self, x):
            return x + 1, self.table * 2

    got = _capture(WithTable(), [torch.randn(3, 4)], 8)
    assert got.kinds == [BATCHED, WHOLE]
    outs = got.graph.outputs_for(3, None)
    assert outs[0].shape == (3, 4) and outs[1].shape == (5,)


def test_a_forward_that_writes_into_its_input_is_refused_and_the_callers_tensor_is_untouched():
    x = torch.randn(3, 4)
    before = x.clone()
    with pytest.raises(CaptureFailed, match="writes into its input #0"):
        _capture(Scales(), [x], 4)
    assert torch.equal(x, before)


class Masked(nn.Module):
    """Each position sees the mean over the real positions of its row (an attention stand-in)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)

    def forward(self, ids, mask):
        h = self.emb(ids)
        m = mask.unsqueeze(-1).float()
        ctx = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        return h + ctx, ctx.squeeze(1)


class Unmasked(Masked):
    def forward(self, ids, mask):
        h = self.emb(ids)
        return h + h.mean(1, keepdim=True), h.mean(1)


SEQ = ((0, 1, 0), (0, 1, 0))


@pytest.mark.parametrize("L,S", [(5, 16), (16, 16), (1, 4)])
def test_padding_along_the_sequence_is_verified_and_cut_back(L, S):
    ids, mask = torch.randint(1, 20, (3, L)), torch.ones(3, L, dtype=torch.long)
    got = _capture(Masked(), [ids, mask], 4, seq=S, roles=SEQ)
    assert got.kinds == [BATCHED, BATCHED] and got.seq_dims == [(1,), ()]
    g = got.graph
    assert g.static_inputs[0].shape == (4, S) and g.hi == [L, L]
    assert bool((g.static_inputs[1][:, L:] == 0).all()), "padded positions hold the pad value"
    assert [o.shape for o in g.outputs_for(3, L)] == [(3, L, 8), (3, 8)]


def test_a_model_that_does_not_ignore_padded_positions_is_refused_for_padding_only():
    ids, mask = torch.randint(1, 20, (3, 5)), torch.ones(3, 5, dtype=torch.long)
    with pytest.raises(CaptureFailed, match="does not ignore padded positions") as e:
        _capture(Unmasked(), [ids, mask], 4, seq=16, roles=SEQ)
    assert e.value.scope is Scope.SEQ
    got = _capture(Unmasked(), [ids, mask], 4, seq=5, roles=SEQ, pad_check=False)  # its exact length
    assert got.graph.static_inputs[0].shape == (4, 5)


def test_outputs_that_change_with_the_length_otherwise_are_refused_for_padding():
    class Flat(nn.Module):
        def forward(self, ids):
            return ids.float().flatten(1)[:, :-1]  # [n, L - 1]: no dim of it is the length

    with pytest.raises(CaptureFailed, match="or the sequence") as e:
        _capture(Flat(), [torch.randint(1, 9, (2, 6))], 4, seq=8, roles=((0, 1, 0),))
    assert e.value.scope is Scope.SEQ


def test_outputs_that_rebuild_pass_and_others_are_caught():
    import collections

    t = torch.randn(3, 2)
    for out in (t, (t, [t, 1]), HFOut(last_hidden_state=t), collections.defaultdict(list, a=t),
                (KVCache([t], [t * 2]), torch.max(t, dim=1)), {"nan": torch.full((2,), float("nan"))}):
        check_rebuild(*reversed(flatten_outputs(out)))
    # t(d) "works" for this dict subclass but gives an empty one: caught, not returned
    with pytest.raises(CaptureFailed, match="cannot be rebuilt from its parts: rebuilt, it is not"):
        check_rebuild(*reversed(flatten_outputs(NeedsAName("out", {"h": t}))))

    class Strict(dict):
        def __init__(self, **kw):  # takes no positional dict: t(d) raises
            super().__init__(**kw)

    with pytest.raises(CaptureFailed, match="cannot be rebuilt from its parts: TypeError"):
        check_rebuild(*reversed(flatten_outputs(Strict(h=t))))


def test_the_random_draw_check_tells_draws_apart_without_loading_dynamo():
    # A fresh interpreter: whether the check imports torch._dynamo (3 to 4 s of a first capture
    # on a GPU machine) can only be seen where nothing loaded it before.
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from graphwrap.capture.graph import CudaRecorder\n"
        "lin = torch.nn.Linear(4, 4)\n"
        "_, plain = CudaRecorder.watch_random(lambda: lin(torch.ones(2, 4)))\n"
        "_, drop = CudaRecorder.watch_random(lambda: torch.nn.functional.dropout(lin(torch.ones(2, 4)), 0.5, True))\n"
        "_, rand = CudaRecorder.watch_random(lambda: lin(torch.randn(2, 4)))\n"
        "print(plain, drop, rand, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True", "True", "False"], out.stdout + out.stderr
