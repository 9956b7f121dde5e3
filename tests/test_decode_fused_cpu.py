"""Llama-form RMSNorms, GPT-2's GELUs, Llama's gated MLPs and rotary embedding in one kernel
inside the shared batch's forwards (graphwrap/decoding/kernels/fused.py): which classes are taken, the class's own forward everywhere but
inside the block on that thread, and the single kernel equal to the own forward to rounding
(the condition is widened to the CPU here; on a GPU the norm's is torch's
aten::_fused_rms_norm). Needs transformers."""

import threading

import pytest
import torch

from graphwrap.decoding.kernels import fused

tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
from transformers.activations import GELUActivation, NewGELUActivation, PytorchGELUTanh  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralMLP, MistralRMSNorm  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm  # noqa: E402

ROTATED = []  # a call of the rotary kernel's stand-in a layer
GATED = []  # a call of the gated MLP kernel's stand-in a layer
PROJECTED = []  # a call of the projections kernel's stand-in a layer


@pytest.fixture
def patched(monkeypatch):
    """The norm classes' forwards, the rotary functions and the module's record put back after
    the test; the rotary, gated MLP and projections kernels (Triton, on a GPU:
    tests/test_decode_rope_cuda.py, tests/test_decode_mlp_cuda.py) stood in for by their torch
    references, so that what is tested here is which calls reach them."""
    from graphwrap.decoding.kernels import mlp, qkv, rope

    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, NewGELUActivation, LlamaMLP, MistralMLP, Qwen2MLP,
                GemmaMLP, LlamaAttention, MistralAttention, Qwen2Attention):
        monkeypatch.setattr(cls, "forward", cls.forward)
    for mod in (modeling_llama, modeling_mistral):
        monkeypatch.setattr(mod, "apply_rotary_pos_emb", mod.apply_rotary_pos_emb)
    monkeypatch.setattr(fused, "FUNCTIONS", tuple(f._replace(available=lambda: True) for f in fused.FUNCTIONS))
    monkeypatch.setattr(rope, "applies", lambda q, k, cos, sin: q.dim() == 4 and cos.dim() == 3)
    monkeypatch.setattr(rope, "rotate", lambda q, k, cos, sin: ROTATED.append(1) or rope.reference(q, k, cos, sin))
    ROTATED.clear()
    monkeypatch.setattr(mlp, "applies", lambda x, gate, up: gate.bias is None and up.bias is None)
    monkeypatch.setattr(mlp, "gate_up", lambda x, wg, wu: GATED.append(1) or mlp.reference(x, wg, wu))
    GATED.clear()
    monkeypatch.setattr(qkv, "applies", lambda x, ps: all(isinstance(p, torch.nn.Linear) for p in ps))
    monkeypatch.setattr(qkv, "project", lambda x, ws, bs: PROJECTED.append(1) or qkv.reference(x, ws, bs))
    PROJECTED.clear()
    monkeypatch.setattr(fused, "_ORIGINAL", {})
    monkeypatch.setattr(fused, "DEVICES", ("cuda", "cpu"))  # (the CPU too)
    monkeypatch.setattr(fused, "FORMS", tuple(f._replace(available=lambda: True) for f in fused.FORMS))


def _llama():
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
    return tr.AutoModelForCausalLM.from_config(cfg).eval()


def test_only_modules_whose_forward_is_a_forms_are_taken():
    norm, gelu, gated, *projections = fused.FORMS
    assert fused.form_of(LlamaRMSNorm) is norm and fused.form_of(MistralRMSNorm) is norm
    assert fused.form_of(Qwen2RMSNorm) is norm
    assert fused.form_of(GemmaRMSNorm) is None, "Gemma scales by 1 + weight"
    assert fused.form_of(torch.nn.RMSNorm) is None and fused.form_of(torch.nn.LayerNorm) is None
    assert fused.form_of(NewGELUActivation) is gelu
    assert fused.form_of(GELUActivation) is None and fused.form_of(PytorchGELUTanh) is None, "one kernel already"
    assert fused.form_of(LlamaMLP) is gated and fused.form_of(MistralMLP) is gated and fused.form_of(Qwen2MLP) is gated
    # (each is a projections' form: Mistral's forward is Llama's in some versions of transformers, whose form comes first)
    assert all(fused.form_of(c) in projections for c in (LlamaAttention, MistralAttention, Qwen2Attention))


