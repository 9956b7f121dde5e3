"""Llama-form RMSNorms fused inside the shared batch's forwards (graphwrap/decoding/norms.py):
which classes are taken, the class's own forward everywhere but inside the block on that
thread, and the fused form equal to the own one to rounding (the fused kernel's condition is
widened to the CPU here; on a GPU it is torch's aten::_fused_rms_norm). Needs transformers."""

import threading

import pytest
import torch

from graphwrap.decoding import norms

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralRMSNorm  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402


@pytest.fixture
def patched(monkeypatch):
    """The norm classes' forwards and the module's record put back after the test."""
    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm):
        monkeypatch.setattr(cls, "forward", cls.forward)
    monkeypatch.setattr(norms, "_ORIGINAL", {})
    monkeypatch.setattr(norms, "DEVICES", ("cuda", "cpu"))  # (the CPU too)
    monkeypatch.setattr(norms, "available", lambda: True)


def _llama():
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def test_only_norms_whose_forward_is_llamas_are_taken():
    assert norms.llama_form(LlamaRMSNorm) and norms.llama_form(MistralRMSNorm) and norms.llama_form(Qwen2RMSNorm)
    assert not norms.llama_form(GemmaRMSNorm), "Gemma scales by 1 + weight"
    assert not norms.llama_form(torch.nn.RMSNorm) and not norms.llama_form(torch.nn.LayerNorm)


def test_prepare_takes_each_norm_class_once_and_outside_the_block_it_is_the_classs_own(patched):
    model = _llama()
    own = LlamaRMSNorm.forward
    assert norms.prepare(model) == 2 * 3 + 1
    assert LlamaRMSNorm.forward is not own and LlamaRMSNorm.forward.__wrapped__ is own
    assert norms.prepare(model) == 7 and LlamaRMSNorm.forward.__wrapped__ is own, "not wrapped twice"
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    calls = []
    real = norms.F.rms_norm
    norms.F.rms_norm = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with torch.no_grad():
            out = model(ids).logits
        assert calls == [], "outside the block: the class's own forward"
        norms.enter()
        try:
            with torch.no_grad():
                fused = model(ids).logits
        finally:
            norms.leave()
        assert len(calls) == 7
    finally:
        norms.F.rms_norm = real
    torch.testing.assert_close(fused, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_form_equals_the_own_to_rounding(patched, dtype):
    norm = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    norms.prepare(torch.nn.Sequential(norm))
    x = torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(2)).to(dtype) * 3
    own = LlamaRMSNorm.forward.__wrapped__(norm, x)
    norms.enter()
    try:
        fused = norm(x)
    finally:
        norms.leave()
    assert fused.dtype == own.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fused, own, rtol=tol, atol=tol)


def test_another_thread_outside_the_block_runs_the_classs_own(patched):
    norm = LlamaRMSNorm(16)
    norms.prepare(torch.nn.Sequential(norm))
    seen = []
    real = norms.F.rms_norm
    norms.F.rms_norm = lambda *a, **k: seen.append(threading.current_thread().name) or real(*a, **k)
    try:
        norms.enter()
        try:
            t = threading.Thread(target=lambda: norm(torch.randn(3, 16)), name="other")
            t.start()
            t.join()
            norm(torch.randn(3, 16))
        finally:
            norms.leave()
    finally:
        norms.F.rms_norm = real
    assert seen == [threading.current_thread().name]


def test_torch_compile_traces_the_classs_own_forward_without_a_break(patched):
    """Inside the block too, torch.compile traces the class's own forward: one graph, no
    break, no fused kernel in it."""
    import torch._dynamo as dynamo

    norm = LlamaRMSNorm(16)
    norms.prepare(torch.nn.Sequential(norm))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    dynamo.reset()
    traced = []

    def backend(gm, inputs):
        traced.append(str(gm.graph))
        return gm.forward

    norms.enter()
    try:
        explained = dynamo.explain(norm)(x)
        dynamo.reset()
        got = torch.compile(norm, backend=backend)(x)
    finally:
        norms.leave()
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert traced and not any("rms_norm" in g for g in traced), traced
    assert any("rsqrt" in g for g in traced), "the class's own: mean, rsqrt"
    torch.testing.assert_close(got, LlamaRMSNorm.forward.__wrapped__(norm, x))
