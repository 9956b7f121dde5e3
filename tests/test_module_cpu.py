"""GraphedModule on the CPU: drop-in behaviour, errors and the eager fallback."""

import logging

import pytest
import torch
from helpers import MLP, MultiIO, assert_same, run_threads
from torch import nn

import graphwrap
from graphwrap import GraphedModule, GraphwrapError


def _multi_inputs(n, d=8):
    x = torch.randn(n, d)
    pair = (torch.randn(n, d), {"m": torch.randn(n, d)})
    return (x, pair), {"scale": 0.5, "mode": "sum", "extra": torch.randn(n, 3)}


def test_import_and_public_names():
    assert set(graphwrap.__all__) >= {"GraphedModule", "GraphwrapError", "Inputs", "default_buckets"}
    assert issubclass(GraphwrapError, RuntimeError)
    assert graphwrap.__version__


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 300])
def test_eager_fallback_matches_module(n):
    model = MultiIO().eval()
    gm = GraphedModule(model, buckets=[1, 4, 16])
    args, kwargs = _multi_inputs(n)
    assert_same(gm(*args, **kwargs), model(*args, **kwargs), tol=0)


def test_fallback_reason_is_kept_and_logged_once(gw_log):
    gm = GraphedModule(MLP().eval())
    for _ in range(3):
        gm(torch.randn(2, 32))
    reasons = gm.stats()["eager_calls"]
    assert sum(reasons.values()) == 3 and len(reasons) == 1
    reason = next(iter(reasons))
    assert "CUDA" in reason or "not on a CUDA device" in reason
    assert sum("running eagerly" in r.message for r in gw_log.records) == 1


def test_training_mode_runs_eagerly():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    gm = GraphedModule(model)
    assert gm.training and model.training
    gm.eval()
    assert not gm.training and not model.training and not model[1].training
    gm.train()
    assert model[1].training
    x = torch.randn(8, 4, requires_grad=True)
    gm(x).sum().backward()
    assert x.grad is not None
    assert "the module is in training mode" in gm.stats()["eager_calls"]


