"""Every model family transformers ships, decoded by ``gm.generate``: does each decode step
replay a graph, and are the tokens ``model.generate``'s?

Each causal LM, encoder-decoder and speech-to-text type in transformers' auto mappings is built
from its default config made small (2 layers, 64 wide, 4 heads, 128-token vocabulary, sliding
windows of 8 positions, 4 experts), random weights, fp32 (TF32 off). Two prompts of a batch are
left-padded (6 and 4 real tokens); each model decodes 24 new tokens greedily, with
``model.generate`` (its own cache) and with ``GraphedModule(model, decode=False).generate(...,
cache_implementation="static")``. A type that cannot be built from a small config is listed
with the reason.

On a CPU nothing is captured: the row says whether graphwrap's decode loop served the call and
whether its tokens are ``model.generate``'s. On a GPU it also says how many decode steps
replayed a graph and, where some ran eagerly, graphwrap's reason. The docs' table
(``docs/families.md``) is made from the two JSON files this writes, one per device::

    python benchmarks/families.py --device cpu --json benchmarks/results/families-cpu.json
    python benchmarks/families.py --device cuda --json benchmarks/results/families-cuda.json
    python benchmarks/families.py --table benchmarks/results/families-cpu.json \\
        benchmarks/results/families-cuda.json > docs/families.md
"""

import argparse
import contextlib
import datetime
import io
import json
import logging
import sys
import time
import warnings

import torch

PROMPTS, NEW, WINDOW, VOCAB = (6, 4), 24, 8, 128
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             head_dim=16, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_inner=128, d_model=64, d_ff=128,
             d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
             ffn_dim=128, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=64, rotary_dim=8, partial_rotary_factor=0.5,
             sliding_window=WINDOW, num_mel_bins=16, max_source_positions=64, max_target_positions=128,
             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
             n_shared_experts=1, first_k_dense_replace=1, num_key_value_groups=None)
KINDS = (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal"), ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
         ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "speech"))
MAX_PARAMS = 20_000_000  # a config that stays larger than this was not made small


def families():
    """``[(model type, kind, class name)]``: a type with a decoder-only class and an
    encoder-decoder one is listed as each; speech-to-text where it is not already seq2seq."""
    from transformers.models.auto import modeling_auto

    out, seen = [], set()
    for table, kind in KINDS:
        for t, cls in getattr(modeling_auto, table).items():
            if (t, kind == "causal") not in seen:
                seen.add((t, kind == "causal"))
                out.append((t, kind, cls))
    return out


def small_config(model_type: str, kind: str = "causal"):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    for sub in ("text_config", "vision_config", "audio_config"):
        if getattr(cfg, sub, None) is not None:
            raise ValueError(f"a composite config ({sub}): not made small here")
    for k, v in SMALL.items():
        if k in vars(cfg) or hasattr(type(cfg), k):
            if v is None or (k == "sliding_window" and getattr(cfg, k, None) is None):
                continue
            try:
                setattr(cfg, k, v)
            except Exception:  # noqa: BLE001 - a field a config computes
                pass
    types = getattr(cfg, "layer_types", None)
    if isinstance(types, list):
        layers = getattr(cfg, "num_hidden_layers", None) or len(types)
        cfg.layer_types = (types * layers)[:layers] if types else types
    for k, v in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", None), ("decoder_start_token_id", 1)):
        if hasattr(cfg, k) or (kind != "causal" and k == "decoder_start_token_id"):
            setattr(cfg, k, v)
    return cfg


def build(model_type: str, kind: str, cls_name: str, device):
    import transformers

    cfg = small_config(model_type, kind)
    cls = getattr(transformers, cls_name)
    with torch.device("meta"):  # counted before any memory is spent on it
        size = sum(p.numel() for p in cls(cfg).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"its config did not shrink below {MAX_PARAMS // 10**6}M parameters ({size / 1e6:.0f}M)")
    torch.manual_seed(0)
    return cls(cfg).to(device).eval()


