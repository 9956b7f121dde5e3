"""The docs name only what exists: every file, folder and test they cite, and their tables
render as tables (a paragraph right under a table would be read as one of its rows)."""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "CHANGELOG.md", "docs/contract.md", "docs/design.md", "docs/benchmarks.md",
        "benchmarks/results/README.md", "benchmarks/diagnostics/README.md"]
# Where a bare name in a doc is looked for, in order.
PLACES = ["", "graphwrap", "tests", "benchmarks", "benchmarks/results", "benchmarks/diagnostics", "docs", "examples"]
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w.\-/]+\.(py|md|log|json|csv|toml|txt)$|^[\w.\-]+/([\w.\-]+/)*$")
TEST = re.compile(r"^(…|[\w\-/]+\.py)::(test\w*…?|…\w*)")


def _docs():
    for d in DOCS + [os.path.join("benchmarks/results", f, "README.md")
                     for f in sorted(os.listdir(os.path.join(ROOT, "benchmarks/results")))
                     if os.path.isfile(os.path.join(ROOT, "benchmarks/results", f, "README.md"))]:
        if os.path.isfile(os.path.join(ROOT, d)):
            yield d


def _all_paths():
    out = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        rel = os.path.relpath(top, ROOT)
        for n in dirs + files:
            out.add(n if rel == "." else f"{rel}/{n}")
    return out


PATHS = _all_paths()


def _removed_probes():
    """Probes deleted from benchmarks/diagnostics/, named in its README's "Removed" table (a
    results folder that ran one still names it: the commit it ran at holds it)."""
    text = open(os.path.join(ROOT, "benchmarks/diagnostics/README.md")).read()
    part = text.split("## Removed", 1)[1] if "## Removed" in text else ""
    return set(re.findall(r"^\| ([\w.]+\.py) \|", part, re.M))


REMOVED = _removed_probes()


def _exists(name: str, doc: str) -> bool:
    """A name resolves where some path of the repository ends with it (a file named in a
    results folder's README, or beside the folder a paragraph names, resolves so)."""
    name = name.rstrip("/")
    return name in PATHS or any(p.endswith("/" + name) for p in PATHS)


def _tests_in(path: str):
    tree = ast.parse(open(os.path.join(ROOT, "tests", path)).read())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("doc", list(_docs()))
def test_every_file_folder_and_test_a_doc_names_exists(doc):
    missing = []
    historical = doc.startswith("benchmarks/results/") and doc != "benchmarks/results/README.md"
    text = open(os.path.join(ROOT, doc)).read()
    for line in text.splitlines():
        last_file = None
        for tok in CODE.findall(line):
            tok = tok.strip()
            m = TEST.match(tok)
            if m:
                path, name = m.group(1), m.group(2)
                path = last_file if path == "…" else os.path.basename(path)
                if path is None or not os.path.isfile(os.path.join(ROOT, "tests", path)):
                    missing.append(tok)
                    continue
                last_file = path
                names = _tests_in(path)
                if "…" in name:
                    stem = name.strip("…")
                    ok = any(n.startswith(stem) or (name.startswith("…") and n.endswith(stem)) for n in names)
                else:
                    ok = name in names
                if not ok:
                    missing.append(tok)
                continue
            if historical and re.match(r"^test_\w+\.py$", tok):
                continue  # a results folder names the test files of the commit its runs measured
            if (historical or doc == "CHANGELOG.md") and os.path.basename(tok.split()[0]) in REMOVED:
                continue  # and the probes it ran, since removed (benchmarks/diagnostics/README.md), as the changelog's past entries do
            if PATH.match(tok) and "…" not in tok and "*" not in tok and not tok.startswith(("http", ".")):
                if tok.endswith(".py") and "/" not in tok and tok.startswith("test_"):
                    last_file = tok
                if not _exists(tok, doc):
                    missing.append(tok)
    assert not missing, f"{doc} names what the repository lacks: {missing}"


