"""Plain attributes and config fields assigned after capture are seen before the next replay.

The stand-in for CUDA graphs recomputes on replay, so these tests check what the engine decides
(a change seen, the graphs captured again, its log line and ``stats()["module_changes"]``); the
GPU test beside the state tests checks that the answers follow."""

import pytest
import torch
from helpers import assert_same, eager_answer, on_cpu_graphs, replays
from torch import nn

from graphwrap import GraphedModule


class Inner:
    def __init__(self):
        self.k = 1


class Config:
    """A config-like plain object the model holds (as a Hugging Face model holds ``config``)."""

    def __init__(self):
        self.double = False
        self.inner = Inner()


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale_output = True
        self.config = Config()

    def forward(self, x):
        y = self.fc(x)
        if self.scale_output:
            y = y * 2
        if self.config.double:
            y = y * 3
        return y * self.config.inner.k + getattr(self.fc, "offset", 0)


class Counts(nn.Module):
    """A forward that keeps a counter and a cache in Python attributes of its own."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0
        self.last = None

    def forward(self, x):
        self.calls = self.calls + 1
        y = self.fc(x)
        self.last = y.detach()
        return y


def _gm(model):
    return on_cpu_graphs(GraphedModule(model, eager_if_faster=False))


def _change_seen(model, gm, change, why, gw_log):
    x = torch.randn(3, 8)
    assert_same(gm(x), eager_answer(model, x))
    epoch = gm.engine.epoch
    change()
    assert_same(gm(x), eager_answer(model, x))
    assert gm.stats()["module_changes"] == {why: 1}
    assert gm.engine.epoch != epoch, "the graphs were dropped"
    assert any(why in r.getMessage() for r in gw_log.records)
    before = replays(gm)
    for _ in range(3):  # captured again: graphs serve from here on, with no further change seen
        y = torch.randn(3, 8)
        assert_same(gm(y), eager_answer(model, y))
    assert replays(gm) == before + 3
    assert gm.stats()["module_changes"] == {why: 1}


def test_a_plain_attribute_of_the_module(gw_log):
    model = Scaled().eval()
    _change_seen(model, _gm(model), lambda: setattr(model, "scale_output", False),
                 "attribute 'scale_output' of the module changed from True to False", gw_log)


def test_an_attribute_added_to_a_submodule(gw_log):
    model = Scaled().eval()
    _change_seen(model, _gm(model), lambda: setattr(model.fc, "offset", 1),
                 "attribute 'offset' of submodule 'fc' was added", gw_log)


def test_a_field_of_a_config_the_model_holds(gw_log):
    model = Scaled().eval()
    _change_seen(model, _gm(model), lambda: setattr(model.config, "double", True),
                 "attribute 'double' of the module.config changed from False to True", gw_log)


def test_a_field_of_an_object_the_config_holds(gw_log):
    model = Scaled().eval()
    _change_seen(model, _gm(model), lambda: setattr(model.config.inner, "k", 5),
                 "attribute 'k' of the module.config.inner changed from 1 to 5", gw_log)


def test_a_change_undone_before_the_next_call_keeps_the_graphs():
    model = Scaled().eval()
    gm = _gm(model)
    x = torch.randn(3, 8)
    gm(x)
    epoch = gm.engine.epoch
    model.scale_output = False
    model.scale_output = True
    model.config.double = False  # assigned its own value
    assert_same(gm(x), eager_answer(model, x))
    assert gm.engine.epoch == epoch and gm.stats()["module_changes"] == {}


def test_attributes_the_forward_assigns_itself_do_not_capture_again():
    model = Counts().eval()
    gm = _gm(model)
    x = torch.randn(3, 8)
    gm(x)
    epoch = gm.engine.epoch
    for _ in range(5):
        assert_same(gm(x), eager_answer(model, x))  # the eager answer assigns them outside graphwrap too
    assert gm.engine.epoch == epoch and gm.stats()["module_changes"] == {}
    assert replays(gm) == 6  # the first call's, and these


def test_attributes_the_forward_does_not_read_are_not_watched():
    """Bookkeeping a library keeps on the model between calls (transformers' generate sets
    ``_previous_max_cache_length``, say) changes nothing a graph replays."""
    model = Scaled().eval()
    gm = _gm(model)
    x = torch.randn(3, 8)
    gm(x)
    epoch = gm.engine.epoch
    model._previous_max_cache_length = 64
    model.config.unread = "x"
    assert_same(gm(x), eager_answer(model, x))
    assert gm.engine.epoch == epoch and gm.stats()["module_changes"] == {}
    model.scale_output = False  # what it reads still is
    assert_same(gm(x), eager_answer(model, x))
    assert len(gm.stats()["module_changes"]) == 1


def test_objects_of_builtin_types_are_left_alone():
    model = Scaled().eval()
    model.opts = {"scale": 1}
    gm = _gm(model)
    x = torch.randn(3, 8)
    gm(x)
    model.opts["scale"] = 2  # changed in place: not seen (the contract says so)
    gm(x)
    assert gm.stats()["module_changes"] == {}


def test_a_hugging_face_config_flag():
    tr = pytest.importorskip("transformers")
    cfg = tr.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, pad_token_id=0)
    model = tr.GPT2Model(cfg).eval()
    gm = _gm(model)
    ids = torch.randint(1, 50, (2, 6))
    assert_same(gm(input_ids=ids).last_hidden_state, eager_answer(model, input_ids=ids).last_hidden_state)
    model.config.output_hidden_states = True
    got, want = gm(input_ids=ids), eager_answer(model, input_ids=ids)
    assert got.hidden_states is not None and len(got.hidden_states) == len(want.hidden_states)
    assert [why for why in gm.stats()["module_changes"]] == [
        "attribute 'output_hidden_states' of the module.config changed from False to True"]


def test_a_change_is_seen_under_inference_mode(gw_log):
    model = Scaled().eval()
    with torch.inference_mode():
        _change_seen(model, _gm(model), lambda: setattr(model, "scale_output", False),
                     "attribute 'scale_output' of the module changed from True to False", gw_log)