def test_prepare_takes_each_norm_class_once_and_outside_the_block_it_is_the_classs_own(patched, monkeypatch):
    model = _llama()
    own = LlamaRMSNorm.forward
    assert fused.prepare(model) == 2 * 3 + 1 + 3 + 3 + 1, \
        "two norms a layer, the last, an MLP and an attention a layer, the rotary function"
    assert LlamaRMSNorm.forward is not own and LlamaRMSNorm.forward.__wrapped__ is own
    assert fused.prepare(model) == 14 and LlamaRMSNorm.forward.__wrapped__ is own, "not wrapped twice"
    calls = []
    real = fused.F.rms_norm
    monkeypatch.setattr(fused.F, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    _outside_then_inside(model, calls)
    assert len(calls) == 7


def test_gpt2s_gelus_run_as_one_kernel_inside_the_block_and_the_logits_agree(patched, monkeypatch):
    torch.manual_seed(0)
    model = tr.GPT2LMHeadModel(tr.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=101, n_positions=32)).eval()
    assert fused.prepare(model) == 2, "a GELU a layer; GPT-2's LayerNorms are one kernel already"
    calls = []
    real = fused.F.gelu
    monkeypatch.setattr(fused.F, "gelu", lambda *a, **k: calls.append(k.get("approximate")) or real(*a, **k))
    _outside_then_inside(model, calls)
    assert calls == ["tanh", "tanh"]


def _outside_then_inside(model, calls):
    """The model's logits outside the block (none of the single kernels called), then inside it:
    equal to rounding."""
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids).logits
        assert calls == [], "outside the block: the class's own forward"
        fused.enter()
        try:
            inside = model(ids).logits
        finally:
            fused.leave()
    torch.testing.assert_close(inside, out, rtol=1e-5, atol=1e-5)


def _norm():
    norm = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    return norm, (5, 7, 48), 3.0, 1e-2


def _gelu():
    return NewGELUActivation(), (4, 300), 4.0, 2e-2


@pytest.mark.parametrize("make", [_norm, _gelu], ids=["llama-rmsnorm", "gpt2-gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_each_forms_single_kernel_equals_its_own_forward_to_rounding(patched, make, dtype):
    module, shape, scale, tol = make()
    module = module.to(dtype)
    fused.prepare(torch.nn.Sequential(module))
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * scale).to(dtype)
    own = type(module).forward.__wrapped__(module, x)
    fused.enter()
    try:
        one = module(x)
    finally:
        fused.leave()
    assert one.dtype == own.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else tol
    torch.testing.assert_close(one, own, rtol=tol, atol=tol)


def test_a_norm_whose_weight_is_another_dtype_gives_its_own_result_dtype(patched):
    norm = LlamaRMSNorm(32)  # an fp32 weight over fp16 states: transformers' product is fp32
    with torch.no_grad():
        norm.weight.normal_()
    fused.prepare(torch.nn.Sequential(norm))
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4)).half()
    own = LlamaRMSNorm.forward.__wrapped__(norm, x)
    fused.enter()
    try:
        one = norm(x)
    finally:
        fused.leave()
    assert own.dtype == one.dtype == torch.float32
    torch.testing.assert_close(one, own, rtol=1e-6, atol=1e-6)


def test_another_thread_outside_the_block_runs_the_classs_own(patched):
    norm = LlamaRMSNorm(16)
    fused.prepare(torch.nn.Sequential(norm))
    seen = []
    real = fused.F.rms_norm
    fused.F.rms_norm = lambda *a, **k: seen.append(threading.current_thread().name) or real(*a, **k)
    try:
        fused.enter()
        try:
            t = threading.Thread(target=lambda: norm(torch.randn(3, 16)), name="other")
            t.start()
            t.join()
            norm(torch.randn(3, 16))
        finally:
            fused.leave()
    finally:
        fused.F.rms_norm = real
    assert seen == [threading.current_thread().name]


