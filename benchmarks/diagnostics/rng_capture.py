"""Whether capturing draws from the CUDA random generator: the generator's offset around a graph
captured by hand, a GraphedModule's first (capturing) call and later calls, and generate."""
import torch
import transformers as tr

import graphwrap


def offset():
    s = torch.cuda.get_rng_state()
    return int(s[8:16].view(torch.int64)), s


def show(what, fn):
    before, _ = offset()
    out = fn()
    torch.cuda.synchronize()
    after, _ = offset()
    print(f"{what}: offset {before} -> {after}", flush=True)
    return out


torch.manual_seed(0)
lin = torch.nn.Linear(64, 64).cuda().eval()
x = torch.randn(8, 64, device="cuda")


def by_hand():
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lin(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lin(x)
    g.replay()


with torch.no_grad():
    show("graph captured by hand, replayed", by_hand)
    gm = graphwrap.GraphedModule(lin)
    show("gm first call (captures)", lambda: gm(x))
    show("gm second call", lambda: gm(x))
    show("gm new bucket (captures)", lambda: gm(torch.randn(3, 64, device="cuda")))
    cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=8, n_positions=256, bos_token_id=1,
                        eos_token_id=[5, 6], pad_token_id=0)
    model = tr.GPT2LMHeadModel(cfg).cuda().eval()
    ids = torch.randint(1, 5, (1, 4), device="cuda")
    kw = dict(input_ids=ids, max_new_tokens=20, do_sample=False, cache_implementation="static")
    show("model.generate greedy", lambda: model.generate(**kw, disable_compile=True))
    g2 = graphwrap.GraphedModule(model)
    show("gm.generate greedy, first", lambda: g2.generate(**kw))
    show("gm.generate greedy, second", lambda: g2.generate(**kw))
    kw["do_sample"] = True
    g3 = graphwrap.GraphedModule(model)
    for i in range(3):
        torch.manual_seed(0)
        w = show("model.generate sampled", lambda: model.generate(**kw, disable_compile=True))
        torch.manual_seed(0)
        g = show(f"gm.generate sampled, call {i}", lambda: g3.generate(**kw))
        print("  equal", torch.equal(w, g), w.tolist(), g.tolist(), flush=True)
