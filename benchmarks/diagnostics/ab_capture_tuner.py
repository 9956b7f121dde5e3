"""Capture time of BERT-base with and without the per-size tuner, rows alternating, one process
each with an empty Inductor cache (compile_start's row): does the tuner slow capture?"""
import os
import sys
import tempfile

sys.path.insert(0, "benchmarks")
import compile_start as c

tmp = tempfile.mkdtemp()
for i, kw in enumerate([{"compile": {"static": False}}, {"compile": True}, {"compile": {"static": False}}, {"compile": True}]):
    r = c._row("graphwrap", kw, os.path.join(tmp, f"i{i}"))
    print("AB", kw, {k: r.get(k) for k in ("ready_s", "tuning_s", "ms_per_call_bs8", "error")}, flush=True)
