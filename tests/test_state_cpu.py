"""State besides the inputs, on the CPU stand-in for graphs: calls under inference_mode, the module
changed after capture (submodules, hooks, training flags, the default dtype), and a forward that
writes its own buffers. Each "replay" of the stand-in runs the forward again, as a graph replay
runs its kernels again, so every count of writes below is what a GPU would do."""

import logging

import pytest
import torch
from helpers import (
    MLP,
    Counter,
    RowCache,
    TensorCache,
    assert_same,
    eager_answer,
    on_cpu_graphs,
    replays,
)
from torch import nn

from graphwrap import Batcher, GraphedModule, GraphwrapError


def _gm(model, **kw):
    kw.setdefault("eager_if_faster", False)  # the stand-in's replays are slow: keep the graphs
    return on_cpu_graphs(GraphedModule(model, **kw))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.act(self.fc(x))) * 2 + torch.ones(1)


def test_calls_under_inference_mode_capture_and_replay_and_later_calls_outside_it_too():
    model = MLP().eval()
    gm = _gm(model)
    with torch.inference_mode():
        for n in (3, 5, 17, 3):
            x = torch.randn(n, 32)
            out = gm(x)
            assert_same(out, model(x))
    x = torch.randn(3, 32)
    assert_same(gm(x), eager_answer(model, x)), "the static inputs made under inference_mode take writes outside it"
    assert gm.stats()["eager_calls"] == {} and replays(gm) == 5
    with torch.inference_mode():
        b = Batcher(gm)
        try:
            xs = [torch.randn(2, 32) for _ in range(4)]
            for x, fut in zip(xs, [b.submit(x) for x in xs]):
                assert_same(fut.result(), model(x))
        finally:
            b.close()


def test_a_forward_that_writes_its_input_is_still_found_under_inference_mode():
    from helpers import Scales

    model = Scales().eval()
    gm = _gm(model)
    with torch.inference_mode():
        x = torch.full((3, 4), 255.0)
        out = gm(x)
        assert torch.equal(x, torch.ones(3, 4)), "the caller's tensor as eager leaves it"
        assert_same(out, model.lin(torch.ones(3, 4)))
    assert any("writes into its input" in r for r in gm.stats()["eager_calls"]) or \
        any("writes into its input" in (k["failed"] or "") for k in gm.stats()["keys"])


@pytest.mark.parametrize("change", ["swap a submodule without weights", "add a forward hook",
                                    "add a forward pre-hook on the top module", "remove a hook present at capture",
                                    "a global forward hook", "a submodule put in training mode",
                                    "a new default dtype"])
def test_each_change_to_the_module_after_capture_is_seen_before_the_next_replay(change, gw_log):
    model = Net().eval()
    handle = model.fc.register_forward_hook(lambda m, i, o: o + 1) if "remove" in change else None
    gm = _gm(model)
    x = torch.randn(3, 8)
    assert_same(gm(x), eager_answer(model, x))
    assert replays(gm) == 1
    undo = lambda: None  # noqa: E731
    if change == "swap a submodule without weights":
        model.act = nn.Tanh().eval()
        why = "submodule 'act' was replaced"
    elif change == "add a forward hook":
        model.act.register_forward_hook(lambda m, i, o: o * 3)
        why = "a forward hook was added to or removed from submodule 'act'"
    elif change == "add a forward pre-hook on the top module":
        model.register_forward_pre_hook(lambda m, args: (args[0] * -1,))
        why = "a forward hook was added to or removed from the module"
    elif change == "remove a hook present at capture":
        handle.remove()
        why = "a forward hook was added to or removed from submodule 'fc'"
    elif change == "a global forward hook":
        h = nn.modules.module.register_module_forward_hook(
            lambda m, i, o: o * 2 if isinstance(m, nn.ReLU) else None)
        undo = h.remove
        why = None  # runs eagerly while it is registered; the graphs stay
    elif change == "a submodule put in training mode":
        model.drop.train()
        why = "submodule 'drop' was put in training mode"
    else:
        torch.set_default_dtype(torch.float64)
        undo = lambda: torch.set_default_dtype(torch.float32)  # noqa: E731
        why = "the default dtype changed from torch.float32 to torch.float64"
    try:
        torch.manual_seed(1)
        got = gm(x)
        torch.manual_seed(1)
        want = eager_answer(model, x)
        assert_same(got, want)
        if why is None:
            from graphwrap.core.reasons import GLOBAL_HOOKS

            assert gm.stats()["module_changes"] == {} and gm.stats()["eager_calls"] == {GLOBAL_HOOKS.reason: 1}
            undo()
            undo = lambda: None  # noqa: E731
            assert_same(gm(x), eager_answer(model, x))
            assert replays(gm) == 2, "the graphs served again once the hook was gone"
            return
        assert gm.stats()["module_changes"] == {why: 1}
        assert any(why in r.getMessage() for r in gw_log.records)
        if change == "a submodule put in training mode":
            assert gm.stats()["eager_calls"] == {"submodule 'drop' is in training mode (call .eval() on it for graphs)": 1}
            model.drop.eval()
        before = replays(gm)
        for _ in range(3):  # captured again: served by graphs from here on
            x = torch.randn(3, 8, dtype=torch.float32)
            assert_same(gm(x), eager_answer(model, x))
        assert replays(gm) == before + 3
    finally:
        undo()


