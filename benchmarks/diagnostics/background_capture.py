"""A background capture beside 8 calling threads, every answer checked: rounds of it.

capture(sample, background=True) on a 40-layer residual MLP (width 256, fp32, TF32 off) while 8
threads call gm(x) with 1..256 rows, each answer compared with the module's own. Before the
capture streams kept their own cuBLAS workspaces (graphwrap cleared every thread's around each
capture), an H100 gave wrong answers in some rounds and, in one process, device-side asserts.
Run from the project root: python3 benchmarks/diagnostics/background_capture.py [rounds]
"""
import random
import sys
import threading

import torch
import torch.nn as nn

sys.path.insert(0, ".")  # the project root
import graphwrap  # noqa: E402

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False


class Deep(nn.Module):
    def __init__(self, width=256, layers=40):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for lin in self.layers:
            x = x + torch.tanh(lin(x))
        return x


torch.manual_seed(0)
XD = torch.randn(4096, 256, device=dev)
torch.cuda.synchronize()
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for rnd in range(rounds):
    m = Deep().to(dev).eval()
    gm = graphwrap.GraphedModule(m)
    gm.capture(XD[:8].clone(), background=True)
    done = threading.Event()
    lock = threading.Lock()
    stats = {"ok": 0, "wrong": 0, "err": 0, "first": None}

    def caller(i):
        r = random.Random(300 + 10 * rnd + i)
        extra = 0
        with torch.no_grad():
            while extra < 20:
                if done.is_set():
                    extra += 1
                n = r.randint(1, 256)
                o = r.randint(0, XD.shape[0] - n)
                x = XD[o:o + n].clone()
                try:
                    y = gm(x)
                    ref = m(x)
                    e = ((y - ref).norm() / ref.norm().clamp_min(1e-12)).item()
                    with lock:
                        if e > 1e-4:
                            stats["wrong"] += 1
                            stats["first"] = stats["first"] or f"rel err {e:.1e} at {n} rows"
                        else:
                            stats["ok"] += 1
                except Exception as ex:  # noqa: BLE001
                    with lock:
                        stats["err"] += 1
                        stats["first"] = stats["first"] or repr(ex)[:100]
    ts = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(8)]
    [t.start() for t in ts]
    ok = gm.wait(timeout=90)
    done.set()
    [t.join(60) for t in ts]
    print(f"round {rnd}: wait {ok}; {stats}", flush=True)
    if stats["err"]:
        break
