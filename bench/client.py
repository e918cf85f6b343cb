"""What the client library costs a training script (issue 17): ``run.log`` on the caller's thread,
and the slowdown of a training loop that logs.

1. **Per call.** ``run.log`` with ``--metrics`` values (default 100), in bursts of ``--burst`` calls
   (the writer thread catches up between bursts, so no call is dropped); the median over bursts of
   the caller's wall time per call. Reference in the same run: the same dict written by the script
   itself as a JSON line (``json.dumps`` + ``write``), what a script that keeps its own log pays.
   Target: under 20 us per call.
2. **Training loop.** Steps of ~100 ms of pure-Python work (it holds the GIL, so every bit of the
   client's threads shows: the worst case; torch kernels release it), logging ``--rate`` calls per
   second of 100 metrics (and 8 samples every 10 steps); rounds with the client and without it
   (the reference) alternate, the medians are compared. The client ships to a real web app
   (uvicorn, SQLite: ``tests/e2e/harness.Deployment``) unless ``--offline``. Also printed: the CPU
   time of the client per second of training (its threads, read from their own CPU clocks, plus
   its calls on the training thread), a steadier figure than the wall-time difference on a loaded
   machine: under the GIL it bounds what the client can take from the loop. The same again with
   steps that wait 100 ms (the GIL free, as a training step on a GPU leaves it). Target: under 1%
   slowdown at 10 calls/s.

    .venv/bin/python bench/client.py            # 8 pairs of rounds of 30 steps, each kind of step
    .venv/bin/python bench/client.py --quick    # 4 pairs of 15 steps
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tributary  # noqa: E402
from tributary.run import Run  # noqa: E402


def metrics(n: int, step: int) -> dict[str, float]:
    return {f"bench/metric_{i:03d}": 0.5 + 0.001 * ((step * 7 + i) % 13) for i in range(n)}


def per_call(directory: Path, n_metrics: int, burst: int, bursts: int) -> tuple[float, float]:
    """(median us per run.log call, median us per json.dumps + write of the same dict), in CPU
    time of the caller's thread (``time.thread_time``): on a loaded machine, wall time would
    count the moments the scheduler gave the core to another process."""
    run = tributary.init(
        project="bench", dir=directory / "per-call", url="", token="", max_queue_events=burst + 10
    )
    values = [metrics(n_metrics, step) for step in range(burst)]
    client_us: list[float] = []
    own_us: list[float] = []
    with (directory / "own.jsonl").open("a", encoding="utf-8") as own:
        for b in range(bursts):
            run.flush()
            start = time.thread_time()
            for step, row in enumerate(values):
                run.log(row, step=b * burst + step)
            client_us.append((time.thread_time() - start) / burst * 1e6)
            start = time.thread_time()
            for step, row in enumerate(values):
                own.write(json.dumps({"step": step, "values": row}) + "\n")
            own.flush()
            own_us.append((time.thread_time() - start) / burst * 1e6)
    assert run.dropped_events == 0, run.dropped_events
    with contextlib.redirect_stderr(io.StringIO()):
        run.finish()
    return statistics.median(client_us), statistics.median(own_us)


def work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


def calibrate(target_s: float) -> int:
    n = 100_000
    while True:
        start = time.perf_counter()
        work(n)
        took = time.perf_counter() - start
        if took > 0.02:
            return int(n * target_s / took)
        n *= 2


def background_cpu() -> float:
    """CPU seconds used so far by every thread but this one (in this process: the client's)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.ident is None:
            continue
        with contextlib.suppress(OSError, ProcessLookupError):  # a thread that just ended
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def loop(run: Run | None, steps: int, n_work: int, n_metrics: int, every: int) -> tuple[float, float]:
    """(wall s, CPU s of the client: its threads, and its calls on this one) of ``steps``
    training steps, logging every ``every`` steps (and 8 samples every ten calls). A step is
    ``work(n_work)``, or with ``n_work`` < 0 a sleep of ``-n_work`` ms (the GIL free, as while a
    GPU computes)."""
    wall, others, calls = time.perf_counter(), background_cpu(), 0.0
    for step in range(steps):
        if n_work >= 0:
            work(n_work)
        else:
            time.sleep(-n_work / 1000)
        if run is not None and step % every == 0:
            values = metrics(n_metrics, step)
            samples = [
                {"prompt": f"p{step}", "completion": "c" * 200, "reward": 1.0, "group": g // 4}
                for g in range(8)
            ]
            start = time.thread_time()
            run.log(values, step=step)
            if step % (10 * every) == 0:
                run.log_samples(samples)
            calls += time.thread_time() - start
    return time.perf_counter() - wall, background_cpu() - others + calls


@contextlib.contextmanager
def server(offline: bool) -> Iterator[tuple[str, str]]:
    if offline:
        yield "", ""
        return
    from tests.e2e.harness import Deployment

    with tempfile.TemporaryDirectory(prefix="bench-client-") as root:
        d = Deployment(Path(root))
        try:
            d.setup()
            d.start_web()
            yield d.url, d.api_token
        finally:
            d.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics", type=int, default=100)
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--bursts", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=8, help="pairs of rounds, with and without the client")
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--rate", type=float, default=10.0, help="log calls per second of training")
    parser.add_argument("--offline", action="store_true", help="no web app: the client only writes its log")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.bursts, args.steps, args.rounds = 5, 15, 4

    with tempfile.TemporaryDirectory(prefix="bench-client-runs-") as scratch:
        directory = Path(scratch)
        client_us, own_us = per_call(directory, args.metrics, args.burst, args.bursts)
        print(
            f"run.log, {args.metrics} metrics, caller's thread (its CPU time): {client_us:.1f} us/call (target < 20)"
        )
        print(f"reference, json.dumps + write of the same dict: {own_us:.1f} us/call")
        print(f"ratio client / own JSON line: {client_us / own_us:.2f}x")

        n_work = calibrate(args.step_ms / 1000)
        every = max(1, round(1000 / args.step_ms / args.rate))
        with server(args.offline) as (url, token):
            run = tributary.init(project="faults", name="bench", dir=directory / "loop", url=url, token=token)
            where = "offline" if args.offline else f"shipping to {url}"
            print(
                f"training loop, {args.steps} steps of {args.step_ms:g} ms x {args.rounds} round pairs, "
                f"{1000 / args.step_ms / every:g} log calls/s of {args.metrics} metrics ({where})"
            )
            for kind, step in (
                ("pure-Python work, holding the GIL", n_work),
                ("waiting, as on a GPU", -args.step_ms),
            ):
                loop(run, 3, step, args.metrics, every)  # warm: the server run exists, the socket is open
                ratios, client_cpu = [], []
                for i in range(args.rounds):  # pairs in A-B, B-A order, so a drift of the load cancels out
                    first, second = (None, run) if i % 2 == 0 else (run, None)
                    a = loop(first, args.steps, step, args.metrics, every)
                    b = loop(second, args.steps, step, args.metrics, every)
                    (wall_without, _), (wall_with, cpu) = (a, b) if first is None else (b, a)
                    ratios.append(wall_with / wall_without)
                    client_cpu.append(cpu / wall_with)
                slowdown, cpu_share = statistics.median(ratios) - 1, statistics.median(client_cpu)
                print(f"  steps of {kind}:")
                print(
                    f"    slowdown (wall, median of the pairs' ratios): {100 * slowdown:+.2f}% (target < 1%); "
                    f"pairs from {100 * (min(ratios) - 1):+.1f}% to {100 * (max(ratios) - 1):+.1f}%"
                )
                print(
                    f"    CPU of the client (its threads + its calls) per second of training: {1000 * cpu_share:.2f} ms "
                    f"({100 * cpu_share:.2f}%)"
                )
            with contextlib.redirect_stderr(io.StringIO()):
                shipped = run.finish()
        print(f"  all acked: {shipped}, dropped events: {run.dropped_events}, client errors: {run.errors}")


if __name__ == "__main__":
    main()