@pytest.mark.parametrize("doc", list(_docs()))
def test_tables_render(doc):
    lines = open(os.path.join(ROOT, doc)).read().splitlines()
    glued, in_code = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            in_code = not in_code
        if in_code:
            continue
        if line.startswith("|") and i + 1 < len(lines):
            nxt = lines[i + 1]
            if nxt.strip() and not nxt.startswith("|"):
                glued.append(f"line {i + 2}: {nxt[:60]}")
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            sep = lines[i + 1] if i + 1 < len(lines) else ""
            if not re.match(r"^\|( *:?-+:? *\|)+\s*$", sep):
                glued.append(f"line {i + 1}: a table without its separator row")
    assert not glued, f"{doc}: a paragraph right under a table (add a blank line): {glued}"


def _docs_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_script", os.path.join(ROOT, "benchmarks", "docs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_parts_of_the_docs_are_what_their_script_makes():
    """The suite table, the results index and every quoted test summary are made from their
    sources (benchmarks/run.py's suites, the results folders and the docs citing them, the
    logs): python3 benchmarks/docs.py rewrites them; here nothing may be stale."""
    assert _docs_script().stale() == []


def test_the_docs_script_finds_a_stale_summary_an_undescribed_folder_and_a_missing_suite(tmp_path, monkeypatch):
    script = _docs_script()
    log = tmp_path / "benchmarks" / "results" / "x-2026-01-01" / "gpu.log"
    log.parent.mkdir(parents=True)
    log.write_text("....\n===== 7 passed, 1 skipped, 3 deselected in 12.50s (0:00:12) =====\n")
    assert script.log_summary(str(log)) == "7 passed, 1 skipped, 3 deselected"
    quoted = "runs: `6 passed` (`benchmarks/results/x-2026-01-01/gpu.log`) then"
    monkeypatch.setattr(script, "ROOT", str(tmp_path))
    assert script.with_summaries(quoted) == "runs: `7 passed, 1 skipped, 3 deselected` (`benchmarks/results/x-2026-01-01/gpu.log`) then"
    index = ("<!-- generated by benchmarks/docs.py: results -->\n| folder | machine | what it holds | cited in |\n"
             "| --- | --- | --- | --- |\n| `gone-2025-01-01/` | a | b | c |\n<!-- end of generated: results -->\n")
    (tmp_path / "README.md").write_text("see `x-2026-01-01/`\n")
    table = script.results_index(index)
    assert "gone-2025-01-01" not in table
    assert "| `x-2026-01-01/` | (describe this folder) | (describe this folder) | README.md |" in table
    monkeypatch.setattr(script, "ROOT", ROOT)
    suites = script.suite_table()
    for name in ("quick", "decode", "generate", "text"):
        assert f"| `{name}` |" in suites


def test_the_docs_of_what_holds_now_quote_the_newest_log_of_its_name(tmp_path, monkeypatch):
    script = _docs_script()
    for folder in ("x-2026-01-01", "x-2026-02-01"):
        log = tmp_path / "benchmarks" / "results" / folder / "gpu-suite.log"
        log.parent.mkdir(parents=True)
        log.write_text("===== 7 passed in 1.00s =====\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("`7 passed` (`benchmarks/results/x-2026-02-01/gpu-suite.log`)\n")
    (tmp_path / "docs" / "contract.md").write_text("`7 passed` (`benchmarks/results/x-2026-01-01/gpu-suite.log`)\n")
    monkeypatch.setattr(script, "ROOT", str(tmp_path))
    assert script.older_quotes() == ["docs/contract.md quotes benchmarks/results/x-2026-01-01/gpu-suite.log, where "
                                     "benchmarks/results/x-2026-02-01/gpu-suite.log is newer"]


def test_each_probe_is_kept_with_its_use_or_recorded_as_removed():
    here = {f for f in os.listdir(os.path.join(ROOT, "benchmarks/diagnostics")) if f.endswith(".py")}
    text = open(os.path.join(ROOT, "benchmarks/diagnostics/README.md")).read().split("## Removed")[0]
    listed = set(re.findall(r"^\| `([\w.]+\.py)", text, re.M))
    assert here == listed, (here ^ listed)
    assert REMOVED and not REMOVED & here