def test_torch_compile_traces_the_classs_own_forward_without_a_break(patched):
    """Inside the block too, torch.compile traces the class's own forward: one graph, no
    break, no fused kernel in it."""
    import torch._dynamo as dynamo

    norm = LlamaRMSNorm(16)
    fused.prepare(torch.nn.Sequential(norm))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(4))
    dynamo.reset()
    traced = []

    def backend(gm, inputs):
        traced.append(str(gm.graph))
        return gm.forward

    fused.enter()
    try:
        explained = dynamo.explain(norm)(x)
        dynamo.reset()
        got = torch.compile(norm, backend=backend)(x)
    finally:
        fused.leave()
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert traced and not any("rms_norm" in g for g in traced), traced
    assert any("rsqrt" in g for g in traced), "the class's own: mean, rsqrt"
    torch.testing.assert_close(got, LlamaRMSNorm.forward.__wrapped__(norm, x))


def test_the_rotary_form_is_llamas_function_and_its_rotate_half_in_each_family_copy():
    import types

    from transformers.models.gpt_neox import modeling_gpt_neox
    from transformers.models.phi3 import modeling_phi3

    assert fused.function_form(modeling_llama) is fused.FUNCTIONS[0]
    assert fused.function_form(modeling_mistral) is fused.FUNCTIONS[0]
    assert fused.function_form(modeling_phi3) is None, "a partial rotary: its own function"
    assert fused.function_form(modeling_gpt_neox) is None

    def rotate_half(x):  # the interleaved pairs some families rotate: not Llama's halves
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    interleaved = types.ModuleType("interleaved")
    interleaved.apply_rotary_pos_emb = types.FunctionType(modeling_llama.apply_rotary_pos_emb.__code__,
                                                          interleaved.__dict__)
    interleaved.rotate_half = rotate_half
    assert fused.function_form(interleaved) is None, "the same function over another rotate_half"


def test_llamas_rotary_runs_as_one_kernel_inside_the_block_and_the_logits_agree(patched):
    model = _llama()
    own = modeling_llama.apply_rotary_pos_emb
    assert fused.prepare(model) == 1 + 2 * 3 + 1 + 3 + 3, "the rotary function, the norms, MLPs and attentions"
    assert modeling_llama.apply_rotary_pos_emb is not own and modeling_llama.apply_rotary_pos_emb._gw_own is own
    fused.prepare(model)
    assert modeling_llama.apply_rotary_pos_emb._gw_own is own, "not wrapped twice"
    _outside_then_inside(model, ROTATED)
    assert len(ROTATED) == 3, "a layer each"


def test_a_rotary_call_that_is_not_llamas_own_runs_the_function_as_it_is(patched):
    model = _llama()
    fused.prepare(model)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    fused.enter()
    try:
        got = modeling_llama.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
        plain = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    finally:
        fused.leave()
    assert len(ROTATED) == 1, "only the call of four arguments"
    own = modeling_llama.apply_rotary_pos_emb._gw_own(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    torch.testing.assert_close(got, own)
    torch.testing.assert_close(plain[0].transpose(1, 2), got[0], rtol=1e-6, atol=1e-6)


def test_llamas_gated_mlps_run_as_one_kernel_inside_the_block_and_the_logits_agree(patched):
    model = _llama()
    own = LlamaMLP.forward
    fused.prepare(model)
    assert LlamaMLP.forward is not own and LlamaMLP.forward.__wrapped__ is own
    _outside_then_inside(model, GATED)
    assert len(GATED) == 3, "a layer each"


def test_an_mlp_of_llamas_form_with_another_activation_or_biases_runs_its_own_forward(patched):
    """Gemma's MLP is Llama's forward over a GELU; an MLP with biases is not the kernel's."""
    gemma = GemmaMLP(tr.GemmaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=8, hidden_activation="gelu_pytorch_tanh"))
    biased = LlamaMLP(tr.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, mlp_bias=True))
    plain = LlamaMLP(tr.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2))
    assert fused.form_of(GemmaMLP) is fused.FORMS[2], "the same forward, instruction for instruction"
    fused.prepare(torch.nn.ModuleList([gemma, biased, plain]))
    x = torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fused.enter()
        try:
            got = [m(x) for m in (gemma, biased)]
            assert GATED == [], "not SiLU, or biases: the class's own"
            plain(x)
            assert GATED == [1]
        finally:
            fused.leave()
        for m, y in zip((gemma, biased), got):
            torch.testing.assert_close(y, type(m).forward.__wrapped__(m, x))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_attentions_projections_run_as_one_kernel_inside_the_block_and_the_logits_agree(patched, family):
    torch.manual_seed(0)
    cfg = getattr(tr, "LlamaConfig" if family == "llama" else "Qwen2Config")(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=101, max_position_embeddings=64)  # (Qwen2's projections have biases)
    model = tr.AutoModelForCausalLM.from_config(cfg).eval()
    own = type(model.model.layers[0].self_attn).forward
    fused.prepare(model)
    assert type(model.model.layers[0].self_attn).forward.__wrapped__ is own
    _outside_then_inside(model, PROJECTED)
    assert len(PROJECTED) == 3, "a layer each"


