"""``python -m graphwrap``: the version, what this machine offers, and the benchmarks.

    python -m graphwrap --version
    python -m graphwrap env                 # versions and devices: will graphs be used here?
    python -m graphwrap bench [--quick] ... # benchmarks/run.py of a source checkout, same options
    python -m graphwrap serve MODEL [...]   # an OpenAI-compatible server (python -m graphwrap serve --help)
"""

import argparse
import os
import platform
import runpy
import sys
from typing import List, Optional

from . import __version__


def _env() -> int:
    import torch

    from ._compat import cuda_available

    print(f"graphwrap {__version__}, torch {torch.__version__}, Python {platform.python_version()}")
    if not cuda_available():
        print("CUDA: not available. GraphedModule runs every call eagerly here (same answers, no graphs); "
              "install a CUDA build of torch on a machine with an NVIDIA GPU to use graphs.")
        return 0
    print(f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} device(s)")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i}  {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
    return 0


def _bench(args: List[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(os.path.dirname(here), "benchmarks", "run.py")
    if not os.path.isfile(script):
        print("graphwrap bench runs benchmarks/run.py of a source checkout, and this graphwrap was installed "
              "without one: clone the repository and install it with pip install -e .", file=sys.stderr)
        return 2
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # its options, --help included, are the benchmarks'
        return _bench(argv[1:])
    if argv[:1] == ["serve"]:
        from .serve.api.cli import main as serve

        return serve(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m graphwrap", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[2:]))
    ap.add_argument("--version", action="version", version=f"graphwrap {__version__}")
    ap.add_argument("command", nargs="?", choices=("env", "bench", "serve"), help="env: versions and devices; "
                    "bench: the benchmarks (python -m graphwrap bench --help for their options); "
                    "serve: an OpenAI-compatible server (python -m graphwrap serve --help)")
    a = ap.parse_args(argv)
    if a.command == "env":
        return _env()
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
