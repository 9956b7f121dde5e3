"""Names a package exports, imported on first use (PEP 562).

``python -m graphwrap serve`` starts its engine process before this process imports torch,
FastAPI or the model's libraries (they would delay the child's start by seconds); a package
``__init__`` that imported its exports eagerly would import them all first.
"""

import importlib
import sys
from typing import Callable, Dict, List, Tuple


def exports(package: str, names: Dict[str, Tuple[str, str]]) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``names`` map each exported name to
    ``(module, attribute)``, the module relative to the package; each is imported on first use
    and kept in the package's namespace from then on."""

    def __getattr__(name: str) -> object:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[0], package), where[1])
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
