"""Every command the README shows runs: the quick start (on the CPU fallback here), the example,
the benchmarks' entry point, and CI's extraction of the set-up and test commands."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, **kw)


def test_readme_is_short():
    assert len(README.encode()) <= 10 * 1024


def test_the_quick_start_runs():
    block = re.search(r"## The one-line wrap\n\n```python\n(.*?)```", README, re.S).group(1)
    r = _run(["-c", block])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch.Size([5, 8])" in r.stdout


def test_the_example_and_the_benchmarks_answer():
    r = _run(["examples/serve_mlp.py", "--dry-run"])
    assert r.returncode == 0 and "answers equal eager: True" in r.stdout, r.stdout + r.stderr[-2000:]
    for script in ("examples/serve_mlp.py", "benchmarks/run.py"):
        r = _run([script, "--help"])
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-2000:]


def test_ci_runs_the_readme_commands():
    r = subprocess.run(["bash", "-c", "awk '/^## Set-up and tests/{f=1} f && /^```bash/{b=1; next} "
                        "b && /^```/{exit} b' README.md"], capture_output=True, text=True, cwd=ROOT)
    lines = r.stdout.strip().splitlines()
    assert lines == ['python3 -m pip install -e ".[test,serve]"', "python3 -m pytest -q tests"]
    assert "README.md" in open(os.path.join(ROOT, ".ci", "run")).read()
