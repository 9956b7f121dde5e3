"""The module's weights and mode after capture, on a GPU: in-place loads, replaced or moved weights, train and eval, no parameters, cleared cuBLAS workspaces."""

import pytest
import torch
from helpers import (
    assert_same,
    eager_answer,
    gpu_mlp,
    num_graphs,
)
from torch import nn

from graphwrap import GraphedModule

pytestmark = pytest.mark.cuda
DEV = "cuda"


def test_load_state_dict_after_capture_changes_outputs():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4])
    x = torch.randn(3, 32, device=DEV)
    before = gm(x)
    gm.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    after = gm(x)
    assert not torch.allclose(before, after)
    assert_same(after, eager_answer(model, x))
    assert num_graphs(gm) == 1, "in-place loads keep the graphs"


def test_replaced_or_moved_weights_are_recaptured():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4])
    x = torch.randn(3, 32, device=DEV)
    gm(x)
    model.layers[0].weight = nn.Parameter(torch.randn_like(model.layers[0].weight))
    assert_same(gm(x), eager_answer(model, x))
    model.layers[2].weight.data = torch.randn_like(model.layers[2].weight)
    assert_same(gm(x), eager_answer(model, x))
    gm.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()}, assign=True)
    assert_same(gm(x), eager_answer(model, x))
    gm.half()
    assert_same(gm(x.half()), eager_answer(model, x.half()), tol=1e-2)
    model.float()  # on the raw module, behind the wrapper's back
    assert_same(gm(x), eager_answer(model, x))
    assert gm.stats()["eager_calls"] == {}


def test_train_then_eval_again():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.2)).to(DEV)
    gm = GraphedModule(model, buckets=[8])
    gm.eval()
    x = torch.randn(5, 8, device=DEV)
    assert_same(gm(x), eager_answer(model, x))
    gm.train()
    gm(torch.randn(8, 8, device=DEV))  # updates running stats in place
    gm.eval()
    assert_same(gm(x), eager_answer(model, x))


def test_module_without_parameters_and_empty_cache():
    class Act(nn.Module):
        def forward(self, x):
            return torch.nn.functional.gelu(x) * 2

    gm = GraphedModule(Act(), buckets=[4])
    for n in (1, 3, 4):
        x = torch.randn(n, 5, device=DEV)
        assert_same(gm(x), Act()(x))
        torch.cuda.empty_cache()
    cpu = torch.randn(2, 5)
    assert_same(gm(cpu), Act()(cpu))  # no tensors of its own: runs where the input is


def test_graphs_survive_cleared_cublas_workspaces():
    # torch.compile's CUDA graphs and many memory clean-ups clear cuBLAS workspaces; a graph
    # holding the address of a freed workspace would read or write reused memory.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        pytest.skip("this torch has no _cuda_clearCublasWorkspaces")
    model = nn.Sequential(nn.Linear(8192, 256), nn.ReLU(), nn.Linear(256, 8192)).to(DEV).eval()
    gm = GraphedModule(model, buckets=[1, 4, 8])
    xs = [torch.randn(n, 8192, device=DEV) for n in (1, 3, 8)]
    for x in xs:
        gm(x)
    clear()
    torch.cuda.empty_cache()
    filler = [torch.full((1 << 20,), float("nan"), device=DEV) for _ in range(64)]
    held = []
    for _ in range(3):
        for x in xs:
            got = gm(x)  # held: every call needs an owned-output slot of its own
            assert_same(got, eager_answer(model, x), tol=1e-4)
            held.append(got)
    torch.cuda.synchronize()
    # No graph (nor an owned-output graph) wrote into memory it does not own: a freed workspace
    # handed to the filler would have been written by a replay's matrix product.
    assert all(bool(torch.isnan(f).all()) for f in filler)
    del filler
