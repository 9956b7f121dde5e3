"""Timeline of a compile_start row that saves the compile cache and of one that loads it:
graphwrap's log per bucket and dynamo's compile-time breakdown."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, "benchmarks")
import compile_start as cs

tmp = tempfile.mkdtemp(); cache = os.path.join(tmp, "bert.bin")
for name, d in (("save", "i1"), ("load", "i2")):
    code = cs.row_code("graphwrap", {"compile": {"cache": cache, "static": False}, "max_batch_size": 32},
                       ready_only=True)
    code = code.replace("t0 = time.perf_counter()\nwith torch.no_grad():", "import logging; logging.basicConfig(level=logging.INFO, format='%(relativeCreated)d %(name)s %(message)s'); logging.getLogger('torch').setLevel(logging.WARNING)\nimport torch._dynamo, torch._inductor.compile_fx\nlogging.getLogger('graphwrap').info('t0'); t0 = time.perf_counter()\nwith torch.no_grad():")
    code += "\nprint(torch._dynamo.utils.compile_times(repr='str', aggregate=True))\n"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, d))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    print("=====", name, r.returncode)
    print("\n".join(ln for ln in (r.stdout + r.stderr).splitlines() if "graphwrap" in ln or "ROW" in ln or "t0" in ln or ln.startswith(("Function", " ", "_compile", "compile", "inductor", "fx_", "aot", "async", "Triton", "PyCode", "cuda", "create", "Guard")) )[-4000:])
