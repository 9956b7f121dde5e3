"""compile= over a static KV cache: whether the compiled kernels inside the decode graphs give
eager's tokens. GPT-2 (a small config; with the argument ``full``, its base config in fp16, batch 8,
a 32-token prompt and 128 new tokens) generates with compile=True, in a
child process with CUDA_LAUNCH_BLOCKING=1; every forward outside a capture logs the cache's
position, and the child's traceback is printed."""
import os
import subprocess
import sys

CHILD = r'''
import logging, torch, transformers as tr
import graphwrap
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
FULL = FULL_FLAG
cfg = tr.GPT2Config() if FULL else tr.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000,
                                                 n_positions=256, bos_token_id=1, eos_token_id=None)
cfg.pad_token_id = 0
torch.manual_seed(0)
model = tr.GPT2LMHeadModel(cfg).cuda().eval()
if FULL:
    model = model.half()
calls = []
def pre(mod, args, kwargs):
    cache = kwargs.get("past_key_values")
    if cache is not None and not torch.cuda.is_current_stream_capturing() and cache.layers[0].is_initialized:
        ids = kwargs.get("input_ids")
        calls.append((tuple(ids.shape) if ids is not None else None, int(cache.layers[0].cumulative_length)))
        if len(calls) > 20:
            return
        print("forward", calls[-1], "stream", torch.cuda.current_stream().stream_id, flush=True)
model.register_forward_pre_hook(pre, with_kwargs=True)
gm = graphwrap.GraphedModule(model, compile=True)
ids = torch.randint(2, 1000, (8 if FULL else 2, 32 if FULL else 10), device="cuda")
kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=128 if FULL else 12, do_sample=False,
          cache_implementation="static")
with torch.no_grad():
    want = model.generate(**kw, disable_compile=True)
    got = gm.generate(**kw)
torch.cuda.synchronize()
same = float((got == want).float().mean()) if got.shape == want.shape else 0.0
print("tokens equal to eager's:", f"{same:.1%}", "eager calls", gm.stats()["eager_calls"])
'''

env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
full = "full" in sys.argv[1:]
r = subprocess.run([sys.executable, "-c", CHILD.replace("FULL_FLAG", str(full))], env=env, capture_output=True, text=True, timeout=400)
print("rc", r.returncode)
print("\n".join((r.stdout + r.stderr).splitlines()[-120:]))