def test_changes_undone_before_the_next_call_keep_the_graphs():
    model = Net().eval()
    gm = _gm(model)
    x = torch.randn(3, 8)
    gm(x)
    epoch = gm.engine.epoch
    model.drop.train()
    model.drop.eval()
    model.fc.register_forward_hook(lambda m, i, o: None).remove()
    assert_same(gm(x), eager_answer(model, x))
    assert gm.engine.epoch == epoch and gm.stats()["module_changes"] == {}


def test_hooks_present_at_capture_are_captured_with_a_warning(gw_log):
    model = Net().eval()
    model.fc.register_forward_hook(lambda m, i, o: o * 2)
    gm = _gm(model)
    x = torch.randn(3, 8)
    assert_same(gm(x), eager_answer(model, x))
    assert any("forward hooks of submodule 'fc' are captured" in r.getMessage() and r.levelno == logging.WARNING
               for r in gw_log.records)


def test_a_plain_attribute_the_forward_reads_needs_no_reset():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.scale_output = True

        def forward(self, x):
            y = self.fc(x)
            return y * 10 if self.scale_output else y

    model = Scaled().eval()
    gm = _gm(model)
    x = torch.randn(2, 4)
    gm(x)
    model.scale_output = False  # seen: captured again (it needed gm.reset() before)
    assert_same(gm(x), eager_answer(model, x))
    assert list(gm.stats()["module_changes"]) == ["attribute 'scale_output' of the module changed from True to False"]


def test_a_training_flag_assigned_directly_on_a_submodule_is_seen():
    model = Net().eval()
    gm = _gm(model)
    x = torch.randn(3, 8)
    gm(x)
    model.drop.training = True  # not through train(): the assignment itself is counted
    gm(x)
    assert gm.stats()["eager_calls"] == {"submodule 'drop' is in training mode (call .eval() on it for graphs)": 1}


def test_a_forward_that_counts_its_calls_counts_each_call_once(gw_log):
    model, ref = Counter().eval(), Counter().eval()
    ref.load_state_dict(model.state_dict())
    gm = _gm(model)
    for i in range(6):
        x = torch.randn(3, 4)
        assert_same(gm(x), eager_answer(ref, x))
    assert int(model.steps) == 6 == int(ref.steps)
    stats = gm.stats()
    assert stats["writes_buffers"] == ["steps"] and replays(gm) >= 5
    assert all(b["batch"] == 3 for k in stats["keys"] for b in k["buckets"].values() if b["graphs"]), \
        "a module that writes its state is never padded"
    assert any("writes the module's buffers steps" in r.getMessage() for r in gw_log.records)


