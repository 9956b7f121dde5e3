"""What a new shape costs PyTorch's fused attention on this GPU: ``scaled_dot_product_attention``
timed on its first call at a key length it has not seen and again at the same length, for a
piece of a prompt (128 queries, an additive mask) and a step (1 query, with and without a mask),
fp16, 32 heads of 128; once with torch's default choice of kernel (which backend it picks is
printed) and once with the cuDNN backend turned off.

``python3 benchmarks/diagnostics/sdpa_shapes.py`` from the repository root, on a GPU.
"""

import time

import torch
from torch.nn import functional as F

DEV = torch.device("cuda")
NAMES = {int(v): k for k, v in torch.nn.attention.SDPBackend.__members__.items()}


def timed(f) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def main():
    print(f"sdpa_shapes: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}", flush=True)
    F.scaled_dot_product_attention(*(torch.randn(1, 32, 8, 128, device=DEV, dtype=torch.half) for _ in range(3)))
    base = 1000
    for label, cudnn in (("default", True), ("cuDNN off", False)):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for q_len, masked in ((128, True), (1, True), (1, False)):
            firsts, agains = [], []
            for i in range(6):
                end = base + 8 * i + 1
                q = torch.randn(1, 32, q_len, 128, device=DEV, dtype=torch.half)
                k, v = (torch.randn(1, 32, end, 128, device=DEV, dtype=torch.half) for _ in range(2))
                mask = torch.zeros(1, 1, q_len, end, device=DEV, dtype=torch.half) if masked else None
                choice = NAMES.get(torch._fused_sdp_choice(q, k, v, mask), "?")
                firsts.append(timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
                agains.append(timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))
            base += 100
            print(f"  {label:9s} queries {q_len:3d} {'masked' if masked else 'no mask'}: picks {choice}; "
                  f"first call at a new key length {sorted(firsts)[3]:.2f} ms (median of 6; "
                  f"{min(firsts):.2f}-{max(firsts):.2f}), again {sorted(agains)[3]:.3f} ms", flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)


if __name__ == "__main__":
    main()
