"""CompiledForward on the CPU: every shape compiles, whatever dynamo's recompile limit."""

import pytest
import torch
from helpers import MLP

from graphwrap.capture.compiled import CompiledForward, compile_options

dynamo_config = pytest.importorskip("torch._dynamo.config")
LIMIT = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"


def test_every_shape_compiles_past_the_recompile_limit():
    torch._dynamo.reset()
    model = MLP(d_in=8, hidden=16, d_out=4).eval()
    with dynamo_config.patch({LIMIT: 1}):
        cf = CompiledForward(model, compile_options({"dynamic": False}))
        with torch.no_grad():
            for n in (1, 2, 3):
                x = torch.randn(n, 8)
                torch.testing.assert_close(cf(x), model(x), rtol=1e-5, atol=1e-5)
        # One graph per shape: the limit of 1 would have left shapes 2 and 3 uncompiled.
        assert cf.graphs == 3
        with torch.no_grad():
            cf(torch.randn(2, 8))
        assert cf.graphs == 3  # a shape seen before reuses its kernels
        assert getattr(dynamo_config, LIMIT) == 1  # the user's limit is back

        # The user's own torch.compile of the same model is not crowded out: graphwrap's three
        # entries do not count toward its limit of 1, and its calls run its own compiled code.
        compiled, ran = [], []

        def backend(gm, example_inputs):
            compiled.append(gm)

            def run(*a):
                ran.append(1)
                return gm.forward(*a)
            return run

        peer = torch.compile(model, backend=backend, dynamic=False)
        with torch.no_grad():
            for _ in range(2):
                peer(torch.randn(2, 8))
        assert len(compiled) == 1 and len(ran) == 2
    torch._dynamo.reset()


def test_batch_dynamic_compiles_once_for_every_size_of_two_rows_or_more():
    torch._dynamo.reset()
    model = MLP(d_in=8, hidden=16, d_out=4).eval()
    cf = CompiledForward(model, compile_options(True))
    with torch.no_grad():
        for n in (2, 3, 7, 16):
            x = torch.randn(n, 8)
            cf.mark([x], ((0, None, 0),))
            torch.testing.assert_close(cf(x), model(x), rtol=1e-5, atol=1e-5)
        assert cf.graphs == 1
        x = torch.randn(1, 8)
        cf.mark([x], ((0, None, 0),))  # left alone: size 1 is specialized, a graph of its own
        torch.testing.assert_close(cf(x), model(x), rtol=1e-5, atol=1e-5)
    assert cf.graphs == 2
    torch._dynamo.reset()


def test_compile_options_dynamic_and_cache_are_checked(tmp_path, monkeypatch):
    import graphwrap.capture.compiled as compiled
    from graphwrap import GraphwrapError

    assert compile_options(True)["dynamic"] == "batch" and compile_options(True)["cache"] is None
    for dyn in (False, True, "batch"):
        assert compile_options({"dynamic": dyn})["dynamic"] == dyn
    with pytest.raises(GraphwrapError, match="dynamic="):
        compile_options({"dynamic": "rows"})
    with pytest.raises(GraphwrapError, match="file path"):
        compile_options({"cache": 3})
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", None, raising=False)
    monkeypatch.delattr(torch.compiler, "save_cache_artifacts")
    with pytest.raises(GraphwrapError, match="save_cache_artifacts"):
        compile_options({"cache": str(tmp_path / "c.bin")})
    with pytest.raises(GraphwrapError, match="torch 2.7"):
        compiled.save_cache(tmp_path / "c.bin")
