"""Scenario "models": real architectures from their configs, random weights, fp16, inputs on the GPU."""

import torch
from harness import Case

from graphwrap import GraphedModule
from graphwrap.capture import tuning

PEER = "torch.compile reduce-overhead"


def _builders(device):
    out = {}
    try:
        import torchvision

        def resnet50(bs):
            m = torchvision.models.resnet50().to(device).half().eval()
            return m, (torch.randn(bs, 3, 224, 224, device=device, dtype=torch.half),), {}
        out["torchvision resnet50"] = resnet50
    except ImportError:
        pass
    try:
        import transformers as tr

        def bert(bs):
            m = tr.BertModel(tr.BertConfig()).to(device).half().eval()
            ids = torch.randint(0, 30000, (bs, 128), device=device)
            return m, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def gpt2(bs):
            # use_cache=False: one forward pass per call, no cache object in the output
            m = tr.GPT2LMHeadModel(tr.GPT2Config(use_cache=False)).to(device).half().eval()
            return m, (), {"input_ids": torch.randint(0, 50000, (bs, 64), device=device)}
        out["transformers BertModel base, seq 128"] = bert
        out["transformers GPT2LMHeadModel, seq 64"] = gpt2
    except ImportError:
        pass
    return out


def _calls(fn, args, kwargs, calls):
    def loop():
        for _ in range(calls):
            fn(*args, **kwargs)
    return loop


def _tuned(gm, args, kwargs, calls):
    """``gm`` once its bucket is hot and the tuner has had it (the steady state of a server)."""
    for _ in range(tuning.HOT_CALLS + 4):
        gm(*args, **kwargs)
    gm.wait(600)
    return _calls(gm, args, kwargs, calls)


def _hand_graph(model, args, kwargs, calls):
    static_args = [a.clone() for a in args]
    static_kwargs = {k: v.clone() for k, v in kwargs.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(*static_args, **static_kwargs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(*static_args, **static_kwargs)

    def loop():
        for _ in range(calls):
            for d, a in zip(static_args, args):
                d.copy_(a)
            for k, v in kwargs.items():
                static_kwargs[k].copy_(v)
            g.replay()
    return loop


def run(results, device, quick: bool, repeats: int):
    calls = 10 if quick else 50
    for name, build in _builders(device).items():
        for bs in ((1,) if quick else (1, 16)):
            torch.manual_seed(0)
            model, args, kwargs = build(bs)
            case = Case(results, "models", f"{name}, bs {bs}", unit="ms", per=calls)
            with torch.no_grad():
                # Graphs captured by hand go last: torch.compile and graphwrap clear cuBLAS
                # workspaces when they capture (see fixed.py).
                torch._dynamo.reset()
                case.add(PEER, lambda: _calls(torch.compile(model, mode="reduce-overhead"), args, kwargs, calls))
                # compile=True: one compile for every bucket, then per-size kernels for the hot
                # bucket, kept if faster (timed once the tuner has had it; its cold start column
                # includes that).
                gmc = GraphedModule(model, compile=True)
                case.add("graphwrap GraphedModule(compile=True)", lambda: _tuned(gmc, args, kwargs, calls))
                # outputs="view": no copy of the outputs per call, the contract of torch.compile's
                # CUDA graphs (outputs overwritten by the next call).
                case.add("graphwrap GraphedModule(compile=True, outputs=view)",
                         lambda: _tuned(GraphedModule(model, compile=True, outputs="view"), args, kwargs, calls))
                case.add("graphwrap compile={static: False} (shared kernels only), outputs=view",
                         lambda: _calls(GraphedModule(model, compile={"static": False}, outputs="view"),
                                        args, kwargs, calls))
                case.add("graphwrap GraphedModule", lambda: _calls(GraphedModule(model), args, kwargs, calls))
                case.add("eager", lambda: _calls(model, args, kwargs, calls))
                case.add("hand-captured graph of eager", lambda: _hand_graph(model, args, kwargs, calls))
                case.run(repeats)
            s = gmc.stats()
            results.note("models", f"{name}, bs {bs}", "graphwrap compile=True: compile seconds",
                         s["compile"]["compile_s"], "s", compiled=s["compile"]["graphs"], off=s["compile"]["off"])
            results.note("models", f"{name}, bs {bs}", "graphwrap compile=True: graph pool MiB",
                         s["graph_pool_bytes"] / 2**20, "MiB")
            for size, b in s["keys"][0]["buckets"].items():
                if b["per_size_us"] is not None:
                    results.note("models", f"{name}, bs {bs}",
                                 f"graphwrap compile=True: bucket {size} replay, shared kernels", b["shared_us"], "us")
                    results.note("models", f"{name}, bs {bs}",
                                 f"graphwrap compile=True: bucket {size} replay, per-size kernels", b["per_size_us"],
                                 "us", kept=b["kernels"])
            model = case = gmc = None  # let go of this round's models and data before the next
            torch._dynamo.reset()
            torch.cuda.empty_cache()
