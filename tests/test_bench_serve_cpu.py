"""The serving benchmark (benchmarks/bench_serve.py): its datasets, and a run against ``python -m
graphwrap serve`` started as a user starts it, each request counted with the metrics as ``vllm
bench serve`` defines them."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_serve  # noqa: E402


def test_the_datasets_are_what_they_say_and_the_same_for_a_seed():
    r = bench_serve.dataset("random", 20, 0, 500, 1024, 64, 32)
    assert len(r) == 20 and all(len(x.prompt) == 64 and x.output_len == 32 for x in r)
    assert all(3 <= t < 500 for x in r for t in x.prompt)
    assert [x.prompt for x in r] == [x.prompt for x in bench_serve.dataset("random", 20, 0, 500, 1024, 64, 32)]
    s = bench_serve.dataset("sharegpt", 200, 1, 500, 1024, 200, 150)
    assert all(len(x.prompt) + x.output_len <= 1024 and len(x.prompt) >= 4 for x in s)
    assert len({len(x.prompt) for x in s}) > 50, "a spread of lengths"
    p = bench_serve.dataset("prefix", 0, 2, 500, 4096, 16, 8, prefix_len=100, groups=3, per_group=4)
    assert len(p) == 12
    prefixes = {tuple(x.prompt[:100]) for x in p}
    assert len(prefixes) == 3 and all(len(x.prompt) == 116 for x in p)


def test_the_report_follows_vllm_s_definitions():
    o = [bench_serve.Outcome(ok=True, ttft=0.1, itl=[0.01, 0.03], e2e=0.5, tokens=5),
         bench_serve.Outcome(ok=False, error="status 500")]
    r = bench_serve.report(o, 2.0)
    assert r["completed"] == 1 and r["failed"] == 1 and r["errors"] == ["status 500"]
    assert r["output_tokens_per_s"] == 2.5 and r["requests_per_s"] == 0.5
    assert abs(r["tpot_ms"]["mean"] - 100.0) < 1e-9  # (0.5 - 0.1) / (5 - 1)
    assert abs(r["itl_ms"]["median"] - 20.0) < 1e-9 and abs(r["ttft_ms"]["p99"] - 100.0) < 1e-9
    assert abs(r["tokens_per_chunk"] - 5 / 3) < 1e-9  # (5 tokens in 3 chunks: the first, and one a gap)


def test_a_run_against_the_server_counts_every_request(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    import tiny_lm
    from helpers import serve_cli

    model_dir = tiny_lm.make(str(tmp_path / "m"))
    p, port = serve_cli(model_dir, "--engine", "process")
    try:
        for ds, n, args in (("random", 24, ["--num-prompts", "24"]), ("sharegpt", 24, ["--num-prompts", "24"]),
                            ("prefix", 12, ["--groups", "3", "--per-group", "4", "--prefix-len", "40",
                                            "--repeats", "2"])):
            out = tmp_path / f"{ds}.json"
            rc = bench_serve.main(["--url", f"http://127.0.0.1:{port}", "--dataset", ds, "--input-len", "16",
                                   "--output-len", "12", "--concurrency", "8", "--vocab", "300", "--out", str(out),
                                   *args] + (["--request-rate", "200"] if ds == "sharegpt" else []))
            r = json.loads(out.read_text())
            runs = [r["first_run"]] + r["runs"] if ds == "prefix" else [r]
            assert rc == 0 and len(runs) == (2 if ds == "prefix" else 1)
            for x in runs:
                assert x["completed"] == n and x["failed"] == 0, x["errors"]
                if ds != "sharegpt":  # the end of sequence ignored: every answer its whole length
                    assert x["output_tokens"] == n * 12
                assert 0 <= x["prefix_cache_hit_rate"] <= 1, x  # (read from the server's /metrics around the run)
                for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                    assert x[k]["median"] is not None and x[k]["p99"] >= x[k]["median"] > 0
            if ds == "prefix":  # (past one run: the first apart, the rest by their median)
                assert r["output_tokens_per_s"] == r["runs"][0]["output_tokens_per_s"] and r["failed"] == 0
    finally:
        p.terminate()
        p.wait(60)
