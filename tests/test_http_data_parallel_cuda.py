"""``serve --data-parallel 2`` on two GPUs: each engine process on a GPU of its own, every answer
greedy ``generate``'s (fp32), prompts that start alike sent to one engine and served from its
prefix cache, prompts at once spread over both. Needs two CUDA devices."""

import concurrent.futures
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs two CUDA devices ({torch.cuda.device_count()} here)"),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the server's children from /proc (Linux)"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[http]"')
    import tiny_lm

    return tiny_lm.make(str(tmp_path_factory.mktemp("tiny_lm")))


def _gpus_of(pids):
    """Each process's GPUs, by nvidia-smi (None where it is not on the path)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60).stdout
    seen = {}
    for line in out.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit():
            seen.setdefault(int(pid), set()).add(uuid.strip())
    return {p: seen.get(p, set()) for p in pids}


def test_two_engines_on_two_gpus_answer_as_generate_and_route_by_prefix(model_dir):
    import transformers as tr
    from helpers import Served
    from test_http_data_parallel_cpu import _engines

    srv = Served(model_dir, "--data-parallel", "2", "--device", "cuda", "--dtype", "float32", "--rows", "8",
                 "--log-level", "info", timeout=300)
    model = tr.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tok = tr.AutoTokenizer.from_pretrained(model_dir)

    def check(ids, answer):
        status, body = answer
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  pad_token_id=0)
        assert status == 200 and body["choices"][0]["text"] == tok.decode(want[0, len(ids):]), (ids, body)

    try:
        engines = _engines(srv.proc.pid)
        assert len(engines) == 2, engines
        system = [(7 * i) % 300 + 5 for i in range(48)]
        for i in range(4):  # (one after another: every one after the first goes where the first went)
            ids = system + [10 + i, 11 + i]
            check(ids, srv.complete(ids, 6))
        sent = srv.metric("graphwrap_engine_sequences_total")
        assert sorted(sent.values()) == [0.0, 4.0], sent
        assert max(srv.metric("graphwrap_prefix_cache_hits").values()) >= 3 * 48
        others = [[(13 * i + 3 * j) % 300 + 5 for j in range(20)] for i in range(16)]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda ids: srv.complete(ids, 6), others))
        for ids, answer in zip(others, got):
            check(ids, answer)
        sent = srv.metric("graphwrap_engine_sequences_total")
        assert min(sent.values()) > 0, sent  # (at once: spread over both)
        gpus = _gpus_of(engines)
        if gpus is not None:  # (each engine on one GPU, not the other's)
            assert all(len(g) == 1 for g in gpus.values()) and len(set.union(*gpus.values())) == 2, gpus
    finally:
        log = srv.stop()
    assert "over 2 engine processes (prefix routing)" in log and "[engine 0]" in log and "[engine 1]" in log, log[-3000:]
