"""A short soak of the HTTP server as strangers use it (benchmarks/soak_http.py; the full one is
20,000 requests over ten minutes): ``python -m graphwrap serve`` run as a user runs it, random
requests from concurrent clients, a tenth of them abandoned at a random moment and a twentieth
bad input. Every request ends as it must: none lost, none 5xx, every bad input a 4xx in the
API's shape; no row, queued sequence or cache block left in use; memory flat."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_short_soak_loses_nothing_and_leaves_nothing_in_use(tmp_path):
    n = 300
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "soak_http.py"), "--requests", str(n),
                        "--seconds", "20", "--clients", "16", "--hang-up", "0.15", "--bad", "0.1", "--memory-slack",
                        "0.25", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads((tmp_path / "soak.json").read_text())
    counts = got["counts"]
    assert sum(counts.values()) == n
    assert set(counts) <= {"served", "hung up", "bad input answered 4xx"}, counts
    assert counts["served"] > n // 2 and counts["hung up"] > 10 and counts["bad input answered 4xx"] > 5, counts
    assert got["tokens"] > 0 and not any(got["left_in_use"].values())
    assert all(got["verdicts"].values()) and got["server_exit"] == 0
