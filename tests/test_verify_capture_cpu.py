"""The capture checks, run on the CPU with a stand-in graph that recomputes on replay."""

import pytest
import torch
from torch import nn

from graphwrap.capture import CaptureFailed, Replica, _check_rebuild, _output_kinds, _verify, tile_rows
from graphwrap.tree import BATCHED, WHOLE, flatten_inputs, flatten_outputs
from helpers import MLP, HFOut, KVCache, NeedsAName, RowMixer


class RecomputeGraph:
    """replay() runs the module on the static inputs and writes the static outputs in place."""

    def __init__(self, module, static_in, static_out):
        self.module, self.static_in, self.static_out = module, static_in, static_out

    def replay(self):
        with torch.no_grad():
            outs, _ = flatten_outputs(self.module(*self.static_in))
        for dst, src in zip(self.static_out, outs):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


def _replica(module, sample, size, kinds=None):
    m = sample.shape[0]
    static_in = [tile_rows(sample, m, size, 0)]
    with torch.no_grad():
        ref_m, spec = flatten_outputs(module(sample))
        ref_b, _ = flatten_outputs(module(*static_in))
        if kinds is None:
            spec_in = flatten_inputs((sample,), {})[1]
            kinds = _output_kinds(module, spec_in, [sample], ref_m, ref_b, m, size, 0, spec)
        static_out = [o.clone() for o in ref_b]
    rep = Replica(RecomputeGraph(module, static_in, static_out), size, 0, static_in, static_out, kinds)
    return rep, ref_b, ref_m, m, spec


def test_tile_rows_repeats_real_rows():
    x = torch.arange(3).view(3, 1)
    assert tile_rows(x, 3, 7, 0).flatten().tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert tile_rows(x.t(), 2, 5, 1).flatten().tolist() == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("m,size", [(3, 8), (1, 4), (4, 4), (1, 1)])
def test_row_independent_model_verifies(m, size):
    rep, ref_b, ref_m, m, spec = _replica(MLP().eval(), torch.randn(m, 32), size)
    _verify(rep, ref_b, ref_m, m, spec)
    assert rep.kinds == [BATCHED]


@pytest.mark.parametrize("m,size", [(3, 8), (4, 4), (2, 4)])
def test_row_mixing_model_is_caught(m, size):
    rep, ref_b, ref_m, m, spec = _replica(RowMixer().eval(), torch.randn(m, 8), size)
    with pytest.raises(CaptureFailed, match="mixes rows of the batch"):
        _verify(rep, ref_b, ref_m, m, spec)


def test_verify_leaves_valid_padding_behind():
    sample = torch.randn(3, 32)
    rep, ref_b, ref_m, m, spec = _replica(MLP().eval(), sample, 8)
    before = rep.static_inputs[0].clone()
    _verify(rep, ref_b, ref_m, m, spec)
    assert torch.equal(rep.static_inputs[0], before)


def test_stale_graph_is_caught():
    class Frozen(nn.Module):
        """A 'graph' that ignores its inputs, as a capture of host-side work would."""

        def forward(self, x):
            return torch.ones(x.shape[0], 16)

    module = MLP().eval()
    rep, ref_b, ref_m, m, spec = _replica(module, torch.randn(2, 32), 4)
    rep.graph.module = Frozen()
    with pytest.raises(CaptureFailed, match="replay differs from eager"):
        _verify(rep, ref_b, ref_m, m, spec)


def test_batch_dependent_outputs_are_refused():
    class Sizes(nn.Module):
        def forward(self, x):
            return x * 2, x.shape[0]

    class Pooled(nn.Module):
        def forward(self, x):
            return x * 2, x.sum(0)

    with pytest.raises(CaptureFailed, match="depends on the batch"):
        _replica(Sizes(), torch.randn(3, 4), 8)
    with pytest.raises(CaptureFailed, match="changes with the batch"):
        _replica(Pooled(), torch.randn(3, 4), 8)


def test_whole_outputs_are_kept_whole():
    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(5))

        def forward(self, x):
            return x + 1, self.table * 2

    rep, ref_b, ref_m, m, spec = _replica(WithTable(), torch.randn(3, 4), 8)
    assert rep.kinds == [BATCHED, WHOLE]
    _verify(rep, ref_b, ref_m, m, spec)
    outs = rep.outputs_for(3)
    assert outs[0].shape == (3, 4) and outs[1].shape == (5,)


def test_outputs_that_rebuild_pass_and_others_are_caught():
    import collections

    t = torch.randn(3, 2)
    for out in (t, (t, [t, 1]), HFOut(last_hidden_state=t), collections.defaultdict(list, a=t),
                (KVCache([t], [t * 2]), torch.max(t, dim=1)), {"nan": torch.full((2,), float("nan"))}):
        _check_rebuild(*reversed(flatten_outputs(out)))
    # t(d) "works" for this dict subclass but gives an empty one: caught, not returned
    with pytest.raises(CaptureFailed, match="cannot be rebuilt from its parts: rebuilt, it is not"):
        _check_rebuild(*reversed(flatten_outputs(NeedsAName("out", {"h": t}))))

    class Strict(dict):
        def __init__(self, **kw):  # takes no positional dict: t(d) raises
            super().__init__(**kw)

    with pytest.raises(CaptureFailed, match="cannot be rebuilt from its parts: TypeError"):
        _check_rebuild(*reversed(flatten_outputs(Strict(h=t))))