def inputs(model, kind, device):
    g = torch.Generator().manual_seed(1)
    rows, width = len(PROMPTS), max(PROMPTS)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(PROMPTS):
        ids[r, width - n:] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[r, width - n:] = 1
    if kind == "speech":
        import inspect

        if "input_values" in inspect.signature(model.forward).parameters:  # raw audio (Moonshine)
            return dict(input_values=torch.randn(rows, 16000, generator=g).to(device))
        cfg = model.config
        bins = getattr(cfg, "num_mel_bins", None) or getattr(cfg, "input_feat_per_channel", 16)
        frames = 2 * min(getattr(cfg, "max_source_positions", 32), 32)
        if "input_feat_per_channel" in vars(cfg):  # Speech2Text: (rows, frames, features)
            return dict(input_features=torch.randn(rows, frames, bins, generator=g).to(device))
        return dict(input_features=torch.randn(rows, bins, frames, generator=g).to(device))
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device))


def replays(gm) -> int:
    return sum(b["replays"] for k in gm.stats()["keys"] for b in k["buckets"].values())


def one(model_type: str, kind: str, cls_name: str, device) -> dict:
    from graphwrap import GraphedModule

    row = dict(family=model_type, kind=kind, model=cls_name)
    try:
        model = build(model_type, kind, cls_name, device)
    except Exception as e:  # noqa: BLE001 - a type that needs more than a small config
        return dict(row, built=False, why=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__)
    row.update(built=True, attention=getattr(model.config, "_attn_implementation", None))
    kw = dict(inputs(model, kind, device), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    try:
        with torch.no_grad():
            want = model.generate(**kw)
    except Exception as e:  # noqa: BLE001
        return dict(row, eager_generate=False, why=f"model.generate failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    gm = GraphedModule(model, decode=False)
    try:
        with torch.no_grad():
            got = gm.generate(**kw, cache_implementation="static")
    except Exception as e:  # noqa: BLE001
        row.update(eager_generate=True, failed=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        try:  # transformers' own static cache, for comparison
            with torch.no_grad():
                model.generate(**kw, cache_implementation="static", disable_compile=True)
            row["static_generate"] = "ok"
        except Exception as e2:  # noqa: BLE001
            row["static_generate"] = f"{type(e2).__name__}: {str(e2).splitlines()[0][:200]}"
        return row
    s = gm.stats()
    row.update(eager_generate=True, equal=bool(torch.equal(got, want)), how=sorted(s.get("generate", {})),
               steps=NEW - 1, replayed=replays(gm), eager_reasons=sorted(s.get("eager_calls", {})))
    if not row["equal"]:  # the same cache as graphwrap's, run by transformers: is the cache the difference?
        try:
            with torch.no_grad():
                static = model.generate(**kw, cache_implementation="static", disable_compile=True)
            row["equal_static"] = bool(torch.equal(got, static))
        except Exception as e:  # noqa: BLE001
            row["equal_static"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return row


def run(device, only=None, start: int = 0, rows_out=None) -> dict:
    """Every family from index ``start``; on a GPU, a family that breaks the process's CUDA
    context (a device-side assert) ends this process, and :func:`run_isolated` goes on in a
    new one."""
    logging.getLogger("graphwrap").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import transformers

    rows = []
    for t, kind, cls in families()[start:]:
        if only and t not in only:
            continue
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            row = one(t, kind, cls, device)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), file=rows_out or sys.stderr, flush=True)
        if rows_out is not None:  # where the run got to, should it be cut short
            print(f"{t} ({kind}): {row['seconds']} s", file=sys.stderr, flush=True)
        if device.type == "cuda" and "CUDA error" in json.dumps(row):
            break  # this process can use the GPU no more
    return dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, transformers=transformers.__version__,
                date=datetime.date.today().isoformat(), rows=rows)


def run_isolated(device, only=None, progress=None) -> dict:
    """:func:`run` in child processes, a new one after each that a family broke;
    ``progress(rows so far)`` after each child."""
    import os
    import subprocess
    import tempfile

    names = families()
    rows, head = [], None
    while len(rows) < len(names):
        with tempfile.TemporaryDirectory() as tmp:
            part, head_file = os.path.join(tmp, "rows.jsonl"), os.path.join(tmp, "head.json")
            cmd = [sys.executable, __file__, "--device", str(device), "--start", str(len(rows)), "--rows", part,
                   "--json", head_file] + (["--only", *only] if only else [])
            code = subprocess.run(cmd, check=False).returncode
            got = [json.loads(line) for line in open(part)] if os.path.exists(part) else []
            if os.path.exists(head_file):
                head = json.load(open(head_file))
        if only:
            return dict(head or {}, rows=got)
        rows += got
        if progress is not None:
            progress(dict(head or {}, rows=rows))
        if code != 0 and len(rows) < len(names) and not any("CUDA error" in json.dumps(r) for r in got[-1:]):
            t, kind, cls = names[len(rows)]  # the process died in this family
            rows.append(dict(family=t, kind=kind, model=cls, built=False, why=f"the process died (exit {code})"))
    out = dict(head or {}, rows=rows)
    return out


# ------------------------------------------------------------------------------ the table

def verdict_cpu(row) -> str:
    if not row.get("built"):
        return "not built"
    if not row.get("eager_generate", True):
        return f"model.generate fails ({row.get('why', '').removeprefix('model.generate failed: ')[:90]})"
    if "failed" in row:
        if row.get("static_generate", "ok") != "ok":
            return f"transformers' own static cache fails too ({row['static_generate'][:90]})"
        return f"gm.generate FAILS: {row['failed'][:90]}"
    loop = "graphwrap's loop" if "graphwrap's decode loop" in row["how"] else "transformers' loop"
    return f"{loop}, tokens {tokens(row)}"


def tokens(row) -> str:
    if row["equal"]:
        return "equal"
    if row.get("equal_static") is True:
        return "those of transformers' own static cache (its default cache's differ)"
    return "DIFFER"


def verdict_gpu(row) -> str:
    if row is None:
        return "not run"
    if not row.get("built") or not row.get("eager_generate", True) or "failed" in row:
        return verdict_cpu(row)
    if row["replayed"] >= row["steps"]:
        return f"**every step replays**, tokens {tokens(row)}"
    reason = "; ".join(row["eager_reasons"]) or "steps not handed to graphwrap"
    return f"{row['replayed']} of {row['steps']} steps replay, tokens {tokens(row)}: {reason}"


def table(cpu: dict, gpu: dict) -> str:
    by_gpu = {(r["family"], r["kind"]): r for r in gpu["rows"]}
    built = [r for r in cpu["rows"] if r.get("built")]
    ran = [r for r in gpu["rows"] if r.get("built") and "failed" not in r and r.get("eager_generate", True)]
    replay = [r for r in ran if r["replayed"] >= r["steps"] and r["equal"]]
    replay_static = [r for r in ran if r["replayed"] >= r["steps"] and not r["equal"] and r.get("equal_static") is True]
    lines = [
        "# Model families",
        "",
        "Generated by `benchmarks/families.py` (its docstring says how); do not edit by hand.",
        "",
        f"- CPU column: {cpu['date']}, torch {cpu['torch']}, transformers {cpu['transformers']}.",
        f"- GPU column: {gpu['device']}, {gpu['date']}, torch {gpu['torch']}, transformers {gpu['transformers']}.",
        f"- {len(cpu['rows'])} types in transformers' auto mappings; {len(built)} built from a small config; on the GPU "
        f"{len(replay)} replay every decode step with `model.generate`'s tokens, and {len(replay_static)} more with "
        "those of transformers' own static cache (its default cache gives others, at near ties).",
        "",
        "| type | kind | CPU | GPU |",
        "| --- | --- | --- | --- |",
    ]
    for r in cpu["rows"]:
        if not r.get("built"):
            continue
        lines.append(f"| {r['family']} | {r['kind']} | {verdict_cpu(r)} | {verdict_gpu(by_gpu.get((r['family'], r['kind'])))} |")
    lines += ["", "Not built from a small config:", ""]
    lines += [f"- {r['family']}: {r['why']}" for r in cpu["rows"] if not r.get("built")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--only", nargs="*", help="these model types only")
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)  # a child of run_isolated
    p.add_argument("--rows", help=argparse.SUPPRESS)  # where a child writes its rows as it goes
    p.add_argument("--table", nargs=2, metavar=("CPU_JSON", "GPU_JSON"), help="print the docs' table from two runs")
    a = p.parse_args(argv)
    if a.table:
        cpu, gpu = (json.load(open(f)) for f in a.table)
        sys.stdout.write(table(cpu, gpu))
        return
    device = torch.device(a.device)
    if device.type == "cuda" and a.rows is None:
        def progress(part):  # a run cut short keeps what it did
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(part, f, indent=1)
        out = run_isolated(device, a.only, progress)
    else:
        with open(a.rows, "w") if a.rows else contextlib.nullcontext() as rows_out:
            out = run(device, a.only, a.start, rows_out)
    text = json.dumps(out, indent=1)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
