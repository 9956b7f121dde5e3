"""The delivery test after the alone tests, in one process: on a hang, the batch's and the outbox's state."""
import json
import sys
import threading
import time

sys.path.insert(0, "tests")
import test_generate_alone_cuda as alone
import torch
import transformers as tr

from graphwrap import GraphedModule
from graphwrap.decoding.callers.delivery import OUTBOX

skip_alone = len(sys.argv) > 1
if not skip_alone:
    for name in ("test_2000_requests_5_percent_bad_from_threads_and_tasks_each_end_alone_and_right",
                 "test_an_eos_outside_the_vocabulary_in_a_config_raises_no_device_assert",
                 "test_a_call_past_the_models_positions_is_refused_and_the_context_serves_on"):
        t0 = time.time(); getattr(alone, name)(); print(name[:40], f"{time.time() - t0:.1f} s", flush=True)
print("free MiB", torch.cuda.mem_get_info()[0] / 2**20, "allocated MiB", torch.cuda.memory_allocated() / 2**20, flush=True)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)
cfg = tr.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=101, n_positions=128, bos_token_id=1, eos_token_id=None, pad_token_id=0)
model = tr.AutoModelForCausalLM.from_config(cfg).to("cuda").eval()
gm = GraphedModule(model, decode={"rows": 8})
gate = threading.Event()
class Stuck:
    def put(self, value): gate.wait(60)
    def end(self): pass
stuck = [gm.submit_generate(torch.tensor([[5, 6, 7]], device="cuda"), max_new_tokens=30, do_sample=False, streamer=Stuck()) for _ in range(4)]
plain = gm.submit_generate(torch.tensor([[9, 10, 11, 12]], device="cuda"), max_new_tokens=20, do_sample=False)
try:
    plain.result(timeout=15); print("plain ended", flush=True)
except Exception as e:
    print("plain hung:", type(e).__name__, flush=True)
    s = gm.__dict__["_gw_decode"]
    sched = s.sched
    print("queue", len(sched.queue), "holders", [h is not None for h in sched.holders], "free rows", len(sched.free))
    if sched.pool is not None:
        pr = sched.pool.prefixes
        print("pool available", sched.pool.available, "blocks", s.cache.blocks, "short", sched.short,
              "prefix idle", None if pr is None else len(pr.idle))
    print("calls", [(c.done(), ) for c in stuck])
    print("outbox workers", OUTBOX.workers, "idle", OUTBOX.idle, "busy", len(OUTBOX.busy), "ready", len(OUTBOX.ready),
          "alive", sum(t.name == "graphwrap-deliver" for t in threading.enumerate()))
    for q in list(OUTBOX.ready):
        print(" ready box items", len(q.items), "scheduled", q.scheduled)
    print("decode stats", json.dumps({k: v for k, v in gm.stats()["decode"].items() if k in ("done", "failed", "cancelled", "queued", "rows_busy", "cache_blocks", "calls")}, default=str))
    print("captures", s.captures.running if s.captures else None, s.captures.serving if s.captures else None)
finally:
    gate.set()
print([f.result(timeout=30).shape for f in stuck])
gm.close()
