"""Every command the README shows runs: each of its Python blocks (on the CPU fallback here), the
examples, the benchmarks' entry point and ``python -m graphwrap``, and CI's extraction of the
set-up and test commands; and no document names a file the repository lacks."""

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


def test_every_python_block_runs():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 3
    for block in blocks:
        r = _run(["-c", block])
        assert r.returncode == 0, block + r.stderr[-2000:]
        # Nothing but graphwrap's own notes (a warning of another library's, such as an
        # end-of-sequence id outside a small vocabulary, would be the first thing a user reads).
        foreign = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("graphwrap: ")]
        assert not foreign, block + "\n".join(foreign)


def test_the_readme_links_nothing_relative():
    """The README is also the package's page on an index, where a link relative to the
    repository leads nowhere: paths are named in backticks instead."""
    links = re.findall(r"\]\(([^)]+)\)", README)
    assert all(link.startswith("https://") for link in links), links


def test_the_text_block_cuts_outputs_back_to_each_length():
    block = re.search(r"## Text of every length\n\n```python\n(.*?)```", README, re.S).group(1)
    r = _run(["-c", block])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:3] == [f"torch.Size([2, {n}, 64])" for n in (7, 30, 61)], r.stdout


def test_the_examples_answer_as_eager_does():
    r = _run(["examples/serve_mlp.py", "--dry-run"])
    assert r.returncode == 0 and "answers equal eager: True" in r.stdout, r.stdout + r.stderr[-2000:]
    for script in ("offline_loop.py", "threaded_server.py", "async_server.py"):
        r = _run([os.path.join("examples", script)])
        assert r.returncode == 0 and "answers equal eager: True" in r.stdout, script + r.stdout + r.stderr[-2000:]
    for script in ("examples/serve_mlp.py", "benchmarks/run.py"):
        r = _run([script, "--help"])
        assert r.returncode == 0 and "usage" in r.stdout, r.stderr[-2000:]


def test_the_diffusion_example_gives_eagers_latents():
    """examples/diffusion.py: diffusers' DDIM loop over GraphedModule(unet) gives eager's latents
    (on a CPU every call runs eagerly: this checks the example and its inputs, the GPU run
    checks the graphs). diffusers is an optional extra: CI installs it for this test."""
    import pytest

    pytest.importorskip("diffusers", reason="diffusers is not installed (pip install diffusers)")
    r = _run(["examples/diffusion.py"])
    assert r.returncode == 0 and "latents equal eager's: True" in r.stdout, r.stdout + r.stderr[-2000:]


def test_python_m_graphwrap():
    import graphwrap

    r = _run(["-m", "graphwrap", "--version"])
    assert r.returncode == 0 and r.stdout.strip() == f"graphwrap {graphwrap.__version__}", r.stdout + r.stderr
    r = _run(["-m", "graphwrap", "env"])
    assert r.returncode == 0 and "torch" in r.stdout and "CUDA" in r.stdout, r.stderr[-2000:]
    r = _run(["-m", "graphwrap", "bench", "--help"])
    assert r.returncode == 0 and "text" in r.stdout and "--quick" in r.stdout, r.stderr[-2000:]
    r = _run(["-m", "graphwrap", "nonsense"])
    assert r.returncode == 2 and "invalid choice" in r.stderr


def _docs():
    paths = ["README.md", "CHANGELOG.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))]
    paths += [os.path.join(d, "README.md") for d in ("benchmarks/diagnostics", "benchmarks/results")]
    return [p for p in paths if p.endswith(".md")]


def test_no_document_names_a_file_the_repository_lacks():
    """Paths in backticks or links that look like the repository's own (under a top-level folder,
    or a .md/.py file with a folder) must exist; links in docs/ are relative to it."""
    tops = ("graphwrap/", "tests/", "benchmarks/", "docs/", "examples/", ".ci/")
    missing = []
    for doc in _docs():
        text = open(os.path.join(ROOT, doc)).read()
        for ref in re.findall(r"`([^`\s]+)`|\]\(([^)\s#]+)\)", text):
            ref = ref[0] or ref[1]
            if ref.startswith("http") or any(c in ref for c in "*{…"):
                continue
            path = ref.split(":")[0].rstrip("/")
            if path.startswith(tops) or path.endswith((".md", ".py")) and "/" in path:
                base = ROOT if not doc.startswith("docs/") or path.startswith(tops) else os.path.join(ROOT, "docs")
                if not os.path.exists(os.path.join(base, path)):
                    missing.append(f"{doc}: {ref}")
    assert not missing, missing


def test_ci_runs_the_readme_commands():
    r = subprocess.run(["bash", "-c", "awk '/^## Set-up and tests/{f=1} f && /^```bash/{b=1; next} "
                        "b && /^```/{exit} b' README.md"], capture_output=True, text=True, cwd=ROOT)
    lines = r.stdout.strip().splitlines()
    assert lines == ['python3 -m pip install -e ".[test,serve]"', "python3 -m pytest -q -rs tests",
                     "python3 -m graphwrap bench --quick"]
    assert "README.md" in open(os.path.join(ROOT, ".ci", "run")).read()