def test_state_kept_per_row_matches_eager_over_calls_of_several_sizes():
    model, ref = RowCache().eval(), RowCache().eval()
    ref.load_state_dict(model.state_dict())
    gm = _gm(model)
    for n in (3, 3, 5, 3, 5, 8, 2):
        x = torch.randn(n, 4)
        assert_same(gm(x), eager_answer(ref, x))
        assert torch.equal(model.last, ref.last), f"the cache after a call of {n} rows"
    b = Batcher(gm)
    try:
        xs = [torch.randn(2, 4) for _ in range(3)]
        for x in xs:  # one by one, never joined: each a call of its own
            assert_same(b(x), eager_answer(ref, x))
        assert torch.equal(model.last, ref.last)
    finally:
        b.close()


def test_a_forward_that_writes_its_parameters_runs_eagerly():
    class Drifts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4), requires_grad=False)

        def forward(self, x):
            self.w.add_(1)
            return x * self.w

    model = Drifts().eval()
    gm = _gm(model)
    x = torch.randn(2, 4)
    out = gm(x)
    assert gm.stats()["keys"][0]["reason"].startswith("the forward writes into its parameters w")
    assert torch.equal(out, x * 3), "the capture's first run and the eager call: two writes, no more"
    assert torch.equal(model.w, torch.full((4,), 3.0))


def test_inputs_declared_as_state_are_written_where_they_live():
    """state=["cache"]: the caller's tensor is the graph's, written in place as eagerly; keyed on
    its memory (a fresh view of it is the same state, another tensor another key)."""
    torch.manual_seed(0)
    model = TensorCache().eval()
    gm = on_cpu_graphs(GraphedModule(model, state=["cache"], batch_dim={"pos": None}, eager_if_faster=False))
    mine, ref = torch.zeros(2, 16, 8), torch.zeros(2, 16, 8)
    with torch.no_grad():
        for p in range(10):
            x, pos = torch.randn(2, 1, 8), torch.tensor([p])
            got = gm(x, mine if p % 2 else mine[:], pos)  # a fresh view every other call
            assert_same(got, model(x, ref, pos))
            assert torch.equal(mine, ref), p
        other = torch.zeros(2, 16, 8)
        gm(torch.randn(2, 1, 8), other, torch.tensor([0]))
    keys = gm.stats()["keys"]
    assert len(keys) == 2 and "Tensor@" in keys[0]["key"] and replays(gm) >= 8
    assert other[:, 0].abs().sum() > 0 and other[:, 1:].abs().sum() == 0, "the other tensor written, once"


def test_without_state_a_forward_that_writes_its_input_runs_eagerly_on_the_callers():
    torch.manual_seed(0)
    model = TensorCache().eval()
    gm = on_cpu_graphs(GraphedModule(model, batch_dim={"pos": None}, eager_if_faster=False))
    mine, ref = torch.zeros(2, 16, 8), torch.zeros(2, 16, 8)
    with torch.no_grad():
        for p in range(4):
            x, pos = torch.randn(2, 1, 8), torch.tensor([p])
            assert_same(gm(x, mine, pos), model(x, ref, pos))
    assert torch.equal(mine, ref) and replays(gm) == 0


@pytest.mark.parametrize("bad", [5.5, [], [None], True])
def test_state_option_is_checked(bad):
    with pytest.raises(GraphwrapError, match="state must be an input name or position"):
        GraphedModule(TensorCache(), state=bad)


class Scale(nn.Module):
    def forward(self, x, scale):
        return x * scale


def test_a_state_input_without_tensors_runs_eagerly_with_the_reason():
    gm = on_cpu_graphs(GraphedModule(Scale().eval(), state=["scale"], eager_if_faster=False))
    x = torch.randn(2, 3)
    with torch.no_grad():
        assert torch.equal(gm(x, 2.0), x * 2.0)
    (reason,) = gm.stats()["eager_calls"]
    assert "named in state= but holds no tensor" in reason


