"""The shape of work of graphwrap's gated-MLP kernel by card (graphwrap/decoding/kernels/mlp.py): the
H100's row where the card's name holds it, else the rule tuned on an H200 (tiles of 64 outputs
where they still make a program for each SM, else of 16); a shape given by the caller kept.
The kernel itself runs on a GPU: tests/test_decode_products_cuda.py."""

import pytest
import torch

from graphwrap import _compat
from graphwrap.decoding.kernels import mlp

DEV = torch.device("cuda", 0)


@pytest.fixture
def card(monkeypatch):
    def named(name: str, sms: int = 132):
        monkeypatch.setattr(mlp, "_card", lambda device: name)
        monkeypatch.setattr(_compat, "multiprocessors", lambda device: sms)
    return named


def test_an_h100_takes_its_own_shape_of_work_for_every_width(card):
    card("NVIDIA H100 80GB HBM3")
    assert mlp.shape_of_work(5632, DEV) == (64, 128, 8)
    assert mlp.shape_of_work(14336, DEV) == (64, 128, 8)


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"])
def test_other_cards_take_tiles_by_their_outputs(card, name):
    card(name)
    assert mlp.shape_of_work(5632, DEV) == (16, 64, 4), "88 tiles of 64 would leave SMs idle"
    assert mlp.shape_of_work(14336, DEV) == (64, 64, 4), "224 tiles of 64: a program for each SM"
    card(name, sms=60)
    assert mlp.shape_of_work(5632, DEV) == (64, 64, 4), "88 tiles of 64 on 60 SMs"


def test_a_shape_of_work_given_is_kept(card, monkeypatch):
    """gate_up fills only what it is not given from the card's row (the tune gives them all)."""
    card("NVIDIA H100 80GB HBM3")
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, BM, BN, BK, num_warps, num_stages):
                seen.update(grid=grid, BM=BM, BN=BN, BK=BK, warps=num_warps)
            return launch

    import sys
    import types

    fake = types.ModuleType("graphwrap.decoding.kernels._mlp_triton")  # (the Triton kernel's module: a GPU's)
    fake.gate_up = Kernel()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "graphwrap.decoding.kernels._mlp_triton", fake)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)))
    x, w = torch.zeros(8, 1, 32), torch.zeros(96, 32)
    assert mlp.gate_up(x, w, w).shape == (8, 1, 96)
    assert (seen["BN"], seen["BK"], seen["warps"], seen["BM"]) == (64, 128, 8, 16)
    assert seen["grid"] == (2, 1), "96 outputs in tiles of 64, 8 rows in one tile"
    mlp.gate_up(x, w, w, bn=16, warps=4)
    assert (seen["BN"], seen["BK"], seen["warps"]) == (16, 128, 4)
