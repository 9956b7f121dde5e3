"""Inputs and outputs of every kind on a GPU: structures, containers, registered objects, host inputs, odd and bad inputs, owned and view outputs, compared with eager."""

import pytest
import torch
from helpers import (
    HFOut,
    KVCache,
    MultiIO,
    NeedsAName,
    WithCache,
    assert_same,
    eager_answer,
    gpu_mlp,
    num_graphs,
)
from torch import nn

from graphwrap import GraphedModule, GraphwrapError

pytestmark = pytest.mark.cuda
DEV = "cuda"


def test_clone_outputs_survive_later_calls_and_views_do_not():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4])
    x1, x2 = torch.randn(4, 32, device=DEV), torch.randn(4, 32, device=DEV)
    y1 = gm(x1)
    gm(x2)
    assert_same(y1, eager_answer(model, x1))
    gv = GraphedModule(model, buckets=[4], outputs="view")
    v1 = gv(x1)
    v2 = gv(x2)
    assert v1.data_ptr() == v2.data_ptr(), "view outputs are the static output buffer"
    assert_same(v1, eager_answer(model, x2))
    v3 = gv(x1[:3])
    assert v3.shape == (3, 16) and v3.data_ptr() == v1.data_ptr()


def test_structured_inputs_and_outputs():
    model = MultiIO().to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 4, 8])
    for n in (1, 3, 8, 5, 11):
        x = torch.randn(n, 8, device=DEV)
        pair = (torch.randn(n, 8, device=DEV), {"m": torch.randn(n, 8, device=DEV)})
        extra = torch.randn(n, 3, device=DEV)
        got = gm(x, pair, scale=0.5, mode="sum", extra=extra)
        assert_same(got, eager_answer(model, x, pair, scale=0.5, mode="sum", extra=extra))
        got = gm(x, pair, scale=2.0, mode="plain")
        assert_same(got, eager_answer(model, x, pair, scale=2.0, mode="plain"))
    assert len(gm.stats()["keys"]) == 2, "constants are part of the key"
    assert gm.stats()["eager_calls"] == {}


def test_hf_style_output():
    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, input_ids, attention_mask=None):
            h = self.lin(input_ids.float()) * attention_mask.unsqueeze(-1)
            return HFOut(last_hidden_state=h, pooler_output=h.mean(1))

    model = Enc().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 8])
    for n in (1, 2, 5, 8):
        ids = torch.randint(0, 100, (n, 4, 8), device=DEV)
        mask = torch.randint(0, 2, (n, 4), device=DEV)
        got = gm(ids, attention_mask=mask)
        assert type(got) is HFOut and list(got.keys()) == ["last_hidden_state", "pooler_output"]
        assert_same(got, eager_answer(model, ids, attention_mask=mask))


def test_cpu_inputs_are_copied_in():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[8])
    x = torch.randn(5, 32)
    y = gm(x)
    assert y.is_cuda
    assert_same(y, eager_answer(model, x.to(DEV)))


def test_registered_cache_objects_in_outputs():
    # A cache object registered with torch.utils._pytree comes out of the graphs rebuilt around
    # its own tensors, cut to the real rows, owned by the caller, in gm(...) and the pipeline.
    model = WithCache().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 4, 8])
    kept = []
    for n in (1, 3, 8, 5, 2):
        x = torch.randn(n, 32, device=DEV)
        got = gm(x)
        assert type(got[1]) is KVCache and got[1].keys[0].shape[0] == n
        assert_same(got, eager_answer(model, x))
        kept.append((x, got))
    for x, got in kept:  # later calls did not overwrite earlier outputs
        assert_same(got, eager_answer(model, x))
    assert gm.stats()["eager_calls"] == {} and num_graphs(gm) == 3
    xs = [torch.randn(n, 32).pin_memory() for n in (3, 8, 1, 6, 4)]
    for to_host in (False, True):
        for x, got in zip(xs, gm.pipeline(xs, to_host=to_host)):
            assert type(got[1]) is KVCache and got[1].values[1].is_cuda is not to_host
            assert_same(got, eager_answer(model, x.to(DEV)) if not to_host else
                        tuple(_cpu(o) for o in eager_answer(model, x.to(DEV))))


def test_outputs_of_every_container_and_one_that_cannot_be_rebuilt():
    import collections

    class Containers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            return torch.max(h, dim=1), collections.defaultdict(list, h=h), collections.deque([h * 2])

    class Unrebuildable(Containers):
        def forward(self, x):
            return NeedsAName("out", {"h": self.lin(x)})

    model = Containers().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 8])
    for n in (1, 2, 5, 8):
        x = torch.randn(n, 8, device=DEV)
        got, want = gm(x), eager_answer(model, x)
        assert [type(o) for o in got] == [type(o) for o in want]
        assert_same(got[0].values, want[0].values)
        assert_same(got[0].indices, want[0].indices)
        assert_same(got[1]["h"], want[1]["h"])
        assert_same(got[2][0], want[2][0])
    assert gm.stats()["eager_calls"] == {} and num_graphs(gm) == 2

    model = Unrebuildable().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 8])
    x = torch.randn(3, 8, device=DEV)
    got = gm(x)
    assert type(got) is NeedsAName and got.name == "out"  # eager's own object
    assert_same(got["h"], eager_answer(model, x)["h"])
    assert any("cannot be rebuilt from its parts" in r for r in gm.stats()["eager_calls"]), gm.stats()
    assert num_graphs(gm) == 0


def _cpu(o):
    if isinstance(o, KVCache):
        return KVCache([k.cpu() for k in o.keys], [v.cpu() for v in o.values])
    return o.cpu()


