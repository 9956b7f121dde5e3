"""The CUDA generator beside captures: a 64-thread Batcher load, lazy captures of two modules
from two threads beside drawing threads, 64 asyncio clients drawing their requests; after each
phase, whether the generator is usable; at the end, 1,000 draws."""
import asyncio
import random
import sys
import threading

sys.path.insert(0, ".")
import torch
import torch.nn as nn

import graphwrap

dev = torch.device("cuda")
def mlp(w=256):
    return nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, w)).to(dev).eval()
fails = {"draw": 0, "draws": 0}
def drawer(stop, tag):
    while not stop.is_set():
        try:
            torch.randn(4, 4, device=dev); fails["draws"] += 1
        except RuntimeError as e:
            fails["draw"] += 1
            if fails["draw"] <= 3: print(tag, "draw failed:", str(e).splitlines()[0], flush=True)
def usable():
    try:
        torch.randn(2, device=dev); torch.cuda.synchronize(); return True
    except RuntimeError as e:
        print("STUCK:", str(e).splitlines()[0], flush=True); return False
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
for r in range(rounds):
    # 1. a 64-thread Batcher load
    gm = graphwrap.GraphedModule(mlp()); b = graphwrap.Batcher(gm)
    def client(i):
        rr = random.Random(i)
        for _ in range(20):
            b(torch.randn(rr.randint(1, 8), 256, device=dev))
    ts = [threading.Thread(target=client, args=(i,)) for i in range(64)]; [t.start() for t in ts]; [t.join() for t in ts]
    b.close()
    ok1 = usable()
    # 2. lazy captures of a new GraphedModule beside a drawing thread; two modules from two threads
    stop = threading.Event(); d = [threading.Thread(target=drawer, args=(stop, f"r{r}")) for _ in range(2)]
    [t.start() for t in d]
    def lazy(seed):
        g2 = graphwrap.GraphedModule(mlp())
        with torch.no_grad():
            for n in random.Random(seed).sample(range(1, 200), 25):
                g2(torch.ones(n, 256, device=dev))
    ts = [threading.Thread(target=lazy, args=(r * 10 + k,)) for k in range(2)]; [t.start() for t in ts]; [t.join() for t in ts]
    stop.set(); [t.join() for t in d]
    ok2 = usable()
    # 3. 64 asyncio clients of a Batcher, requests made with torch.randn on the GPU
    gm3 = graphwrap.GraphedModule(mlp()); b3 = graphwrap.Batcher(gm3)
    async def main():
        async def one(i):
            for _ in range(10):
                await b3.acall(torch.randn(random.randint(1, 8), 256, device=dev))
        await asyncio.gather(*(one(i) for i in range(64)))
    try:
        asyncio.run(main())
        ok3 = True
    except RuntimeError as e:
        print("asyncio phase failed:", str(e).splitlines()[0], flush=True); ok3 = False
    b3.close()
    ok3 = ok3 and usable()
    print(f"round {r}: usable after load {ok1}, after lazy captures {ok2}, after asyncio {ok3}; drawer failures "
          f"{fails['draw']} of {fails['draws'] + fails['draw']}", flush=True)
bad = 0
for _ in range(1000):
    try:
        torch.randn(4, 4, device=dev)
    except RuntimeError:
        bad += 1
print("final 1000 draws failed:", bad)
