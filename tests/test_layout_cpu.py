"""The house's own rules, read from the source: no module imports one that imports it back, no
class over 400 lines nor function over 60, and no branch on a value being a plain string where a
typed reason belongs."""

import ast
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "graphwrap"


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, ast.parse(path.read_text())


def _target(name: str, path: pathlib.Path, level: int, module) -> str:
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[: len(package) - level + 1]
    return ".".join(base + ([module] if module else []))


def _imports():
    """Module -> the graphwrap modules it imports, at module level or inside a function (an import
    deferred into a function still ties the two modules into one)."""
    mods = {name: (path, tree) for name, path, tree in _modules()}
    graph = {}
    for name, (path, tree) in mods.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                target = _target(name, path, node.level, node.module)
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                deps.update(subs or ([target] if target in mods else []))
        graph[name] = deps
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = _imports()
    assert "graphwrap.core.engine" in graph and graph["graphwrap.core.engine"], "the import graph was not read"
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("an import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_class_over_400_lines_and_no_function_over_60():
    long = []
    for name, _path, tree in _modules():
        for node in ast.walk(tree):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > 400:
                long.append(f"class {name}.{node.name}: {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 60:
                long.append(f"function {name}.{node.name}: {size} lines")
    assert not long, long


def test_no_branch_on_a_plain_string_type():
    # Why a call runs eagerly is a core.reasons.Eager, told apart by its own type; a check of
    # ``type(x) is str`` would mean a reason travels as bare words again.
    found = []
    for name, path, tree in _modules():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call)
                    and getattr(node.left.func, "id", None) == "type"
                    and any(isinstance(c, ast.Name) and c.id == "str" for c in node.comparators)):
                found.append(f"{os.path.relpath(path, ROOT.parent)}:{node.lineno}")
    assert not found, found