def test_a_given_module_is_the_module_but_for_its_projections_of_that_very_input():
    from graphwrap.decoding.kernels import qkv

    attn = LlamaAttention(tr.LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1), layer_idx=0)
    x, other = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    outs = [torch.full((2, 1, 16), 1.0), torch.full((2, 1, 8), 2.0), torch.full((2, 1, 8), 3.0)]
    given = qkv.Given(attn, x, outs)
    assert given.q_proj(x) is outs[0] and given.k_proj(x) is outs[1] and given.v_proj(x) is outs[2]
    with torch.no_grad():
        torch.testing.assert_close(given.k_proj(other), attn.k_proj(other))  # another input: the projection's own
        torch.testing.assert_close(given.k_proj(x.clone()), attn.k_proj(x))  # an equal tensor is another input
    assert given.k_proj.weight is attn.k_proj.weight and given.o_proj is attn.o_proj
    assert given.layer_idx == 0 and given.head_dim == attn.head_dim and given.config is attn.config


def test_a_projection_is_taken_only_where_its_call_is_its_product_alone():
    """Hooks (an adapter's, an offloading's) or another class or device: the module's own call."""
    from graphwrap.decoding.kernels import qkv

    x = torch.randn(2, 8)
    assert qkv.plain(torch.nn.Linear(8, 4), x)
    hooked = torch.nn.Linear(8, 4)
    hooked.register_forward_hook(lambda mod, args, out: out * 2)
    pre = torch.nn.Linear(8, 4)
    pre.register_forward_pre_hook(lambda mod, args: None)

    class Adapted(torch.nn.Linear):
        pass

    assert not qkv.plain(hooked, x) and not qkv.plain(pre, x) and not qkv.plain(Adapted(8, 4), x)
    assert not qkv.plain(torch.nn.Linear(8, 4, device="meta"), x), "weights elsewhere (offloaded)"

    class Quantized(torch.Tensor):  # (a subclass whose memory is not the matrix)
        pass

    quantized = torch.nn.Linear(8, 4)
    quantized.weight = torch.nn.Parameter(quantized.weight.detach().as_subclass(Quantized))
    assert not qkv.plain(quantized, x), "a weight of a tensor subclass"
    handle = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        assert not qkv.plain(torch.nn.Linear(8, 4), x), "a global hook"
    finally:
        handle.remove()
    assert qkv.plain(torch.nn.Linear(8, 4), x)


def test_decorated_forwards_are_told_apart_by_what_they_wrap_and_the_decorators_settings():
    """transformers 5.24 decorates many forwards with one decorator: the decorator's code alone
    would make every such class one form."""
    import functools

    def renaming(old):
        def decorate(f):
            @functools.wraps(f)
            def wrapped(*args, **kwargs):
                return f(*args, **kwargs)
            wrapped._old = old
            return wrapped
        return decorate

    def a(self, x):
        return x + 1

    def b(self, x):
        return x * 2

    def c(self, x):
        return x + 1

    assert fused._code(renaming("cache")(a)) != fused._code(renaming("cache")(b)), "another forward inside"
    assert fused._code(renaming("cache")(a)) == fused._code(renaming("cache")(c)), "the same instructions"
    assert fused._code(renaming("cache")(a)) != fused._code(a), "decorated or not"

    def setting(name):
        def decorate(f):
            @functools.wraps(f)
            def wrapped(*args, **kwargs):
                kwargs.pop(name, None)
                return f(*args, **kwargs)
            return wrapped
        return decorate

    assert fused._code(setting("cache")(a)) != fused._code(setting("past")(a)), "the decorator's settings"
