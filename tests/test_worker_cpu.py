"""The engine's background worker on the CPU: jobs in order, waits, cancellation, errors, and a
worker that never keeps its engine alive."""

import gc
import threading
import weakref

from graphwrap.capture.worker import Worker


class _Engine:
    pass


def test_jobs_run_in_order_on_one_thread_and_wait_returns():
    eng = _Engine()
    w = Worker(eng)
    seen = []
    for i in range(5):
        w.submit(lambda e, i: seen.append((i, threading.current_thread().name, e is eng)), i)
    assert w.wait(10)
    assert [s[0] for s in seen] == list(range(5))
    assert len({s[1] for s in seen}) == 1 and all(s[2] for s in seen)
    assert not w.busy()


def test_wait_times_out_while_a_job_runs_and_a_job_may_queue_another():
    eng = _Engine()
    w = Worker(eng)
    gate, done = threading.Event(), []

    def first(e):
        gate.wait(10)
        w.submit(lambda e: done.append("second"))

    w.submit(first)
    assert not w.wait(0.1)
    gate.set()
    assert w.wait(10) and done == ["second"]


def test_cancel_drops_jobs_not_started():
    eng = _Engine()
    w = Worker(eng)
    gate, ran = threading.Event(), []
    w.submit(lambda e: gate.wait(10))
    futs = [w.submit(lambda e: ran.append(1)) for _ in range(3)]
    w.cancel()
    gate.set()
    assert w.wait(10)
    assert ran == [] and all(f.cancelled() for f in futs)


def test_a_failing_job_is_logged_and_the_next_runs(caplog):
    eng = _Engine()
    w = Worker(eng)
    ran = []
    w.submit(lambda e: 1 / 0)
    w.submit(lambda e: ran.append(1))
    assert w.wait(10)
    assert ran == [1]
    assert any("ZeroDivisionError" in r.getMessage() for r in caplog.records)


def test_the_worker_holds_its_engine_weakly():
    eng = _Engine()
    w = Worker(eng)
    w.submit(lambda e: None)
    assert w.wait(10)
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None
    ran = []
    w.submit(lambda e: ran.append(e))  # the engine is gone: nothing runs, nothing raises
    w.wait(10)
    assert ran == []


def test_an_exiting_interpreter_does_not_wait_for_queued_jobs():
    """Twenty queued jobs of half a second each: the one running finishes, the rest are dropped,
    so the script ends in about a second, not ten."""
    import subprocess
    import sys
    import time

    script = (
        "import time\n"
        "from graphwrap.capture.worker import Worker\n"
        "class E: pass\n"
        "e = E()\n"
        "w = Worker(e)\n"
        "ran = []\n"
        "for i in range(20):\n"
        "    w.submit(lambda eng, i: (ran.append(i), time.sleep(0.5)), i)\n"
        "time.sleep(0.2)\n"
        "print('queued', flush=True)\n"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "queued" in out.stdout
    assert took < 5.0, f"exit waited {took:.1f} s for jobs nobody needs"
