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


def test_the_scheduler_benchmark_runs_every_part_on_a_cpu(tmp_path):
    """benchmarks/scheduler.py on a Llama of a few layers: the short requests alone and beside a
    long prompt (the first and a later one), prompts alone against eager, a burst, for each
    budget asked (long prompts in pieces: ``--whole 0``); its figures written."""
    pytest.importorskip("transformers", reason="needs transformers: pip install transformers")
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, os.path.join("benchmarks", "scheduler.py"), "--model", "tiny", "--device",
                        "cpu", "--long", "600", "--alone", "100,600", "--bursts", "8", "--repeats", "1", "--budget",
                        "0,1024", "--whole", "0", "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["shorts_alone"]["s"] > 0 and [(s["budget"], s["whole"]) for s in data["settings"]] == [(0, 0), (1024, 0)]
    for s in data["settings"]:
        assert len(s["beside"]) == 2 and all(b["long_ttft_s"] <= b["shorts_s"] + 60 and b["long_ttft_s"] > 0
                                             for b in s["beside"])
        assert set(s["alone"]) == {"100", "600"} and all(a["eager_s"] > 0 for a in s["alone"].values())
        assert s["bursts"]["8"]["tok_s"] > 0 and s["bursts"]["8"]["longest_turn_ms"] > 0
        assert 0 < s["bursts"]["8"]["ttft_p50_ms"] <= s["bursts"]["8"]["ttft_p99_ms"]
    assert "(first long prompt)" in r.stdout and data["settings"][1]["counts"]["budget_pieces"] > 0


def test_a_suite_that_needs_a_missing_package_is_left_out_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """The GPU branch of run.py with two stand-in suites: one whose import of an optional
    package fails, one that runs; results are written for the one that ran."""
    import types

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import run
    finally:
        sys.path.pop(0)

    def needs_pkg(results, device, quick, repeats):
        raise ModuleNotFoundError("No module named 'somepackage'", name="somepackage")

    def works(results, device, quick, repeats):
        results.add("fake_ok", "a case", "eager", [1e-3, 2e-3], "s", 0.1, None)

    def breaks(results, device, quick, repeats):
        raise RuntimeError("a bug of the suite's own")

    for name, fn in (("fake_missing", needs_pkg), ("fake_ok", works), ("fake_broken", breaks)):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(run=fn))
        monkeypatch.setitem(run.SUITES, name, run.Suite(name, "a stand-in", "eager"))
    env = run.harness.environment()  # read on this machine, before CUDA is said to be there
    monkeypatch.setattr(run.harness, "environment", lambda: env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    code = run.main(["--suite", "fake_missing", "--suite", "fake_broken", "--suite", "fake_ok", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1 and "failed: fake_broken" in out, "a failing suite is reported in the exit code"
    assert "left out: it needs somepackage" in out
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["scenario"], r["strategy"]) for r in data["rows"]}
    assert ("fake_ok", "eager") in rows and ("fake_missing", "needs somepackage") in rows


def test_bench_help_names_the_command_users_type():
    r = subprocess.run([sys.executable, "-m", "graphwrap", "bench", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m graphwrap bench")
    assert "``" not in r.stdout


def test_the_family_table_is_the_one_its_script_makes_from_the_recorded_runs():
    """docs/families.md is generated (benchmarks/families.py --table) from the two JSON files a
    CPU and a GPU run wrote: a figure in it and its source cannot disagree."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("families", root / "benchmarks" / "families.py")
    families = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(families)
    runs = root / "benchmarks" / "results" / "families-2026-11-24-encdec"
    cpu, gpu = (json.loads((runs / f).read_text()) for f in ("cpu.json", "cuda.json"))
    assert (root / "docs" / "families.md").read_text() == families.table(cpu, gpu)
    assert gpu["device"].startswith("NVIDIA") and cpu["device"] == "cpu"