def test_dict_inputs_of_other_types():
    import collections

    class Takes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, d):
            return self.lin(d["x"]) * len(d)

    model = Takes().to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 8])
    for n in (1, 5):
        x = torch.randn(n, 8, device=DEV)
        d = collections.defaultdict(list, x=x)
        assert_same(gm(d), eager_answer(model, d))
        named = NeedsAName("n", {"x": x})  # not rebuilt from its items: eager, given as is
        assert_same(gm(named), eager_answer(model, named))
        with pytest.raises(RuntimeError) as e:  # its CPU tensor is not moved: eager's own error
            gm(NeedsAName("n", {"x": x.cpu()}))
        assert not isinstance(e.value, GraphwrapError) and "device" in str(e.value)
    assert num_graphs(gm) == 2
    assert any("NeedsAName" in r for r in gm.stats()["eager_calls"]), gm.stats()


def test_gpt2_with_its_cache_once_the_cache_is_registered():
    # GPT2LMHeadModel returns its key/value cache by default (a DynamicCache). transformers can
    # register that type with torch.utils._pytree; then the graphs serve the model as it is.
    tr = pytest.importorskip("transformers")
    try:
        from transformers.integrations.executorch import (
            register_dynamic_cache_export_support,
        )
    except ImportError as e:
        pytest.skip(f"this transformers ({tr.__version__}) cannot register DynamicCache with pytree: {e}")
    register_dynamic_cache_export_support()
    cfg = tr.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=1000, n_positions=64)
    model = tr.GPT2LMHeadModel(cfg).to(DEV).eval()
    gm = GraphedModule(model, buckets=[2, 4])
    for n in (1, 4, 3):
        ids = torch.randint(0, 1000, (n, 16), device=DEV)
        got, want = gm(ids), eager_answer(model, ids)
        assert type(got.past_key_values) is type(want.past_key_values)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        for a, b in zip(torch.utils._pytree.tree_leaves(got.past_key_values),
                        torch.utils._pytree.tree_leaves(want.past_key_values)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert gm.stats()["eager_calls"] == {}, gm.stats()


def test_bad_and_odd_inputs():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4, 8])
    empty = torch.randn(0, 32, device=DEV)
    assert gm(empty).shape == (0, 16)
    assert "the batch is empty" in gm.stats()["eager_calls"]
    wide = torch.randn(32, 10, device=DEV)
    assert_same(gm(wide.t()[:6]), eager_answer(model, wide.t()[:6].contiguous()))  # strided rows
    x = torch.randn(5, 32, device=DEV)
    x[1] = float("nan")
    x[3, 0] = float("inf")
    got, want = gm(x), eager_answer(model, x)
    assert torch.isnan(got[1]).all()
    assert_same(got[[0, 2, 4]], want[[0, 2, 4]])
    # Inputs that disagree on the batch: the module runs them as it would (here it raises its own
    # error), and stats() says why no graph served them.
    mio = GraphedModule(MultiIO().to(DEV).eval())
    with pytest.raises(RuntimeError, match="must match the size") as e:
        mio(torch.randn(3, 8, device=DEV), (torch.randn(4, 8, device=DEV), {"m": torch.randn(3, 8, device=DEV)}))
    assert not isinstance(e.value, GraphwrapError)
    assert any("disagree on the batch size" in r for r in mio.stats()["eager_calls"])


def test_view_output_passed_back_in():
    sq = nn.Sequential(nn.Linear(16, 16), nn.Tanh()).to(DEV).eval()
    gv = GraphedModule(sq, buckets=[4], outputs="view")
    x = torch.randn(3, 16, device=DEV)
    y = gv(x)
    want = eager_answer(sq, eager_answer(sq, x))
    assert_same(gv(y), want)


def test_inputs_that_require_grad_run_eagerly():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4])
    x = torch.randn(3, 32, device=DEV, requires_grad=True)
    gm(x).sum().backward()
    assert x.grad is not None
    assert "an input requires grad and grad mode is on" in gm.stats()["eager_calls"]
    with torch.no_grad():
        assert_same(gm(x), eager_answer(model, x))
    assert num_graphs(gm) == 1


def test_other_dtype_width_or_rank_get_their_own_key_and_aliased_inputs_work():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4, 8])
    x = torch.randn(3, 32, device=DEV)
    assert_same(gm(x), eager_answer(model, x))
    # Another dtype or feature width is another key: the module runs on it (and raises its own
    # error here, as eager does); the captured graph is never replayed on mismatched shapes.
    for bad in (x.double(), torch.randn(3, 31, device=DEV)):
        with pytest.raises(RuntimeError) as info:
            gm(bad)
        assert not isinstance(info.value, GraphwrapError)
    # Another rank the module accepts: a key of its own, captured and correct.
    x3 = torch.randn(5, 2, 32, device=DEV)
    assert_same(gm(x3), eager_answer(model, x3))
    assert_same(gm(x), eager_answer(model, x))
    assert len(gm.stats()["keys"]) == 4 and num_graphs(gm) == 2
    # One tensor passed for two inputs, and an input that is a view of another.
    mio = MultiIO().to(DEV).eval()
    gmio = GraphedModule(mio, buckets=[4])
    a = torch.randn(4, 8, device=DEV)
    for args in ((a, (a, {"m": a})), (a[:3], (a[1:], {"m": a[:3] * 1}))):
        assert_same(gmio(*args), eager_answer(mio, *args))
    assert gmio.stats()["eager_calls"] == {}


def test_autocast_is_part_of_the_key():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4])
    x = torch.randn(3, 32, device=DEV)
    with torch.autocast("cuda", dtype=torch.float16):
        got = gm(x)
        want = eager_answer(model, x)
    assert got.dtype == torch.float16
    assert_same(got, want, tol=1e-2)
    assert_same(gm(x), eager_answer(model, x))
    assert len(gm.stats()["keys"]) == 2
