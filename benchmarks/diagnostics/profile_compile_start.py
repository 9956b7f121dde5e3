"""Where the time of compile_start's rows goes: a row run under cProfile up to "ready" (no
per-call timing, no tuning), then the functions with the most cumulative time."""

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import compile_start as cs  # noqa: E402

SHOW = r'''
import pstats
st = pstats.Stats(PROF)
st.sort_stats("cumulative").print_stats(45)
st.sort_stats("tottime").print_stats(25)
'''


def profile(name, kind, kw, cache_dir, out_dir):
    code = cs.row_code(kind, kw, ready_only=True)
    src = os.path.join(out_dir, f"{name}.py")
    prof = os.path.join(out_dir, f"{name}.prof")
    with open(src, "w") as f:
        f.write(code)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    r = subprocess.run([sys.executable, "-m", "cProfile", "-o", prof, src], env=env, capture_output=True,
                       text=True, timeout=900)
    print(f"== {name}: rc {r.returncode}", [ln for ln in r.stdout.splitlines() if ln.startswith("ROW")],
          r.stderr.strip().splitlines()[-1:] if r.returncode else "", flush=True)
    s = subprocess.run([sys.executable, "-c", SHOW.replace("PROF", repr(prof))], capture_output=True, text=True)
    print(s.stdout, flush=True)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    tmp = tempfile.mkdtemp(prefix="graphwrap-prof-")
    cache = os.path.join(tmp, "bert.bin")
    profile("six-buckets-saving-cache", "graphwrap", {"compile": {"cache": cache, "static": False}, "max_batch_size": 32},
            os.path.join(tmp, "i1"), out)
    profile("six-buckets-cache-loaded", "graphwrap", {"compile": {"cache": cache, "static": False}, "max_batch_size": 32},
            os.path.join(tmp, "i2"), out)