def test_state_inputs_under_inference_mode_and_after_the_weights_change():
    """A cache tensor made under inference_mode cannot be written by a capture: eager, with the
    reason; one made outside it is graphed in calls under inference_mode, and new weights are
    seen at the next call."""
    torch.manual_seed(0)
    model = TensorCache().eval()
    gm = on_cpu_graphs(GraphedModule(model, state=["cache"], batch_dim={"pos": None}, eager_if_faster=False))
    with torch.inference_mode():
        made_inside = torch.zeros(2, 16, 8)
        gm(torch.randn(2, 1, 8), made_inside, torch.tensor([0]))
    (reason,) = gm.stats()["eager_calls"]
    assert "inference_mode" in reason
    mine, ref = torch.zeros(2, 16, 8), torch.zeros(2, 16, 8)
    for p in range(6):
        if p == 3:
            with torch.no_grad():
                model.kv.weight.mul_(2.0)
        x, pos = torch.randn(2, 1, 8), torch.tensor([p])
        with torch.inference_mode():
            got = gm(x, mine, pos)
            want = model(x, ref, pos)
        assert_same(got, want)
        assert torch.equal(mine, ref), p
    assert replays(gm) >= 3


class _FlagLayer:
    def __init__(self):
        self.keys = torch.zeros(2, 4)
        self.has_previous_state = {0: False}  # a dict of host flags, as transformers' linear-attention layers keep


class _FlagCache:
    is_compileable = True

    def __init__(self):
        self.layers = [_FlagLayer()]


class FirstWriteThenAdd(nn.Module):
    """Its first call writes the state, later ones add to it: which, a flag in a dict decides."""

    def forward(self, x, cache):
        layer = cache.layers[0]
        if not layer.has_previous_state[0]:
            layer.keys.copy_(x)
            layer.has_previous_state[0] = True
        else:
            layer.keys.add_(x)
        return layer.keys * 1


def test_a_state_flag_kept_in_a_dict_is_watched_like_a_number():
    """A graph would replay the branch its capture took: the flag the first call flips sits in a
    dict (not an attribute), and is watched the same way: those calls run eagerly, with the
    reason, and every call gives eager's answer."""
    gm = _gm(FirstWriteThenAdd().eval())
    mine, ref = _FlagCache(), _FlagCache()
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(gm(x, mine), FirstWriteThenAdd()(x, ref))
            assert torch.equal(mine.layers[0].keys, ref.layers[0].keys)
    reasons = list(gm.stats()["eager_calls"])
    assert any("has_previous_state[0]" in r for r in reasons), reasons


def test_graphwrap_leaves_torch_compile_of_other_modules_alone():
    """graphwrap counts module registrations process-wide (a submodule added to a watched
    module is a change). A forward that makes temporary module lists (diffusers' UNet slices
    its ModuleLists) registers modules on every call: counted while torch.compile traced it,
    the count went into dynamo's guards and every call recompiled (then ran eagerly at the
    recompile limit) in any process where a GraphedModule had been made."""

    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[1:]:  # a new ModuleList on every call
                x = layer(x)
            return x

    GraphedModule(nn.Linear(2, 2))  # graphwrap's process-wide hooks are in place from here
    frames = []

    def backend(graph, inputs):
        frames.append(graph)
        return graph.forward

    net = Sliced().eval()
    compiled = torch.compile(net, backend=backend)
    x = torch.randn(4, 8)
    for _ in range(5):
        out = compiled(x)
    assert len(frames) == 1 and torch.equal(out, net(x))


