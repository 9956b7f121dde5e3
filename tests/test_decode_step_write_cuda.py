"""A decode step's keys and values written into the paged pool in one kernel a layer
(graphwrap/decoding/kernels/step_write.py, Triton) on a GPU: the same pools as indexed assignment, over
the layouts a step hands it (views of transposed projections, grouped key heads, 80-wide heads,
rows sharing a block); and where it does not apply."""

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("triton", reason="needs Triton (torch's CUDA wheels bring it)")


@pytest.mark.parametrize("n,h,d", [(64, 4, 64), (1, 8, 128), (7, 3, 80), (33, 1, 16), (5, 16, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_step_write_equals_indexed_assignment(n, h, d, dtype):
    from graphwrap.decoding.kernels import step_write

    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(40, 16, h, d, generator=g, device="cuda").to(dtype)
    values = torch.randn(40, 16, h, d, generator=g, device="cuda").to(dtype)
    # as a step's layers hand them: [n, 1, h, d] projections seen as [n, h, 1, d], position -1
    k = torch.randn(n, 1, h, d, generator=g, device="cuda").to(dtype).transpose(1, 2)[:, :, -1]
    v = torch.randn(n, 1, h, d, generator=g, device="cuda").to(dtype).transpose(1, 2)[:, :, -1]
    slot = torch.randperm(40 * 16, generator=g, device="cuda")[:n]  # distinct slots, some in one block
    where, offset = slot // 16, slot % 16
    want_k, want_v = keys.clone(), values.clone()
    step_write.reference(want_k, want_v, where, offset, k, v)
    assert step_write.applies(keys, values, k, v)
    step_write.write(keys, values, where, offset, k, v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_where_the_step_write_does_not_apply_the_assignment_runs():
    from graphwrap.decoding.kernels import step_write

    keys = torch.zeros(4, 16, 2, 64, device="cuda", dtype=torch.float16)
    k = torch.zeros(3, 2, 64, device="cuda", dtype=torch.float16)
    assert step_write.applies(keys, keys.clone(), k, k.clone())
    assert not step_write.applies(keys, keys.clone(), k.float(), k.float()), "another dtype than the pool's"
    assert not step_write.applies(keys, keys.clone(), k.cpu(), k.cpu()), "not on the GPU"
    assert not step_write.applies(keys, keys.clone(), k[..., ::2], k[..., ::2]), "another width, strided"
    assert not step_write.applies(keys, keys.transpose(0, 1), k, k), "pools laid out apart"
