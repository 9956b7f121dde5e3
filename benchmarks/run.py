"""graphwrap's benchmarks: python -m graphwrap bench [--suite NAME ...] [--quick] [--out DIR].

Prints a table per scenario (speedups against the seed's synchronous loop or eager, and against
torch.compile) and writes results.json, results.csv and a PNG chart per scenario (with
matplotlib) under --out, after each suite. --quick alone runs the "quick" suite: one short table
in about a minute. A suite that needs a package this machine lacks is left out with the reason;
the others still run. Without a CUDA device it runs a short eager-against-fallback suite and says
that graph figures need a GPU. (python benchmarks/run.py takes the same options.)
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
import torch  # noqa: E402
from harness import Case, Results  # noqa: E402


@dataclass(frozen=True)
class Suite:
    """A scenario: the module that runs it, what it measures, the strategies its table compares
    each row with, and the command-line options it takes."""

    module: str
    about: str
    baseline: Optional[str] = None
    peer: Optional[str] = None
    options: Callable[[argparse.Namespace], dict] = lambda a: {}


COMPILE = "torch.compile reduce-overhead"
SUITES = {
    "quick": Suite("quick", "one short table in about a minute: the seed MLP per call and over mixed batches, "
                   "BERT-base", "eager"),
    "overhead": Suite("overhead", "per call at batch 1, input on the GPU: eager, a bare replay, gm(x) owned and "
                      "view, torch.compile", "eager", COMPILE),
    "host": Suite("host", "the same with inputs in host memory, pageable and pinned"),
    "fixed": Suite("fixed", "the seed notebook's loops against gm(x) and pipeline, 1280 batches of one size",
                   "seed synchronous loop", COMPILE,
                   lambda a: {"batch_sizes": [int(b) for b in a.batch_sizes.split(",")]}),
    "large": Suite("large", "batches above the largest bucket, default settings", "eager loop m(x.to(cuda))",
                   "floor: one graph of that size, replays alone",
                   lambda a: {"batch_sizes": [int(b) for b in a.large_sizes.split(",")]}),
    "serving": Suite("serving", "closed-loop clients: threads sharing gm(x), the Batcher from threads and asyncio",
                     options=lambda a: {"models": tuple(a.serving_models.split(","))}),
    "replicas": Suite("replicas", "Replicas over one GPU and over every GPU of the host",
                      options=lambda a: {"models": tuple(a.serving_models.split(","))}),
    "compile": Suite("compile_start", "compile=True until every bucket is ready, a fresh process per row"),
    "mixed": Suite("mixed", "batches of sizes drawn uniformly: eager, torch.compile, each bucket policy, compile=",
                   "eager", "torch.compile reduce-overhead dynamic=None",
                   lambda a: {"models": tuple(a.mixed_models.split(",")), "static_exact": a.mixed_static_exact}),
    "models": Suite("models", "resnet50, BERT-base, GPT-2 at batch 1 and 16 against eager and torch.compile",
                    "eager", COMPILE),
    "capture": Suite("capture_time", "time and memory to capture every bucket"),
    "text": Suite("text", "BERT-base with real lengths: eager, one line, seq_dim=1, padded by hand; compile=True; "
                  "64 clients", "eager", COMPILE),
    "decode": Suite("decode", "greedy decoding with a static cache, GPT-2 and a 1.1B Llama shape (--decode-models: "
                    "also a sliding-window Mistral shape, Whisper-base): eager loop, gm.generate, a graph by hand, "
                    "compiled generate", "transformers eager loop, StaticCache: per token",
                    "the step captured by hand (one graph): per token",
                    lambda a: {"models": tuple(a.decode_models.split(","))}),
    "generate": Suite("generate", "many generations at once: gm.generate from 64 threads (continuous batching), "
                      "a closed loop, one at a time, padded by hand, transformers' generate_batch",
                      options=lambda a: {"models": tuple(a.generate_models.split(","))}),
    "generate-large": Suite("generate_large", "the shared batch on Llama-2-7B and Llama-3-8B shapes: 64 requests of "
                            "prompts up to 1,024 and up to 512 new tokens against model.generate one after another, "
                            "the step against the bandwidth roofline, a 6,000-token prompt beside decoding rows",
                            options=lambda a: {"models": tuple(a.generate_large_models.split(","))}),
    "diffusion": Suite("diffusion", "diffusers' DDIM loop (30 steps, guidance, fp16) with the UNet eager, in "
                       "GraphedModule, in torch.compile, and its step's graph by hand; SD-1.x-small and SDXL shapes "
                       "(needs diffusers)", "eager", COMPILE),
}
CPU_SUITE = Suite("run", "eager against graphwrap's eager fallback, on a CPU", "eager")


def cpu_suite(results, quick):
    from workloads import SeedMLP

    from graphwrap import GraphedModule

    model = SeedMLP(hidden=256).eval()
    gm = GraphedModule(model)
    xs = [torch.randn(n, 1024) for n in (1, 16, 64) * (3 if quick else 20)]
    case = Case(results, "cpu", "seed MLP hidden 256, mixed sizes")
    with torch.no_grad():
        case.add("eager", lambda: (lambda: [model(x) for x in xs] and None))
        case.add("graphwrap (eager fallback)", lambda: (lambda: [gm(x) for x in xs] and None))
        case.run(3)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m graphwrap bench", description="\n".join(__doc__.splitlines()[2:]),
                                 formatter_class=argparse.RawTextHelpFormatter,
                                 epilog="suites (each needs a CUDA device):\n" + "\n".join(
                                     f"  {k:9s} {v.about}" for k, v in SUITES.items()))
    ap.add_argument("--suite", action="append", choices=list(SUITES),
                    help="scenario to run (repeatable); default: all but quick and generate-large (7-8B shapes, "
                         "13 to 16 GB of weights each: run when named)")
    ap.add_argument("--quick", action="store_true",
                    help="alone: the quick suite; with --suite: fewer batches and repeats")
    ap.add_argument("--out", default="bench-out", help="folder for results.json, results.csv and charts")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per strategy (default 5, quick 3)")
    ap.add_argument("--batch-sizes", default="1,16,256,1280", help="batch sizes of the fixed scenario")
    ap.add_argument("--serving-models", default="mlp,bert", help="models of the serving scenario: mlp, bert or both")
    ap.add_argument("--large-sizes", default="300,512,1280", help="batch sizes of the large scenario")
    ap.add_argument("--mixed-models", default="mlp,bert", help="models of the mixed scenario: mlp, bert or both")
    ap.add_argument("--generate-models", default="gpt2,llama", help="models of the generate scenario")
    ap.add_argument("--generate-large-models", default="llama2-7b,llama3-8b",
                    help="model shapes of the generate-large scenario: llama2-7b, llama3-8b, mistral-7b")
    ap.add_argument("--decode-models", default="gpt2,llama", help="models of the decode scenario, comma-separated: gpt2, llama, mistral, whisper")
    ap.add_argument("--mixed-static-exact", action="store_true",
                    help="mixed MLP: also exact buckets with kernels compiled for each size (64 compiles a width)")
    ap.add_argument("--device-time", action="store_true",
                    help="also profile each strategy once and note the device time of its kernels and copies")
    a = ap.parse_args(argv)
    harness.DEVICE_TIME = a.device_time
    repeats = a.repeats or (3 if a.quick else 5)
    results = Results(a.out)
    env = results.env
    print(f"graphwrap benchmarks: {env['device']}, driver {env['driver']}, torch {env['torch']}, "
          f"graphwrap {env['graphwrap']}, {env['date']}", flush=True)
    if not torch.cuda.is_available():
        print("No CUDA device found: running the CPU suite (eager against graphwrap's eager fallback).\n"
              "Graph figures need a GPU.", flush=True)
        if a.suite:
            print(f"Left out, they need a GPU: {', '.join(a.suite)}", flush=True)
        suites, failed = ["cpu"], []
        cpu_suite(results, a.quick)
    else:
        suites = a.suite or (["quick"] if a.quick else [k for k in SUITES if k not in ON_REQUEST])
        ran, failed = [], []
        for name in suites:
            t0 = time.perf_counter()
            print(f"-- {name}", flush=True)
            try:
                _run_suite(name, a, results, repeats)
            except ModuleNotFoundError as e:
                print(f"   left out: it needs {e.name} (pip install {e.name})", flush=True)
                results.add(name, "left out", f"needs {e.name}", [], "", None, None, error=f"needs {e.name}")
                ran.append(name)
                continue
            except Exception as e:  # noqa: BLE001 - the other suites still run and write their results
                print(f"   FAILED: {type(e).__name__}: {e}", flush=True)
                failed.append(name)
                continue
            finally:
                print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
            ran.append(name)
            results.write(ran, charts=CHARTS)
        suites = ran
    for name in suites:
        suite = SUITES.get(name, CPU_SUITE)
        print()
        print(results.table(name, suite.baseline, suite.peer))
    results.write(suites, charts=CHARTS)
    if a.out:
        print(f"\nresults in {os.path.abspath(a.out)}")
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


ON_REQUEST = ("quick", "generate-large")  # run only when named (or --quick)
CHARTS = ["overhead", "fixed", "large", "mixed", "models", "cpu"]


def _run_suite(name, a, results, repeats):
    """One suite, with the options of the command line that it takes."""
    import importlib

    suite = SUITES[name]
    mod = importlib.import_module(suite.module)
    mod.run(results, torch.device("cuda"), a.quick, repeats, **suite.options(a))


if __name__ == "__main__":
    sys.exit(main())