class Sliced(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:  # a new ModuleList on every call, as transformers' Llama makes
            x = layer(x)
        return x


@pytest.mark.parametrize("change", ["a submodule", "a parameter", "a buffer", "a submodule of one added later"])
def test_only_registrations_on_the_watched_tree_make_the_engine_read_it_again(change, gw_log):
    """An eager forward that slices its layers registers each one on a new ModuleList: no tree
    an engine watches changed, so the counter stays and no engine reads its tree again (each
    did, about 3 ms for a 32-layer Llama, on the call after any registration in the process),
    whether the eager forwards run in this thread or beside the wrapper's calls in another, under
    no_grad or inference_mode. A registration anywhere in the watched tree moves it, and the
    next call sees the change."""
    import threading

    from graphwrap.process import GENERATION

    model = Sliced().eval()
    gm = _gm(model)
    x = torch.randn(4, 8)
    assert_same(gm(x), model(x))
    before = GENERATION[0]
    with torch.no_grad():
        for _ in range(3):
            model(x)
        nn.Sequential(nn.Linear(2, 2)).add_module("x", nn.ReLU())  # a module no engine watches

    def eager_beside():
        with torch.inference_mode():
            for _ in range(50):
                model(x)

    other = threading.Thread(target=eager_beside)
    other.start()
    with torch.inference_mode():
        for _ in range(20):
            assert_same(gm(x), model(x))
    other.join()
    assert GENERATION[0] == before, "registrations outside the watched tree moved the counter"
    assert_same(gm(x), model(x))
    assert gm.stats()["module_changes"] == {}
    deep = model.layers[1]
    if change == "a submodule of one added later":
        deep.extra = nn.Sequential()
        assert_same(gm(x), model(x))  # the tree read again: its new module is followed from here
        before, deep = GENERATION[0], deep.extra
    if change == "a parameter":
        deep.register_parameter("scale", nn.Parameter(torch.ones(1)))
    elif change == "a buffer":
        deep.register_buffer("seen", torch.zeros(1))
    else:
        deep.add_module("more", nn.Identity())
    assert GENERATION[0] > before, f"{change} added in the watched tree moved no counter"
    assert_same(gm(x), model(x))
    assert sum(gm.stats()["module_changes"].values()) >= 1, gm.stats()["module_changes"]


def test_a_bucket_captured_again_runs_its_reference_without_the_read_recorder():
    """The reads a forward makes are recorded around a capture's reference run by wrapping
    nn.Module.__getattribute__, which a torch.compile tracing meanwhile on another thread meets
    (it then runs that code eagerly). A bucket captured again at its own shape (the per-size
    tuner's kernels, compiled graphs in place of plain ones) had its reads recorded by its first
    capture: its reference runs without the wrapper."""
    from graphwrap.capture.work import capture_into
    from graphwrap.core.records import Bucket

    class Seen(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.wrapped = []

        def forward(self, x):
            self.wrapped.append("__getattribute__" in nn.Module.__dict__)
            return self.lin(x)

    class Forward:  # what the tuner hands a capture: kernels compiled for the bucket's size
        graphs, dynamic, ahead = 0, False, None

        def __init__(self, module):
            self.module, self.shapes = module, set()

        def mark(self, leaves, roles):
            pass

        def __call__(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    m = Seen().eval()
    gm = on_cpu_graphs(GraphedModule(m, eager_if_faster=False))
    x = torch.randn(2, 4)
    with torch.no_grad():
        gm(x)
    assert m.wrapped[0] is True and not any(m.wrapped[1:]), "the first capture's reference run, and only it"
    engine = gm.engine
    key = next(iter(engine.store.keys.values()))
    old = next(iter(key.buckets.values()))
    m.wrapped.clear()
    assert capture_into(engine, key, Bucket(old.size, old.seq), [x.clone()], old.size, old.seq, forward=Forward(m),
                        timed=False) is not None
    assert m.wrapped and not any(m.wrapped)
    assert "__getattribute__" not in nn.Module.__dict__


def test_reads_recorded_from_two_threads_at_once_leave_nn_module_as_it_was():
    """Each recording wraps nn.Module.__getattribute__ for its run and puts back what it found.
    Two at once (captures on the CPU stand-in take no capture lock of their own) once left the
    first one's wrapper on nn.Module for good: every later forward paid for it, and torch.compile
    ran models eagerly. They now take turns."""
    import threading

    from graphwrap.core.watch import reads_recorded

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()

    def first():
        with reads_recorded():
            first_in.set()
            second_in.wait(0.5)  # the second cannot come in while this one records
        first_out.set()

    def second():
        first_in.wait(5)
        with reads_recorded():
            second_in.set()
            first_out.wait(5)  # and it ends after the first

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert second_in.is_set() and "__getattribute__" not in nn.Module.__dict__
