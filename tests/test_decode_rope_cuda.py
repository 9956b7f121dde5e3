"""Llama's rotary embedding in one kernel (graphwrap/decoding/kernels/rope.py, Triton) on a GPU: against
transformers' own function and a torch reference in fp32, over the layouts the batch hands it
(a decode step's transposed views, a piece's positions, grouped key heads, ``cos`` of one
sequence for many)."""

import pytest
import torch

pytestmark = pytest.mark.cuda
tr = pytest.importorskip("transformers", reason="needs transformers, which no extra installs: pip install transformers")
pytest.importorskip("triton", reason="needs Triton (torch's CUDA wheels bring it)")


def _cos_sin(b, s, d, dtype, generator):
    pos = torch.randint(0, 8000, (b, s), generator=generator, device="cuda")
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat((pos[..., None].float() * inv,) * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("b,hq,hk,s,d", [(64, 32, 4, 1, 64), (1, 32, 8, 128, 128), (8, 12, 12, 3, 80), (3, 8, 1, 5, 16), (4, 16, 8, 2, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_rotary_kernel_equals_transformers_function_to_rounding(b, hq, hk, s, d, dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from graphwrap.decoding.kernels import fused, rope

    own = getattr(apply_rotary_pos_emb, "_gw_own", apply_rotary_pos_emb)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, hq, d, generator=g, device="cuda").to(dtype).transpose(1, 2)  # as the model's views
    k = torch.randn(b, s, hk, d, generator=g, device="cuda").to(dtype).transpose(1, 2)
    cos, sin = _cos_sin(b, s, d, dtype, g)
    for c, n in ((cos, sin), (cos[:1], sin[:1])):  # each sequence's, one for all
        assert rope.applies(q, k, c, n)
        got = rope.rotate(q, k, c, n)
        want = rope.reference(q, k, c.expand(b, s, d), n.expand(b, s, d))
        theirs = own(q, k, c, n)
        for x, y, z, src in zip(got, want, theirs, (q, k)):
            assert x.shape == src.shape and x.stride() == src.stride() and x.dtype == dtype
            torch.testing.assert_close(x, y, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5
                                       if dtype == torch.float32 else 1e-2)
            torch.testing.assert_close(x, z, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5
                                       if dtype == torch.float32 else 2e-2)
    assert fused.fuses(q) is False, "outside the batch's block: transformers' own function"
