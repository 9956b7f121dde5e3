"""Shared timing harness for graphwrap's benchmarks.

Method: every strategy of a case is set up and run once untimed (its cold start: capture,
compile, first copies, timed apart), then the strategies are timed in turn, round-robin, for
``repeats`` rounds. Each timing is a wall clock around the whole loop, with the device
synchronized before and after. Reported: median, min and max over the rounds. Not done: fixed
clocks, cache flushes in end-to-end loops, process isolation between strategies.

With ``DEVICE_TIME`` on (``run.py --device-time``), each strategy then runs once more under
torch.profiler, and the device time of its kernels (memsets included) and of its copies is
noted beside it: how far a loop is from what its own kernels need.
"""

import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Callable, Dict, List, Optional

import torch

import graphwrap

DEVICE_TIME = False
UNIT_SCALE = {"us": 1e6, "ms": 1e3}  # seconds to the unit a case reports in


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log_with_times():
    """graphwrap's log, INFO and up, on stdout with milliseconds since the process started (each
    capture beside the decode thread, with its time)."""
    import logging
    import sys

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("  [log %(relativeCreated).0f ms] %(message)s"))
    logging.getLogger("graphwrap").addHandler(handler)
    logging.getLogger("graphwrap").setLevel(logging.INFO)


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "graphwrap": graphwrap.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "device": "cpu (no CUDA device found)",
        "driver": None,
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - the driver version is nice to have
            pass
    return env


