"""serve's start in phases, unprofiled: imports, load, the batch, then captures with each
capture's parts timed (wall clock, capture thread only)."""
import time

T0 = time.perf_counter()
import collections  # noqa: E402
import cProfile  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402


def mark(what):
    print(f"{time.perf_counter() - T0:8.2f} s  {what}", flush=True)

d = sys.argv[1]
import torch  # noqa: E402

mark("import torch")
import transformers  # noqa: E402

mark(f"import transformers {transformers.__version__}")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import graphwrap  # noqa: E402

mark("import graphwrap")  # (with transformers' auto classes, imported lazily on the line before)
from graphwrap.capture import checks, work  # noqa: E402
from graphwrap.capture import cuda as cmod  # noqa: E402
from graphwrap.capture import graph as gmod  # noqa: E402
from graphwrap.decoding.callers import front  # noqa: E402
from graphwrap.decoding.engine import captures as capmod  # noqa: E402

mark("import graphwrap's decoding")
torch.zeros(1, device="cuda"); torch.cuda.synchronize(); mark("cuda context")
tok = AutoTokenizer.from_pretrained(d, local_files_only=True); mark("tokenizer")
model = AutoModelForCausalLM.from_pretrained(d, dtype="auto", local_files_only=True); mark("from_pretrained (cpu)")
model = model.to("cuda").eval(); torch.cuda.synchronize(); mark(".to(cuda)")
gm = graphwrap.GraphedModule(model)
prof = cProfile.Profile(); prof.enable()
server, why = front.server_of(gm.__dict__, model)
torch.cuda.synchronize(); prof.disable(); mark(f"the batch made ({why})")
out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25); print(out.getvalue()[-5000:])

acc = collections.defaultdict(float); cnt = collections.Counter()
def timed(owner, name, label):
    f = getattr(owner, name)
    static = isinstance(getattr(owner, "__dict__", {}).get(name), staticmethod)
    @functools.wraps(f)
    def w(*a, **k):
        if threading.current_thread().name != "graphwrap-decode-capture":
            return f(*a, **k)
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t; cnt[label] += 1
    setattr(owner, name, staticmethod(w) if static else w)
timed(capmod.Captures, "_capture", "0 whole capture")
timed(capmod.Captures, "_twin", "1 twin")
timed(work, "capture_bucket", "2 capture_bucket")
timed(capmod.Captures, "_graph", "2a _graph (engine.call, facts, plan)")
timed(checks, "compare_leaves", "9 compare_leaves (any)")
timed(gmod, "_prepare", "2b _prepare")
timed(gmod.CudaRecorder, "watch_random", "3 reference run (dispatch mode, reads)")
timed(gmod, "_warm_up", "4 warm-up")
timed(gmod, "output_kinds", "5 output kinds")
timed(gmod.CudaRecorder, "record", "6 record (capture + instantiate)")
timed(gmod.CudaRecorder, "verify", "7 verify")
timed(gmod.Verifier, "_padded_positions", "7a verify: padded positions (eager)")
timed(gmod.Verifier, "_other_padding_rows", "7b verify: other padding rows")
timed(gmod.Verifier, "_replay", "7c verify: replays")
timed(work, "make_job", "8 make_job")
timed(cmod, "_record", "6a _record (begin..end)")
timed(torch.cuda.CUDAGraph, "capture_end", "6b capture_end (instantiate)")
t0 = time.perf_counter()
logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(message)s")
gm.capture_generate(); mark(f"captured {cnt['0 whole capture']} shapes")
for k in sorted(acc):
    print(f"{k:45s} {cnt[k]:5d} calls {acc[k]:8.2f} s  {1e3 * acc[k] / max(1, cnt['0 whole capture']):7.1f} ms a shape")
mark("done")
