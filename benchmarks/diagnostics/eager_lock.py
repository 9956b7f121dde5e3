"""Why is eager BERT-base slow behind a lock shared by many threads? Requests/s and the time each
call holds the lock, for 1 to 64 client threads (each warmed up before the clock), in one process.

``python benchmarks/diagnostics/eager_lock.py``
"""

import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402
from text import workload  # noqa: E402


def run(model, requests, clients, seconds=3.0, switch=None):
    lock = threading.Lock()
    held, done = [], [0]
    stop = [float("inf")]
    go = threading.Barrier(clients + 1)

    def client(i):
        r0 = requests[i % len(requests)]
        with torch.no_grad():
            model(**r0)
            go.wait()
            k = i
            while time.perf_counter() < stop[0]:
                r = requests[k % len(requests)]
                k += clients
                with lock:
                    t0 = time.perf_counter()
                    model(**r)
                    held.append(time.perf_counter() - t0)
                    done[0] += 1

    old = sys.getswitchinterval()
    if switch is not None:
        sys.setswitchinterval(switch)
    ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in ts:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    stop[0] = t0 + seconds
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    sys.setswitchinterval(old)
    return done[0] / wall, 1e3 * statistics.median(held), 1e3 * max(held)


def main():
    cfg = transformers.BertConfig()
    model = transformers.BertModel(cfg).cuda().half().eval()
    requests = workload(cfg.vocab_size, "cuda", 300)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    with torch.no_grad():
        t0 = time.perf_counter()
        for r in requests:
            model(**r)
        torch.cuda.synchronize()
        print(f"one thread, no lock: {300 / (time.perf_counter() - t0):.0f} req/s")
    for clients in (1, 2, 4, 16, 64):
        rps, med, worst = run(model, requests, clients)
        print(f"{clients:3d} threads behind a lock: {rps:7.0f} req/s, a call holds the lock median {med:6.2f} ms, "
              f"longest {worst:7.1f} ms", flush=True)
    rps, med, worst = run(model, requests, 64, switch=0.0005)
    print(f" 64 threads, switch interval 0.5 ms: {rps:7.0f} req/s, median {med:6.2f} ms, longest {worst:7.1f} ms")


if __name__ == "__main__":
    main()
