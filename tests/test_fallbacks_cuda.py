"""What cannot be graphed, on a GPU: host syncs in the forward, models that mix rows, the module's own errors, fallback="raise"."""

import pytest
import torch
from helpers import (
    RowMixer,
    assert_same,
    eager_answer,
    gpu_mlp,
    num_graphs,
)
from torch import nn

from graphwrap import GraphedModule, GraphwrapError

pytestmark = pytest.mark.cuda
DEV = "cuda"


class ItemSync(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 1e9:  # a host sync: cannot be captured
            return x
        return self.lin(x)


def test_host_sync_falls_back_and_others_still_capture(gw_log):
    model = ItemSync().to(DEV).eval()
    gm = GraphedModule(model, buckets=[4])
    for n in (2, 3, 4):
        x = torch.randn(n, 8, device=DEV)
        assert_same(gm(x), eager_answer(model, x))
    k = gm.stats()["keys"][0]
    assert k["status"] == "eager" and "cannot be captured" in k["reason"]
    assert sum("capture of bucket" in r.message for r in gw_log.records) == 1
    assert not torch.cuda.is_current_stream_capturing()
    other = gpu_mlp()
    g2 = GraphedModule(other, buckets=[4])
    x = torch.randn(3, 32, device=DEV)
    assert_same(g2(x), eager_answer(other, x))
    assert num_graphs(g2) == 1


def test_host_sync_raises_under_fallback_raise():
    gm = GraphedModule(ItemSync().to(DEV).eval(), buckets=[4], fallback="raise")
    with pytest.raises(GraphwrapError, match=r"bucket 4 .*Tensor\[B, 8\]") as e:
        gm(torch.randn(2, 8, device=DEV))
    assert e.value.__cause__ is not None


@pytest.mark.parametrize("n", [2, 3, 4])
def test_verification_catches_row_mixing(n):
    model = RowMixer().to(DEV).eval()
    gm = GraphedModule(model, buckets=[4])
    x = torch.randn(n, 8, device=DEV)
    assert_same(gm(x), eager_answer(model, x))
    k = gm.stats()["keys"][0]
    assert k["status"] == "eager" and "mixes rows" in k["reason"]


def test_forward_error_on_real_rows_is_the_modules_own():
    model = gpu_mlp()
    gm = GraphedModule(model, buckets=[4])
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        gm(torch.randn(2, 31, device=DEV))
    x = torch.randn(2, 32, device=DEV)
    assert_same(gm(x), eager_answer(model, x))
