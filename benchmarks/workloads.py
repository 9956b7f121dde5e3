"""The seed notebook's model and loops, and the hand-written references graphwrap must beat."""

import torch
from torch import nn


class SeedMLP(nn.Module):
    """The seed's model: 1024 -> hidden -> hidden -> hidden -> 512, ReLU between, fp32."""

    def __init__(self, d_in=1024, hidden=1024, d_out=512):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, d_out),
        )

    def forward(self, x):
        return self.layers(x)


def sync_loop(model, cpu_data, device):
    """The seed's baseline: a blocking copy, then the forward."""
    def loop():
        for data in cpu_data:
            model(data.to(device))
    return loop


def stream_loop(model, cpu_data, device):
    """The seed's stream version (its ordered variant: compute waits for the copy stream)."""
    compute, copy = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def loop():
        with torch.cuda.stream(copy):
            x = cpu_data[0].to(device, non_blocking=True)
        for i in range(len(cpu_data)):
            compute.wait_stream(copy)
            with torch.cuda.stream(compute):
                model(x)
            if i + 1 < len(cpu_data):
                with torch.cuda.stream(copy):
                    x = cpu_data[i + 1].to(device, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(compute)
    return loop


def capture(model, static_input, warmup=3, pool=None):
    """A graph of ``model`` on ``static_input`` (warmed up on a side stream first), and its output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            model(static_input)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = model(static_input)
    return g, out


def graph_loop(model, cpu_data, device):
    """The seed's graph version: a blocking copy into the static input, then a replay."""
    static = torch.randn(cpu_data[0].shape, device=device)
    g, _ = capture(model, static)

    def loop():
        for data in cpu_data:
            static.copy_(data)
            g.replay()
    return loop


def double_buffered_loop(model, cpu_data, device):
    """Hand-written: two static inputs with a graph each, copies on a copy stream, event waits."""
    statics = [torch.randn(cpu_data[0].shape, device=device) for _ in range(2)]
    pool = torch.cuda.graph_pool_handle()
    graphs = [capture(model, st, pool=pool)[0] for st in statics]
    copy = torch.cuda.Stream(device)
    copied = [torch.cuda.Event(), torch.cuda.Event()]
    replayed = [torch.cuda.Event(), torch.cuda.Event()]
    compute = torch.cuda.current_stream(device)

    def loop():
        for e in replayed:
            e.record(compute)
        for i, data in enumerate(cpu_data):
            k = i & 1
            copy.wait_event(replayed[k])
            with torch.cuda.stream(copy):
                statics[k].copy_(data, non_blocking=True)
                copied[k].record(copy)
            compute.wait_event(copied[k])
            graphs[k].replay()
            replayed[k].record(compute)
    return loop


def replay_floor(model, cpu_data, device):
    """Floor: the graph's replays alone, no copies."""
    static = torch.randn(cpu_data[0].shape, device=device)
    g, _ = capture(model, static)

    def loop():
        for _ in range(len(cpu_data)):
            g.replay()
    return loop


def copy_floor(cpu_data, device):
    """Floor: the host-to-device copies alone, back to back on one stream."""
    static = torch.empty(cpu_data[0].shape, device=device)

    def loop():
        for data in cpu_data:
            static.copy_(data, non_blocking=True)
    return loop


def d2h_floor(shape, count, device):
    """Floor: the device-to-host copies of the outputs alone, into pinned memory."""
    src = torch.randn(shape, device=device)
    dst = torch.empty(shape, pin_memory=True)

    def loop():
        for _ in range(count):
            dst.copy_(src, non_blocking=True)
    return loop


def chunk_floor(model, cpu_data, device, chunk=256):
    """Floor of chunked replays: a graph of ``chunk`` rows replayed once per chunk, no copies."""
    rows = cpu_data[0].shape[0]
    static = torch.randn((chunk,) + tuple(cpu_data[0].shape[1:]), device=device)
    g, _ = capture(model, static)
    per_batch = -(-rows // chunk)

    def loop():
        for _ in range(len(cpu_data) * per_batch):
            g.replay()
    return loop
