"""An asyncio server: coroutines await ``batcher.acall``, no thread per request.

    python examples/async_server.py

Text of every length: each request is a few sentences of token ids with its own length, and
``seq_dim=1`` pads them to a sequence bucket (outputs come back at each request's length), so
requests of different lengths are joined into one call. On a machine without CUDA the module
runs eagerly. Prints one line: requests, module calls, and whether every answer equals eager.
"""

import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphwrap  # noqa: E402

CLIENTS, REQUESTS, VOCAB = 32, 20, 1000


class TinyEncoder(nn.Module):
    """Embeddings, one transformer layer that ignores padded positions, a projection per token."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.out = nn.Linear(64, 16)

    def forward(self, input_ids, attention_mask):
        h = self.layer(self.emb(input_ids), src_key_padding_mask=attention_mask == 0)
        return self.out(h)


async def client(i, batcher, model, device, wrong):
    g = torch.Generator().manual_seed(i)
    for _ in range(REQUESTS):
        rows, length = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(3, 60, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (rows, length), generator=g).to(device)
        mask = torch.ones_like(ids)
        y = await batcher.acall(input_ids=ids, attention_mask=mask)
        with torch.no_grad():
            if y.shape != (rows, length, 16) or not torch.allclose(y, model(ids, mask), rtol=1e-3, atol=1e-4):
                wrong.append(i)


async def serve(batcher, model, device, wrong):
    await asyncio.gather(*(client(i, batcher, model, device, wrong) for i in range(CLIENTS)))


def main() -> int:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyEncoder().to(device).eval()
    batcher = graphwrap.Batcher(graphwrap.GraphedModule(model, seq_dim=1), max_delay_ms=2)
    wrong = []
    t0 = time.perf_counter()
    asyncio.run(serve(batcher, model, device, wrong))
    took = time.perf_counter() - t0
    batcher.close()
    s = batcher.stats()
    print(f"asyncio server on {device}: {s['requests']} requests of lengths 3..59 from {CLIENTS} coroutines in "
          f"{took:.2f} s, {s['module_calls']} module calls, answers equal eager: {not wrong}")
    return 0 if not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
