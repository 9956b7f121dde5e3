"""graphwrap's kernels launched with programmatic dependent launch (graphwrap/decoding/pdl.py) on
a GPU: a chain of the step's kernels, each reading what the last one wrote (the norm, the
projections and their sum, rotary, the pool's write, the paged attention and its join, the gated
MLP), captured in a CUDA graph and replayed, gives what the same chain gives eagerly without it,
to the bit; and the launch is on wherever the card and Triton have it."""

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("triton", reason="needs Triton (torch's CUDA wheels bring it)")

DEV = torch.device("cuda")


def test_the_launch_is_on_where_the_card_and_triton_have_it():
    from triton.language.extra import cuda

    from graphwrap.decoding import pdl

    want = hasattr(cuda, "gdc_wait") and torch.cuda.get_device_capability(DEV)[0] >= 9
    assert pdl.available(DEV) is want
    assert pdl.launch(DEV) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})


def _chain(x, w):
    """Four layers of the step's kernels, each reading the last one's output (64 rows, the 1.1B
    shape's widths, grouped heads): the result, and the pools written."""
    from graphwrap.decoding import mlp, norm, paged_attention, qkv, rope, step_write

    h = x
    for _ in range(4):
        n = norm.rms(h, w["norm"], 1e-5)
        q, k, v = qkv.project(n, w["qkv"], [None] * 3, split=2)  # (and the sum of the two parts)
        q = q.view(64, 1, 32, 64).transpose(1, 2)
        k = k.view(64, 1, 4, 64).transpose(1, 2)
        q, k = rope.rotate(q, k, w["cos"], w["sin"])
        step_write.write(w["keys"], w["values"], w["where"], w["offset"], k[:, :, -1], v.view(64, 4, 64))
        a = paged_attention.attend(q, w["keys"], w["values"], w["table"], w["lengths"], splits=4)  # (and the join)
        g = mlp.gate_up(a.reshape(64, 1, 2048), w["gate"], w["up"])
        h = h + g[..., :2048] + qkv.project(g, [w["down"]], [None])[0]
    return h, w["keys"].clone(), w["values"].clone()


def _weights():
    gen = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).half()

    pos = torch.arange(64, device="cuda") % 48 + 16
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    ang = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)[:, None]  # [64 rows, 1 position, 64]
    table = torch.randperm(520, generator=gen, device="cuda")[:512].view(64, 8).int()  # (no block shared)
    return {
        "norm": r(2048), "qkv": [r(2048, 2048, scale=0.02), r(256, 2048, scale=0.02), r(256, 2048, scale=0.02)],
        "cos": ang.cos().half(), "sin": ang.sin().half(),
        "keys": r(520, 16, 4, 64), "values": r(520, 16, 4, 64),
        "table": table, "lengths": (pos + 1).int(),
        "where": table.long()[torch.arange(64, device="cuda"), pos // 16], "offset": pos % 16,
        "gate": r(5632, 2048, scale=0.02), "up": r(5632, 2048, scale=0.02), "down": r(2048, 5632, scale=0.02),
    }


def test_a_graph_of_chained_kernels_with_it_gives_what_they_give_eagerly_without(monkeypatch):
    from graphwrap.decoding import pdl

    if not pdl.available(DEV):
        pytest.skip("needs a card of compute capability 9 or more and a Triton with programmatic dependent launch")
    x = torch.randn(64, 1, 2048, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda").half()
    monkeypatch.setattr(pdl, "ON", False)
    w = _weights()
    want = _chain(x, w)
    monkeypatch.setattr(pdl, "ON", True)
    w = _weights()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = _chain(x, w)  # (eagerly with it too: the warm-up)
    torch.cuda.current_stream().wait_stream(s)
    assert all(torch.equal(a, b) for a, b in zip(eager, want))
    w = _weights()
    keys0, values0 = w["keys"].clone(), w["values"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, w)
    for _ in range(3):
        w["keys"].copy_(keys0)
        w["values"].copy_(values0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out[0]).all()
        assert all(torch.equal(a, b) for a, b in zip(out, want)), "a kernel read before the last one's writes"
