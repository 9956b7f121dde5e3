"""What importing graphwrap costs: the packages import their names on first use, and the
server's side of ``python -m graphwrap serve`` imports no torch before it starts its engine
process (each in a fresh interpreter)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_import_graphwrap_imports_no_torch_until_a_name_is_used():
    out = _run("import sys, graphwrap\n"
               "print('torch' in sys.modules, graphwrap.__version__ == graphwrap.__dict__['__version__'])\n"
               "g = graphwrap.GraphedModule\n"
               "print('torch' in sys.modules, g.__module__, 'GraphedModule' in graphwrap.__dict__)")
    assert out.splitlines() == ["False True", "True graphwrap.module True"]


@pytest.mark.parametrize("package", ["graphwrap", "graphwrap.serve", "graphwrap.serve.api"])
def test_every_exported_name_resolves_and_others_raise(package):
    import importlib

    mod = importlib.import_module(package)
    for name in mod.__all__:
        assert getattr(mod, name) is not None and name in dir(mod)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        mod.nothing_here  # noqa: B018


def test_the_servers_side_of_the_engine_imports_no_torch_nor_the_http_side():
    """What ``serve`` imports before it spawns its engine process (cli.main up to load)."""
    out = _run("import sys\n"
               "from graphwrap.serve.api import cli, engine_process, engines, fronts, loading, remote, routed\n"
               "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'uvicorn') if m in sys.modules))")
    assert out == "[]"


def test_the_http_apps_own_modules_import_no_torch():
    """The app, its client and its grammar checks (``graphwrap/decoding/callers/grammar.py``) and
    the packed log-probabilities it unpacks (``logprobs.py``) are plain Python: the torch an HTTP
    process holds comes from the tokenizer's transformers alone."""
    pytest.importorskip("fastapi", reason='needs FastAPI and uvicorn: pip install -e ".[serve]"')
    out = _run("import sys\n"
               "import graphwrap.serve.api.app\n"
               "from graphwrap.decoding.callers import grammar, logprobs\n"
               "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert out == "[]"
