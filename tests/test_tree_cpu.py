import collections
import enum
import math

import pytest
import torch
from helpers import HFOut, KVCache, NeedsAName, Opaque, Out, assert_same

from graphwrap import GraphwrapError
from graphwrap.core.tree import (
    BATCHED,
    CONST,
    WHOLE,
    UnsupportedInput,
    classify_outputs,
    flatten_inputs,
    flatten_outputs,
    map_tensors,
    unflatten_inputs,
)

Point = collections.namedtuple("Point", "x y")


class Color(enum.Enum):
    RED = 1


def test_flatten_roundtrip_nested():
    x, y, z = torch.randn(2, 3), torch.randn(2), torch.randn(2, 1, 1)
    args = (x, [y, {"z": z, "k": 3}], Point(x, None))
    kwargs = {"flag": True, "name": "a", "dt": torch.float16, "c": Color.RED, "t": (z,)}
    leaves, spec = flatten_inputs(args, kwargs)
    assert [id(t) for t in leaves] == [id(x), id(y), id(z), id(x), id(z)]
    a2, k2 = unflatten_inputs(spec, leaves)
    assert_same(a2, args)
    assert_same(k2, kwargs)
    assert type(a2[2]) is Point
    hash(spec)


def test_key_separates_constants_and_types():
    x = torch.randn(1, 2)
    specs = [flatten_inputs((x, c), {})[1] for c in (1, 1.0, True, "1", None, 2)]
    assert len(set(specs)) == len(specs), "1, 1.0 and True hash alike but shape graphs differently"
    assert flatten_inputs((x,), {"a": 1})[1] != flatten_inputs((x,), {"b": 1})[1]
    assert flatten_inputs(((x, x),), {})[1] != flatten_inputs(([x, x],), {})[1]


def test_nan_constant_keeps_its_key():
    x = torch.randn(1, 2)
    assert flatten_inputs((x, float("nan")), {})[1] == flatten_inputs((x, float("nan")), {})[1]
    a, _ = unflatten_inputs(flatten_inputs((x, float("nan")), {})[1], [x])
    assert math.isnan(a[1])


def test_mutable_objects_are_not_keyed():
    class Cfg:
        pass

    with pytest.raises(UnsupportedInput, match=r"args\[1\]\['c'\] has type Cfg"):
        flatten_inputs((torch.zeros(1), {"c": Cfg()}), {})


def test_outputs_rebuild_with_their_types():
    t = torch.randn(2, 3)
    outs = [
        t,
        (t, [t, 3]),
        {"a": t, "b": (None, "s")},
        collections.OrderedDict(a=t),
        Point(t, 1.5),
        Out(logits=t, hidden=None, tag="q"),
        HFOut(last_hidden_state=t, pooler_output=t * 2),
        collections.defaultdict(list, a=t),  # its constructor takes a factory, not a dict
        collections.deque([t, 1]),
        torch.max(t, dim=1),  # a torch.return_types structseq
        torch.Size([2, 3]),  # registered with pytree, but rebuilt a tuple there: kept whole
    ]
    for o in outs:
        leaves, spec = flatten_outputs(o)
        back = spec.rebuild(leaves)
        assert_same(back, o)
        assert type(back) is type(o)
    hf = flatten_outputs(outs[6])[1].rebuild(flatten_outputs(outs[6])[0])
    assert list(hf.keys()) == ["last_hidden_state", "pooler_output"] and hf.attentions is None


def test_output_paths_name_leaves():
    _, spec = flatten_outputs((torch.zeros(1), {"k": Out(torch.zeros(1))}))
    assert spec.describe(0) == "out[0]"
    assert spec.describe(1) == "out[1]['k'].logits"


def test_classify_outputs():
    n_a, n_b = 4, 3
    a = [torch.zeros(n_a, 5), torch.ones(7), 3, torch.zeros(2, n_a)]
    b = [torch.zeros(n_b, 5), torch.ones(7), 3, torch.zeros(2, n_b)]
    _, spec = flatten_outputs(tuple(a))
    kinds, seq_dims, problems = classify_outputs(a, n_a, b, n_b, 0, spec)
    assert kinds[:3] == [BATCHED, WHOLE, CONST] and seq_dims == [(), (), (), ()]
    assert list(problems) == [3] and "not along batch_dim=0" in problems[3]
    kinds, _, problems = classify_outputs([n_a], n_a, [n_b], n_b, 0, flatten_outputs((1,))[1])
    assert problems and "depends on the batch" in problems[0]


