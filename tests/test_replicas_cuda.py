"""Replicas on every GPU of the host (needs two): answers equal eager, every replica used."""

import pytest
import torch
from helpers import MLP, run_threads

from graphwrap import Replicas

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def test_two_gpus_answer_as_eager_and_share_the_load():
    model = MLP().eval()
    with Replicas(model) as reps:
        assert [str(d) for d in reps.devices][:2] == ["cuda:0", "cuda:1"]

        def work(i):
            g = torch.Generator().manual_seed(i)
            for k in range(200):
                n = int(torch.randint(1, 6, (1,), generator=g))
                x = torch.randn(n, 32, generator=g)
                x = x.to("cuda:0") if k % 3 == 0 else x
                got = reps(x)
                with torch.no_grad():
                    want = model(x.cpu())
                torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)

        assert not run_threads(work, count=32)
        s = reps.stats()
    served = {dev: v["batcher"]["requests"] for dev, v in s.items()}
    print(f"\nreplicas: requests served per device {served}")
    assert sum(served.values()) == 32 * 200 and all(v > 0 for v in served.values())


def test_generate_on_two_gpus_runs_each_replicas_shared_batch_and_gives_generates_tokens():
    """A replica on cuda:1 while the callers' current device is cuda:0: its batch's probe, decode
    thread, captures and Triton's launches all on cuda:1 (once they fell back to the one-call
    loop there)."""
    tr = pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    import concurrent.futures

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=500, max_position_embeddings=512, eos_token_id=None,
                         pad_token_id=0)
    model = tr.LlamaForCausalLM(cfg).eval()
    system = torch.randint(3, 500, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [system + [10 + i, 20 + i, 30 + i] if i % 2 else [(7 * i + j) % 490 + 5 for j in range(40)]
               for i in range(24)]
    assert torch.cuda.current_device() == 0
    with Replicas(model, devices=["cuda:0", "cuda:1"]) as reps:
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda p: reps.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False),
                                prompts))
        for p, out in zip(prompts, got):
            with torch.no_grad():
                want = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)
            assert torch.equal(out.cpu(), want), p
        for gm in reps.modules:
            d = gm.stats().get("decode") or {}
            assert "off" not in d and d.get("done", 0) > 0, d  # (each replica's own shared batch served)
        assert {o.device.index for o in got} == {0, 1}
        assert reps.routed["prefix"] >= 6, reps.routed