def test_dims_that_fit_no_input_are_found_in_training_mode_too(caplog):
    """Training-mode calls are never keyed, so the dims are checked against the first one: a
    seq_dim or batch_dim that no input has raises as in eval mode; a named input without its
    dim is logged once (where graphs serve, such calls run eagerly) and the call runs as the
    module does."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))
    x = torch.randn(8, 4)
    with pytest.raises(GraphwrapError, match="seq_dim=5"):
        GraphedModule(model, seq_dim=5)(x)
    with pytest.raises(GraphwrapError, match="batch_dim=7"):
        GraphedModule(model, batch_dim=7)(x)
    gm = GraphedModule(model, batch_dim={"input": 3})
    with caplog.at_level(logging.WARNING, logger="graphwrap"):
        out = gm(x)
        gm(x)
    assert torch.equal(out, model(x))
    said = [r.message for r in caplog.records if "batch_dim=3" in r.message]
    assert len(said) == 1 and "such calls run eagerly" in said[0], said
    assert "the module is in training mode" in gm.stats()["eager_calls"]


def test_state_dict_keys_and_loading_are_the_modules():
    model = MLP().eval()
    gm = GraphedModule(model)
    assert list(gm.state_dict()) == list(model.state_dict())
    assert [n for n, _ in gm.named_parameters()] == [n for n, _ in model.named_parameters()]
    new = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    gm.load_state_dict(new)
    for k, v in model.state_dict().items():
        assert torch.equal(v, new[k])


def test_nested_in_a_parent_module_keeps_keys():
    class Parent(nn.Module):
        def __init__(self, enc):
            super().__init__()
            self.enc = enc

    plain = Parent(MLP())
    wrapped = Parent(GraphedModule(MLP()))
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    for (k, a), (_, b) in zip(wrapped.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), k


def test_attributes_fall_through():
    model = MLP()
    model.config = {"hidden": 64}
    gm = GraphedModule(model)
    assert gm.config == {"hidden": 64}
    assert gm.layers is model.layers
    assert gm.module is model
    assert "config" in dir(gm)
    with pytest.raises(AttributeError):
        gm.no_such_attribute


def test_to_and_half_act_on_the_module():
    model = MLP()
    gm = GraphedModule(model)
    assert gm.double() is gm
    assert model.layers[0].weight.dtype == torch.float64
    gm.to(torch.float32)
    assert model.layers[0].weight.dtype == torch.float32


def test_non_tensor_inputs_run_eagerly_with_a_reason():
    class TakesObj(nn.Module):
        def forward(self, x, cfg):
            return x * cfg.k

    class Cfg:
        k = 3

    gm = GraphedModule(TakesObj())
    x = torch.randn(2, 2)
    assert torch.equal(gm(x, Cfg()), x * 3)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"outputs": "copy"}, 'outputs must be "clone" or "view"'),
        ({"fallback": "ignore"}, 'fallback must be "eager" or "raise"'),
        ({"batch_dim": -1}, "batch_dim must be a non-negative int"),
        ({"warmup_iters": 0}, "warmup_iters must be an int >= 1"),
        ({"max_keys": 0}, "max_keys must be an int >= 1"),
        ({"buckets": [4], "max_batch_size": 8}, "does not match the largest bucket"),
        ({"buckets": 5}, r"buckets must be None, \"default\", \"exact\""),
        ({"buckets": "fast"}, "buckets must be None"),
        ({"buckets": [0, 4]}, "a list of batch sizes"),
        ({"buckets": []}, "a list of batch sizes"),
        ({"max_batch_size": 0}, "max_batch_size must be an int >= 1"),
        ({"verify": "yes"}, "verify must be True or False"),
        ({"verify": None}, "verify must be True or False"),
        ({"eager_if_faster": "no"}, "eager_if_faster must be True or False"),
        ({"seq_dim": {"nope": 1}}, r"seq_dim names the input 'nope', which MLP.forward does not take: its inputs are \['x'\]"),
        ({"batch_dim": {"nope": 0}}, "batch_dim names the input 'nope'"),
        ({"seq_dim": 1, "pad_values": {"nope": 1}}, "pad_values names the input 'nope'"),
        ({"state": "nope"}, "state names the input 'nope'"),
        ({"state": 3}, "state names input position 3, which MLP.forward does not take: it takes 1 positional"),
        ({"seq_dim": 1, "seq_buckets": []}, "seq_buckets must be .* a non-empty list of lengths"),
        ({"seq_dim": 1, "seq_buckets": [0, 8]}, "seq_buckets must be"),
    ],
)
def test_bad_arguments_say_why(kwargs, words):
    with pytest.raises(GraphwrapError, match=words):
        GraphedModule(MLP(), **kwargs)


def test_names_are_checked_only_against_what_the_forward_takes():
    class Kw(nn.Module):
        def forward(self, x, **extra):
            return x

    class Star(nn.Module):
        def forward(self, *xs):
            return xs[0]

    GraphedModule(Kw(), seq_dim={"anything": 1})  # **extra takes any name
    GraphedModule(Star(), state=[3])  # *xs takes any position
    GraphedModule(MLP(), batch_dim={0: 0, "x": 0})
    with pytest.raises(GraphwrapError, match="wait.*seconds"):
        GraphedModule(MLP()).wait("x")


def test_wrapping_a_non_module_fails_clearly():
    with pytest.raises(GraphwrapError, match="wraps an nn.Module, got function"):
        GraphedModule(lambda x: x)


def test_capture_without_cuda_is_a_logged_no_op(gw_log):
    model = MLP().eval()
    gm = GraphedModule(model)
    s = gm.capture(torch.randn(2, 32))
    assert s["keys"] == [] and s["graph_pool_bytes"] == 0
    assert any("captured nothing" in r.getMessage() for r in gw_log.records)
    x = torch.randn(3, 32)
    assert_same(gm(x), model(x), tol=0)
    with pytest.raises(GraphwrapError, match="cannot capture: the module is in training mode"):
        GraphedModule(MLP().train()).capture(torch.randn(2, 32))


def test_outputs_never_require_grad_on_a_cpu_either():
    model = MLP().eval()
    gm = GraphedModule(model)
    x = torch.randn(3, 32)
    out = gm(x)
    assert not out.requires_grad and out.grad_fn is None
    assert_same(out, model(x).detach(), tol=0)
    # where eager runs for grad, grad it gets
    xg = torch.randn(3, 32, requires_grad=True)
    gm(xg).sum().backward()
    assert xg.grad is not None
    model.train()
    assert gm(x).requires_grad


def test_fallback_is_thread_safe():
    model = MLP().eval()
    gm = GraphedModule(model, buckets=[1, 2, 4, 8])

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(50):
            n = int(torch.randint(1, 20, (1,), generator=g))
            x = torch.randn(n, 32, generator=g)
            with torch.no_grad():
                assert_same(gm(x), model(x), tol=0)

    assert not run_threads(work)
    assert sum(gm.stats()["eager_calls"].values()) == 400


def test_pipeline_without_cuda_matches_eager():
    model = MultiIO().eval()
    gm = GraphedModule(model)
    items = [_multi_inputs(n) for n in (1, 5, 3)]
    outs = list(gm.pipeline([graphwrap.Inputs(*a, **k) for a, k in items]))
    assert len(outs) == 3
    for (a, k), o in zip(items, outs):
        assert_same(o, model(*a, **k), tol=0)
    mlp = MLP().eval()
    gm2 = GraphedModule(mlp)
    xs = [torch.randn(n, 32) for n in (2, 9, 1)]
    for x, o in zip(xs, gm2.pipeline(xs, to_host=True)):
        assert_same(o, mlp(x), tol=0)
    with pytest.raises(GraphwrapError, match="wrap it as graphwrap.Inputs"):
        list(gm2.pipeline([object()]))


def test_logger_is_named_graphwrap():
    assert logging.getLogger("graphwrap") is graphwrap.core.engine.logger


def test_bucket_policies_on_the_module():
    assert GraphedModule(MLP(), buckets="exact", max_batch_size=6).buckets == (1, 2, 3, 4, 5, 6)
    gm = GraphedModule(MLP(), buckets=graphwrap.Adaptive(k=2, histogram={1: 9, 3: 10, 20: 2}))
    assert gm.buckets == (3, 20)
    with pytest.raises(GraphwrapError, match="max_batch_size"):
        GraphedModule(MLP(), buckets=graphwrap.Adaptive(k=2), max_batch_size=64)
    for bad in (0, -5, 1.5, "1GB"):
        with pytest.raises(GraphwrapError, match="max_pool_bytes"):
            GraphedModule(MLP(), max_pool_bytes=bad)


@pytest.mark.parametrize("compile, match", [
    ({"mode": "reduce-overhead"}, "CUDA graphs of its own"),
    ({"mode": "max-autotune"}, "max-autotune-no-cudagraphs"),
    ({"options": {"triton.cudagraphs": True}}, "conflicts"),
    ({"backend": "eager"}, "takes the torch.compile options"),
    ({"mode": "default", "options": {"max_autotune": True}}, "not both"),
    ({"mode": "bogus"}, "'bogus' is not a torch.compile mode"),
    ("yes", "True, False or a dict"),
])
def test_compile_options_are_checked(compile, match):
    with pytest.raises(GraphwrapError, match=match):
        GraphedModule(MLP(), compile=compile)


def test_compile_options_completed():
    from graphwrap.capture.compiled import compile_options

    assert compile_options(None) is None and compile_options(False) is None
    opts = compile_options(True)
    assert opts["dynamic"] == "batch" and opts["options"] == {"triton.cudagraphs": False} and opts["mode"] is None
    opts = compile_options({"mode": "max-autotune-no-cudagraphs", "dynamic": True})
    assert opts["options"] is None and opts["dynamic"] is True


def test_compile_on_cpu_runs_eagerly_with_the_same_results():
    model = MLP().eval()
    gm = GraphedModule(model, compile=True)
    x = torch.randn(3, 32)
    assert_same(gm(x), model(x), tol=0)
    s = gm.stats()
    assert s["compile"]["graphs"] == 0 and s["compile"]["options"]["dynamic"] == "batch"
    assert gm.buckets[0] == 2, "one compile for every bucket: batches of one row run in bucket 2"


def test_keys_of_every_input_kind_are_described():
    import collections

    from graphwrap.core.signature import Declarations, describe_key

    Pair = collections.namedtuple("Pair", "a b")

    class Items(list):
        pass

    t = torch.zeros(2, 3)
    args = (t, 1.5, (t, "s"), [t], {"k": t}, collections.OrderedDict(o=t), collections.defaultdict(list, d=t),
            Pair(t, None), Items([t]))
    f = Declarations(nn.Identity()).facts(args, {"kw": t}, None)
    text = describe_key(f.spec, f.meta, None)
    for part in ("Tensor[B, 3] float32 cpu", "1.5", "'s'", "{'k': Tensor", "OrderedDict({'o': Tensor",
                 "defaultdict({'d': Tensor", "Pair(Tensor", "None)", "Items(Tensor", "kw=Tensor"):
        assert part in text, (part, text)


def test_copies_pickles_and_saves_keep_the_options_and_start_fresh():
    import copy
    import io
    import pickle

    model = MLP().eval()
    gm = GraphedModule(model, max_batch_size=16, outputs="view")
    x = torch.randn(3, 32)
    gm(x)
    for twin in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        assert isinstance(twin, GraphedModule) and twin.module is not model
        assert twin.buckets == gm.buckets and twin._gw_outputs == "view"
        assert twin.stats()["eager_calls"] == {}, "a fresh engine"
        assert list(twin.state_dict()) == list(gm.state_dict())
        assert twin._parameters is twin.module._parameters
        assert_same(twin(x), model(x).detach(), tol=0)
    buf = io.BytesIO()
    torch.save(gm, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert_same(loaded(x), model(x).detach(), tol=0)
    assert copy.copy(gm)(x).shape == (3, 16)


def test_container_manners_are_the_modules():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    gm = GraphedModule(seq)
    assert len(gm) == 3 and gm[0] is seq[0] and list(gm) == list(seq)
    assert isinstance(gm[1:], nn.Sequential)
    with pytest.raises(TypeError):
        len(GraphedModule(MLP()))
    with pytest.raises(GraphwrapError, match="a GraphedModule already"):
        GraphedModule(gm)


def test_replicas_of_a_graphed_module_take_its_options():
    model = MLP().eval()
    reps = graphwrap.Replicas(GraphedModule(model, max_batch_size=8, outputs="view"), devices=["cpu"])
    assert reps.modules[0].buckets == (1, 2, 4, 8) and reps.modules[0]._gw_outputs == "view"
    x = torch.randn(3, 32)
    assert_same(reps(x), model(x).detach(), tol=0)
    reps.close()


@pytest.mark.parametrize("kwargs, words", [
    ({"seq_dim": 5}, "seq_dim=5, but no tensor input has a dimension 5"),
    ({"batch_dim": 7}, "batch_dim=7, but no tensor input has a dimension 7"),
])
def test_dims_no_input_has_are_refused_at_the_first_call(kwargs, words):
    gm = GraphedModule(MLP().eval(), **kwargs)
    with pytest.raises(GraphwrapError, match=words):
        gm(torch.randn(3, 32))


def test_replicas_after_close_say_so():
    from graphwrap import Replicas

    r = Replicas(MLP().eval())
    x = torch.randn(2, 32)
    assert r(x).shape == (2, 16)
    r.close()
    with pytest.raises(GraphwrapError, match="these Replicas are closed"):
        r(x)