def test_classify_outputs_finds_the_sequence_dims():
    # at (4 rows, length 16) and (3 rows, length 10): [n, L, 8], [n, h, L, L], [n, 8], [L, 8] and [n, L + 1]
    shapes = lambda n, L: [(n, L, 8), (n, 2, L, L), (n, 8), (L, 8), (n, L + 1)]  # noqa: E731
    a = [torch.zeros(s) for s in shapes(4, 16)]
    b = [torch.zeros(s) for s in shapes(3, 10)]
    spec = flatten_outputs(tuple(a))[1]
    kinds, seq_dims, problems = classify_outputs(a, 4, b, 3, 0, spec, 16, 10)
    assert kinds[:4] == [BATCHED, BATCHED, BATCHED, WHOLE]
    assert seq_dims[:4] == [(1,), (2, 3), (), (0,)]
    assert list(problems) == [4] and "or the sequence" in problems[4]


def test_map_tensors_keeps_structure():
    t = torch.ones(2)
    o = {"a": [t, (t, 3)], "p": Point(t, "s"), "d": Out(logits=t)}
    m = map_tensors(lambda x: x * 2, o)
    assert_same(m, {"a": [t * 2, (t * 2, 3)], "p": Point(t * 2, "s"), "d": Out(logits=t * 2)})


def test_registered_types_are_looked_into():
    # A cache object registered with torch.utils._pytree: its tensors are output leaves, and it
    # comes back as its own type, rebuilt around the tensors given.
    n = 4
    cache = KVCache([torch.randn(n, 3), torch.randn(n, 3)], [torch.randn(n, 1), torch.randn(n, 1)])
    out = (torch.randn(n, 5), cache)
    leaves, spec = flatten_outputs(out)
    assert len(leaves) == 5 and all(isinstance(x, torch.Tensor) for x in leaves)
    assert "KVCache" in spec.describe(3)
    doubled = spec.rebuild([x * 2 for x in leaves])
    assert type(doubled[1]) is KVCache and doubled[1] is not cache
    assert_same(doubled, (out[0] * 2, KVCache([k * 2 for k in cache.keys], [v * 2 for v in cache.values])))
    assert_same(map_tensors(lambda x: x * 2, out), doubled)
    # The same structure at another batch size has an equal spec, and its tensors are batched.
    other = (torch.randn(n - 1, 5), KVCache([torch.randn(n - 1, 3)] * 2, [torch.randn(n - 1, 1)] * 2))
    leaves_b, spec_b = flatten_outputs(other)
    assert spec_b == spec and hash(spec_b) == hash(spec)
    kinds, _, problems = classify_outputs(leaves, n, leaves_b, n - 1, 0, spec)
    assert kinds == [BATCHED] * 5 and not problems
    # A cache with another number of layers is another structure.
    assert flatten_outputs((out[0], KVCache(cache.keys[:1], cache.values[:1])))[1] != spec


def test_unregistered_objects_get_a_short_message_with_the_way_out():
    a, b = Opaque(torch.zeros(4)), Opaque(torch.zeros(3))
    _, spec = flatten_outputs((a,))
    kinds, _, problems = classify_outputs([a], 4, [b], 3, 0, spec)
    assert kinds == [CONST]
    msg = problems[0]
    assert "Opaque" in msg and "register_pytree_node" in msg and len(msg) < 500, msg


def test_a_dynamic_cache_gets_the_transformers_way_out():
    DynamicCache = type("DynamicCache", (), {})  # stands in for transformers' class, by name
    _, spec = flatten_outputs((DynamicCache(),))
    _, _, problems = classify_outputs([DynamicCache()], 4, [DynamicCache()], 3, 0, spec)
    assert "register_dynamic_cache_export_support()" in problems[0] and "use_cache=False" in problems[0]


def test_map_tensors_gives_back_what_it_cannot_change_and_refuses_what_it_cannot_rebuild():
    t = torch.ones(2)
    o = (t, {"k": [t]})
    assert map_tensors(lambda x: x, o) is o
    with pytest.raises(GraphwrapError, match=r"the object\[0\]\['h'\] is not there once the object is rebuilt"):
        map_tensors(lambda x: x * 2, (NeedsAName("n", {"h": t}),))
    d = map_tensors(lambda x: x * 2, collections.defaultdict(list, h=t))
    assert type(d) is collections.defaultdict and d.default_factory is list and d["h"].tolist() == [2.0, 2.0]


def test_dict_inputs_of_other_types():
    t = torch.ones(2, 3)

    class Plain(dict):
        pass

    for d in (collections.defaultdict(list, a=t), collections.OrderedDict(a=t), Plain(a=t)):
        leaves, spec = flatten_inputs((d,), {"kw": d})
        args, kwargs = unflatten_inputs(spec, leaves)
        for back in (args[0], kwargs["kw"]):
            assert type(back) is type(d) and list(back) == ["a"] and back["a"] is t
            if isinstance(d, collections.defaultdict):
                assert back.default_factory is list
    # A dict type whose constructor does not take its items cannot be passed through a graph.
    with pytest.raises(UnsupportedInput, match="NeedsAName, a dict type that NeedsAName"):
        flatten_inputs((NeedsAName("n", {"a": t}),), {})
