"""gm.generate of this graphwrap beside an earlier one, in one process: end to end for 128 new
tokens and for one (the prompt alone), batch 1 and 8, with the step captured by hand and
transformers' compiled static ``generate`` beside them; rounds interleaved, medians with min and
max, and ms a token from the medians. Also this graphwrap with its kept step inputs turned off
(each step the direct call's way: what the logits processors' change alone gives).

``python benchmarks/diagnostics/decode_before_after.py PATH [MODEL ...]``: PATH holds the earlier
package as ``graphwrap_before/`` (as for ``before_after.py``); MODEL is one of ``decode.py``'s
(gpt2, llama, mistral, whisper; default gpt2). ``GW_NO_COMPILED=1`` leaves out the compiled
``generate`` (its first call compiles for a minute or more a batch size); ``GW_REVERSED=1`` times
the strategies in the other order in each round.
"""

import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else ".old")
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import decode  # noqa: E402
import graphwrap_before  # noqa: E402

import graphwrap  # noqa: E402
from graphwrap.loops import decode as loop  # noqa: E402


@contextlib.contextmanager
def direct_steps():
    """This graphwrap's loop with every step through the direct call (no kept inputs)."""
    kept = loop._StepInputs.kept
    loop._StepInputs.kept = property(lambda self: False)
    try:
        yield
    finally:
        loop._StepInputs.kept = kept


def _strategies(model, batch):
    g = torch.Generator().manual_seed(batch)
    seq2seq = model.config.is_encoder_decoder
    if seq2seq:
        features = torch.randn(batch, model.config.num_mel_bins, 3000, generator=g).to("cuda").half()
        inputs = dict(input_features=features)
        hand = decode._by_hand_seq2seq(model, features, decode.NEW)
    else:
        ids = torch.randint(3, model.config.vocab_size, (batch, decode.PROMPT), generator=g).to("cuda")
        inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
        hand = decode._by_hand(model, ids, decode.NEW)

    def kw(n):
        return dict(inputs, do_sample=False, max_new_tokens=n, **(dict(min_new_tokens=n) if seq2seq else {}))

    after, before = graphwrap.GraphedModule(model), graphwrap_before.GraphedModule(model)

    def after_direct(n):
        with direct_steps():
            return after.generate(**kw(n), cache_implementation="static")

    fns = {"after": lambda n: after.generate(**kw(n), cache_implementation="static"),
           "before": lambda n: before.generate(**kw(n), cache_implementation="static"),
           "after, steps direct": after_direct,
           "by hand": hand}
    if os.environ.get("GW_NO_COMPILED") != "1":
        fns["compiled generate"] = lambda n: model.generate(**kw(n), cache_implementation="static")
    if os.environ.get("GW_REVERSED") == "1":  # the other order in each round: an effect of the order shows
        fns = dict(reversed(list(fns.items())))
    return fns


def main(models, rounds=7):
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    for name in models:
        model = decode._model(name, "cuda")
        for batch in (1, 8):
            fns = _strategies(model, batch)
            times = {(k, n): [] for k in fns for n in (decode.NEW, 1)}
            outs = {}
            with torch.no_grad():
                for k, fn in fns.items():  # warm: captures, compiles, caches of both sizes
                    t0 = time.perf_counter()
                    outs[k] = fn(decode.NEW)
                    fn(1)
                    print(f"  warm {k}: {time.perf_counter() - t0:.1f} s", flush=True)
                for _ in range(rounds):
                    for k, fn in fns.items():
                        for n in (decode.NEW, 1):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            fn(n)
                            torch.cuda.synchronize()
                            times[(k, n)].append(time.perf_counter() - t0)
            same = {k: torch.equal(o, outs["before"]) for k, o in outs.items() if k not in ("before", "by hand")}
            print(f"\n{decode.MODELS[name]}, batch {batch}: ms end to end, median [min, max] of {rounds} rounds "
                  f"(tokens equal to before's: {same})")
            for (k, n), ts in times.items():
                print(f"  {k:20s} {n:4d} new tokens  {1e3 * statistics.median(ts):8.2f}  "
                      f"[{1e3 * min(ts):.2f}, {1e3 * max(ts):.2f}]")
            for k in fns:
                per = (statistics.median(times[(k, decode.NEW)]) - statistics.median(times[(k, 1)])) / (decode.NEW - 1)
                print(f"  {k:20s} ms a token (difference of the medians / {decode.NEW - 1}): {1e3 * per:.3f}",
                      flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[2:] or ["gpt2"])