class Case:
    """One comparison: named strategies over the same workload, timed interleaved."""

    def __init__(self, results: "Results", scenario: str, case: str, unit: str = "s", per: int = 1):
        self.results, self.scenario, self.case = results, scenario, case
        self.unit, self.per = unit, per  # per: divide a loop's time by this (calls per loop)
        self.loops: Dict[str, Callable[[], None]] = {}
        self.cold: Dict[str, float] = {}
        self.peak: Dict[str, int] = {}
        self.failed: Dict[str, str] = {}

    def add(self, name: str, setup: Callable[[], Callable[[], None]]):
        """``setup()`` builds the strategy and returns its loop; the first loop is its cold start."""
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        try:
            loop = setup()
            loop()
            sync()
        except Exception as e:  # noqa: BLE001 - a strategy that cannot run is reported, not fatal
            self.failed[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            print(f"  [{self.case}] {name}: FAILED {self.failed[name]}", flush=True)
            return
        self.cold[name] = time.perf_counter() - t0
        print(f"  [{self.case}] {name}: cold start {self.cold[name]:.2f} s", flush=True)
        if torch.cuda.is_available():
            self.peak[name] = torch.cuda.max_memory_allocated() - base
        self.loops[name] = loop

    def run(self, repeats: int):
        times: Dict[str, List[float]] = {n: [] for n in self.loops}
        for _ in range(repeats):
            for name, loop in self.loops.items():
                sync()
                t0 = time.perf_counter()
                loop()
                sync()
                times[name].append((time.perf_counter() - t0) / self.per)
        for name, ts in times.items():
            self.results.add(self.scenario, self.case, name, ts, self.unit, self.cold[name], self.peak.get(name))
        if DEVICE_TIME and torch.cuda.is_available():
            for name, loop in self.loops.items():
                dev = device_time(loop)
                kernels = dev["kernels"] / self.per  # seconds, per call where a loop makes several
                ratio = statistics.median(times[name]) / kernels if kernels else float("nan")
                scale = UNIT_SCALE.get(self.unit, 1.0)
                self.results.note(self.scenario, self.case,
                                  f"{name}: device time of its kernels (its median is {ratio:.2f}x that)",
                                  kernels * scale, self.unit, copies=dev["copies"] / self.per * scale,
                                  h2d=dev["h2d"] / self.per * scale, median_over_kernels=ratio)
        for name, why in self.failed.items():
            self.results.add(self.scenario, self.case, name, [], self.unit, None, None, error=why)
        return times


def device_time(loop) -> Dict[str, float]:
    """Seconds of device time one run of ``loop`` spends in kernels (and memsets), in copies,
    and in host-to-device copies (part of copies), from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop()
        sync()
    out = {"kernels": 0.0, "copies": 0.0, "h2d": 0.0}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        t = getattr(e, "device_time", None)
        t = (t if t is not None else e.cuda_time) / 1e6
        if "Memcpy" in e.name:
            out["copies"] += t
            if "HtoD" in e.name:
                out["h2d"] += t
        else:
            out["kernels"] += t
    return out


class Results:
    def __init__(self, out_dir: Optional[str]):
        self.rows: List[dict] = []
        self.env = environment()
        self.out_dir = out_dir

    def add(self, scenario, case, strategy, times, unit, cold_s, peak_bytes, error=None, **extra):
        scale = UNIT_SCALE.get(unit, 1.0)
        row = {"scenario": scenario, "case": case, "strategy": strategy, "unit": unit,
               "median": statistics.median(times) * scale if times else None,
               "min": min(times) * scale if times else None,
               "max": max(times) * scale if times else None,
               "repeats": len(times), "cold_start_s": cold_s,
               "peak_mem_mib": None if peak_bytes is None else peak_bytes / 2**20, "error": error}
        row.update(extra)
        self.rows.append(row)

    def note(self, scenario, case, strategy, value, unit, **extra):
        self.rows.append({"scenario": scenario, "case": case, "strategy": strategy, "unit": unit,
                          "median": value, "min": value, "max": value, "repeats": 1, "cold_start_s": None,
                          "peak_mem_mib": None, "error": None, "note": True, **extra})

    def table(self, scenario: str, baseline: Optional[str] = None, peer: Optional[str] = None) -> str:
        rows = [r for r in self.rows if r["scenario"] == scenario]
        lines = [f"## {scenario} ({self.env['device']}, torch {self.env['torch']}, {self.env['date']})", "",
                 "| case | strategy | median | min..max | cold start s | peak MiB |"
                 + (" vs baseline |" if baseline else "") + (" vs peer |" if peer else ""),
                 "|---|---|---|---|---|---|" + ("---|" if baseline else "") + ("---|" if peer else "")]
        by_case: Dict[str, Dict[str, dict]] = {}
        for r in rows:
            by_case.setdefault(r["case"], {})[r["strategy"]] = r
        for case, strat in by_case.items():
            for name, r in strat.items():
                if r["median"] is None:
                    cells = f"| {case} | {name} | failed: {r['error']} | | | |"
                    lines.append(cells + (" |" if baseline else "") + (" |" if peer else ""))
                    continue
                cold = "" if r["cold_start_s"] is None else f"{r['cold_start_s']:.2f}"
                peak = "" if r["peak_mem_mib"] is None else f"{r['peak_mem_mib']:.0f}"
                cells = (f"| {case} | {name} | {_fmt(r['median'])} {r['unit']} | "
                         f"{_fmt(r['min'])}..{_fmt(r['max'])} | {cold} | {peak} |")
                for ref in (baseline, peer):
                    if ref:
                        b = strat.get(ref)
                        ok = b and b["median"] and r["median"] and not r.get("note")
                        cells += f" {b['median'] / r['median']:.2f}x |" if ok else " |"
                lines.append(cells)
        return "\n".join(lines)

    def write(self, scenarios: List[str], charts: Optional[List[str]] = None):
        if not self.out_dir:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "results.json"), "w") as f:
            json.dump({"environment": self.env, "rows": self.rows}, f, indent=1)
        keys = sorted({k for r in self.rows for k in r})
        with open(os.path.join(self.out_dir, "results.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print('matplotlib is not installed: no charts (pip install -e ".[bench]" in a checkout)')
            return
        for sc in scenarios if charts is None else [c for c in charts if c in scenarios]:
            rows = [r for r in self.rows if r["scenario"] == sc and r["median"] is not None and not r.get("note")]
            if not rows:
                continue
            cases = list(dict.fromkeys(r["case"] for r in rows))
            strategies = list(dict.fromkeys(r["strategy"] for r in rows))
            fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 0.45 * len(strategies) + 1.8),
                                     squeeze=False)
            for ax, case in zip(axes[0], cases):
                rs = {r["strategy"]: r for r in rows if r["case"] == case}
                names = [s for s in strategies if s in rs]
                med = [rs[s]["median"] for s in names]
                err = [[rs[s]["median"] - rs[s]["min"] for s in names], [rs[s]["max"] - rs[s]["median"] for s in names]]
                ax.barh(names, med, xerr=err, color=["tab:orange" if "graphwrap" in s else "tab:blue" for s in names])
                ax.invert_yaxis()
                ax.set_title(case, fontsize=9)
                ax.set_xlabel(rs[names[0]]["unit"])
                ax.tick_params(labelsize=7)
            fig.suptitle(f"{sc}: {self.env['device']}, torch {self.env['torch']}, {self.env['date']}", fontsize=9)
            fig.tight_layout()
            fig.savefig(os.path.join(self.out_dir, f"{sc}.png"), dpi=110)
            plt.close(fig)


def _fmt(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.4f}"
