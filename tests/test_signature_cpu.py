"""Signatures on the CPU: which dim of each input holds the batch and which the sequence, the
batch size and length of a call, what its key holds, and why a call runs eagerly."""

import pytest
import torch
from helpers import MLP, assert_same
from torch import nn

from graphwrap import GraphedModule, GraphwrapError
from graphwrap.core.reasons import Kind
from graphwrap.core.signature import Declarations, describe_key


class Takes(nn.Module):
    def forward(self, x, cache=None, pos=None):
        return x


def _facts(decl, *args, **kwargs):
    return decl.facts(args, kwargs, None)


def test_every_input_batched_when_they_agree():
    f = _facts(Declarations(Takes()), torch.zeros(3, 2), torch.zeros(3))
    assert f.n == 3 and f.L is None and [r[0] for r in f.roles] == [0, 0]
    f = _facts(Declarations(Takes(), batch_dim=1), torch.zeros(2, 5), torch.zeros(1, 5))
    assert f.n == 5


def test_one_row_or_no_batch_dim_is_unbatched_where_the_others_agree():
    f = _facts(Declarations(Takes()), torch.zeros(3, 8), torch.zeros(3, 4, 8), torch.zeros(1))
    assert f.n == 3 and [r[0] for r in f.roles] == [0, 0, None]
    f = _facts(Declarations(Takes()), torch.zeros(4, 8), torch.tensor(2.0))
    assert f.n == 4 and f.roles[1][0] is None
    assert f.meta[1][0] == () and f.meta[0][0] == ("B", 8)


def test_ambiguous_batches_run_eagerly_with_the_reason():
    reason = _facts(Declarations(Takes()), torch.zeros(3, 2), torch.zeros(4, 2))
    assert reason.kind is Kind.INPUT and "disagree on the batch size" in reason.reason
    assert "batch_dim={name: None" in reason.reason


def test_batch_dim_by_name_and_position():
    decl = Declarations(Takes(), batch_dim={"pos": None})
    f = _facts(decl, torch.zeros(4, 8), torch.zeros(4, 2), torch.zeros(4))
    assert f.n == 4 and [r[0] for r in f.roles] == [0, 0, None], "pos named, passed by position"
    f = _facts(decl, torch.zeros(4, 8), pos=torch.zeros(4))
    assert [r[0] for r in f.roles] == [0, None], "pos passed by keyword"
    decl = Declarations(Takes(), batch_dim={1: None})
    f = _facts(decl, torch.zeros(4, 8), torch.zeros(3, 3))
    assert f.n == 4 and [r[0] for r in f.roles] == [0, None]
    reason = _facts(Declarations(Takes(), batch_dim={"cache": 0}), torch.zeros(4, 8), torch.zeros(3, 3))
    assert "input cache has 3 rows" in reason.reason


def test_sequence_dim_and_length():
    decl = Declarations(Takes(), seq_dim=1, pad_values={"pos": -1})
    f = _facts(decl, torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, 4), torch.zeros(2, dtype=torch.long))
    assert (f.n, f.L) == (2, 7)
    assert f.roles == ((0, 1, 0), (0, 1, 0), (0, None, -1))
    assert f.meta[0][0] == ("B", "S") and f.meta[1][0] == ("B", "S", 4)
    assert "Tensor[B, S] int64 cpu" in describe_key(f.spec, f.meta, None)
    g = _facts(decl, torch.zeros(5, 9, dtype=torch.long), torch.zeros(5, 9, 4), torch.zeros(5, dtype=torch.long))
    assert g.key == f.key, "other rows and another length: the same key"
    reason = _facts(decl, torch.zeros(2, 7), torch.zeros(2, 6, 4))
    assert "disagree on the sequence length" in reason.reason
    named = Declarations(Takes(), seq_dim={"x": 1})
    f = _facts(named, torch.zeros(2, 7), torch.zeros(2, 7))
    assert f.roles[0][1] == 1 and f.roles[1][1] is None, "inputs left out keep their shape"


@pytest.mark.parametrize("kwargs, words", [
    ({"batch_dim": -1}, "batch_dim must be a non-negative int"),
    ({"batch_dim": {"x": "a"}}, r"batch_dim\['x'\]"),
    ({"seq_dim": 0}, "seq_dim=0 is the batch_dim"),
    ({"seq_dim": 1.5}, "seq_dim must be"),
    ({"pad_values": "zero"}, "pad_values"),
    ({"seq_buckets": [16]}, "pass seq_dim= too"),
    ({"seq_dim": 1, "seq_buckets": "some"}, "not a list of lengths"),
    ({"seq_dim": 1, "max_tokens": 0}, "max_tokens must be a positive int"),
])
def test_bad_declarations_say_why(kwargs, words):
    with pytest.raises(GraphwrapError, match=words):
        GraphedModule(MLP(), **kwargs)


def test_unbatched_inputs_run_as_the_module_runs_on_a_cpu():
    class AddPos(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, pos):
            return self.lin(x) + pos

    model = AddPos().eval()
    gm = GraphedModule(model)
    x, pos = torch.randn(3, 8), torch.randn(1)
    assert_same(gm(x, pos), model(x, pos).detach(), tol=0)


def test_a_dict_input_whose_first_key_is_S_is_no_state():
    # Keys are constants of a dict node; the readers of a spec never take them for a node of
    # their own (a tuple of keys starting with "S" once read as a state input).
    x = {"S": torch.zeros(3, 2), "x": torch.zeros(3, 2)}
    f = _facts(Declarations(Takes()), x)
    assert not f.state and f.n == 3 and [r[0] for r in f.roles] == [0, 0]
    assert describe_key(f.spec, f.meta, None) == "({'S': Tensor[B, 2] float32 cpu, 'x': Tensor[B, 2] float32 cpu})"
