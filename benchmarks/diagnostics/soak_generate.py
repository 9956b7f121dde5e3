"""Memory over many generations through the shared batch: ``--requests`` (10,000) from 64 client
threads in a closed loop (prompts 16..256 and 8..32 new tokens from a fixed seed, greedy, no
end-of-sequence token) on a 7-8B shape (fp16, random weights; ``--model tiny``: a small fp32
Llama on any device, to try the script). Printed after the first tenth and at the end: GPU
memory allocated and reserved, the pool's blocks in use and free, the process's resident memory;
every answer's length is checked (its prompt and all its new tokens).

``python3 benchmarks/diagnostics/soak_generate.py [--model llama2-7b] [--requests 10000]`` from
the repository root.
"""

import argparse
import os
import sys
import threading
import time

import torch

sys.path.insert(0, "benchmarks")

from graphwrap import GraphedModule  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tiny(device):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=101, max_position_embeddings=512, pad_token_id=0,
                                   eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def state(gm, device) -> str:
    d = gm.stats()["decode"]
    gpu = (f"GPU allocated {torch.cuda.memory_allocated() / 2**20:,.0f} MiB, reserved "
           f"{torch.cuda.memory_reserved() / 2**20:,.0f} MiB; " if device.type == "cuda" else "")
    return f"{gpu}blocks {d['cache_blocks']}; resident {rss_mib():,.0f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=64)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.model == "tiny":
        model = tiny(device)
    else:
        from generate_large import big_model

        model = big_model(a.model, device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    reqs = [(torch.randint(3, vocab, (1, int(torch.randint(16, 257, (), generator=g))), generator=g),
             int(torch.randint(8, 33, (), generator=g))) for _ in range(a.requests)]
    print(f"soak_generate {a.model}: {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch "
          f"{torch.__version__}, {a.requests} requests from {a.clients} threads", flush=True)
    gm = GraphedModule(model)
    lock, nxt, bad, done = threading.Lock(), [0], [], [0]
    tenth = max(1, a.requests // 10)

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= a.requests:
                return
            ids, new = reqs[i]
            out = gm.generate(input_ids=ids.to(device), max_new_tokens=new, do_sample=False)
            ok = out.shape == (1, ids.shape[1] + new) and torch.equal(out[0, :ids.shape[1]].cpu(), ids[0])
            with lock:
                if not ok:
                    bad.append(i)
                done[0] += 1
                if done[0] == tenth:
                    print(f"after {tenth} requests: {state(gm, device)}", flush=True)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    new = sum(n for _, n in reqs)
    print(f"after {a.requests} requests ({took:.1f} s, {new / took:,.0f} new tokens/s): {state(gm, device)}",
          flush=True)
    print(f"answers of the wrong length or prompt: {len(bad)}", flush=True)
    gm.close()


if __name__ == "__main__":
    main()
