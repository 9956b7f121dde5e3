"""The benchmark entry point runs, so it never rots (on a CPU: the eager-fallback suite)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU suite runs only where no CUDA device is found")
def test_quick_suite_runs_on_cpu(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--quick", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "No CUDA device found" in r.stdout and "Graph figures need a GPU" in r.stdout
    assert "| eager |" in r.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["environment"]["torch"] == torch.__version__
    strategies = {row["strategy"] for row in data["rows"]}
    assert strategies == {"eager", "graphwrap (eager fallback)"}
    assert all(row["median"] > 0 and row["min"] <= row["median"] <= row["max"] for row in data["rows"])
    header = (tmp_path / "results.csv").read_text().splitlines()[0].split(",")
    assert {"scenario", "strategy", "median", "min", "max", "cold_start_s"} <= set(header)
