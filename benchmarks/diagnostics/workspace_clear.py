"""Whether torch._C._cuda_clearCublasWorkspaces frees other threads' cuBLAS workspaces, whether
destroying a graph frees its capture stream's, and whether clearing beside threads that run
matrix products corrupts their results (why graphwrap never clears them)."""
import os
import subprocess
import threading
import time

import torch

print("torch", torch.__version__, torch.cuda.get_device_name())
print("bindings:", [n for n in dir(torch._C) if "ublas" in n.lower() or "orkspace" in n])
lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so")
out = subprocess.run(f"nm -D --defined-only {lib} | grep -i -E 'clearCublasWorkspaces|WorkspaceForStream'", shell=True,
                     capture_output=True, text=True).stdout
print("symbols:", out.strip() or "none")
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False
# 1. global or per thread?
a = torch.randn(256, 256, device=dev)
ready, go = threading.Event(), threading.Event()
def other():
    (a @ a).sum().item(); ready.set(); go.wait()
t = threading.Thread(target=other); t.start(); ready.wait(); torch.cuda.synchronize()
m0 = torch.cuda.memory_allocated()
torch._C._cuda_clearCublasWorkspaces()
m1 = torch.cuda.memory_allocated()
go.set(); t.join()
print(f"clear from main thread freed {(m0 - m1) / 2**20:.1f} MiB of another thread's workspaces")
# 2. graph destroyed -> its capture stream's workspace cleared?
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    (a @ a); torch.cuda.synchronize()
    m0 = torch.cuda.memory_allocated()
    g = torch.cuda.CUDAGraph()
    g.capture_begin(); b = a @ a; g.capture_end()
    torch.cuda.synchronize(); m1 = torch.cuda.memory_allocated()
    del g, b; torch.cuda.synchronize(); m2 = torch.cuda.memory_allocated()
print(f"graph on a stream with a workspace: after capture {(m1 - m0) / 2**20:+.1f} MiB, after del {(m2 - m0) / 2**20:+.1f} MiB")
# 3. race: 8 threads GEMM + compare while one thread clears
W = [torch.randn(512, 512, device=dev) for _ in range(4)]
X = torch.randn(64, 512, device=dev)
REF = []
for w in W:
    REF.append(torch.tanh(X @ w) @ w.t())
torch.cuda.synchronize()
def run(clear, secs=8.0):
    stop = threading.Event(); bad = [0]; n = [0]
    def worker(i):
        k = 0
        while not stop.is_set():
            w = W[k % 4]; ref = REF[k % 4]
            y = torch.tanh(X @ w) @ w.t()
            z = torch.empty(64, 512, device=dev).fill_(1.0)  # a fresh allocation written between GEMMs
            if not torch.equal(y, ref) or not bool((z == 1).all()):
                bad[0] += 1
            n[0] += 1; k += 1
    def clearer():
        while not stop.is_set():
            torch._C._cuda_clearCublasWorkspaces(); time.sleep(0.0002)
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    if clear: ts.append(threading.Thread(target=clearer))
    [x.start() for x in ts]; time.sleep(secs); stop.set(); [x.join() for x in ts]
    return bad[0], n[0]
print("no clears:      wrong %d of %d" % run(False))
print("clears beside:  wrong %d of %d" % run(True))
