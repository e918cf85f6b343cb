"""What the health rules cost at ingest: ``store_events`` with them against without them.

The same batches of metrics events (``--steps`` steps of ``--metrics`` values each, the names the
rules read among them, ``--batch`` events per call as the worker's shipper sends them) are stored
into fresh runs on PostgreSQL, alternately with the rules (``webapp.alerts.monitor.observe``, as
ingest calls it) and without (the call replaced by a no-op: the reference), ``--rounds`` times
each; the medians are compared. Target: the rules add under 5% (issue 18).

    .venv/bin/python bench/alerts.py            # 1000 steps x 50 metrics, 12 rounds
    .venv/bin/python bench/alerts.py --quick    # 300 steps, 3 rounds

Needs the machine's PostgreSQL; creates and drops its own database ``tributary_bench_alerts``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pg import django_on_fresh_database, drop_database  # noqa: E402

BENCH_DB = "tributary_bench_alerts"
WATCHED = ("actor/entropy", "reward/mean", "actor/pg_loss", "actor/grad_norm", "frac_reward_zero_std",
           "perf/throughput", "async/staleness_max", "rollout/mismatch_kl")  # fmt: skip


def events(steps: int, n_metrics: int) -> list[dict[str, Any]]:
    names = list(WATCHED) + [f"bench/metric_{i:02d}" for i in range(n_metrics - len(WATCHED))]
    out = []
    for step in range(1, steps + 1):
        values = {name: 0.5 + 0.001 * ((step * 7 + i) % 13) for i, name in enumerate(names)}
        values["async/staleness_max"] = 1.0
        values["rollout/mismatch_kl"] = 0.001
        out.append(
            {"run": "b", "seq": step, "type": "metrics", "step": step, "time": 1.7e9 + step, "values": values}
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--metrics", type=int, default=50)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=12)  # fewer: the A/B is mostly noise
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 300, 3

    django_on_fresh_database(BENCH_DB)
    from webapp.alerts import monitor
    from webapp.runs import ingest
    from webapp.runs.models import Run
    from webapp.teams.models import Project, Team

    project = Project.objects.create(
        team=Team.objects.create(name="Bench", slug="bench"), name="Alerts", slug="a"
    )
    batches = [
        ev[i : i + args.batch]
        for ev in [events(args.steps, args.metrics)]
        for i in range(0, len(ev), args.batch)
    ]
    observe = monitor.observe
    inside = [0.0]  # seconds spent in the rules during the current run

    def timed(run: Any, fresh: list[dict[str, Any]]) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return observe(run, fresh)
        finally:
            inside[0] += time.perf_counter() - start

    def store_all(with_rules: bool) -> tuple[float, float]:
        """Seconds to store every batch into a fresh run, and of those the seconds in the rules."""
        inside[0] = 0.0
        monitor.observe = timed if with_rules else (lambda run, fresh: run.alert_state)
        run = Run.objects.create(project=project, name="bench")
        start = time.perf_counter()
        for batch in batches:
            ingest.store_events(run.pk, batch)
        elapsed = time.perf_counter() - start
        monitor.observe = observe
        return elapsed, inside[0]

    store_all(True)  # warm the caches and the connection
    times: dict[bool, list[float]] = {True: [], False: []}
    shares: list[float] = []
    for round_ in range(args.rounds):
        for with_rules in (round_ % 2 == 0, round_ % 2 == 1):  # alternate which goes first
            elapsed, in_rules = store_all(with_rules)
            times[with_rules].append(elapsed)
            if with_rules:
                shares.append(in_rules / elapsed)
    points = args.steps * args.metrics
    with_rules, without = statistics.median(times[True]), statistics.median(times[False])
    print(
        f"{args.steps} steps x {args.metrics} metrics in batches of {args.batch}, {args.rounds} rounds each"
    )
    print(f"{'':24}{'median s':>10}{'points/s':>12}")
    print(f"{'without rules (ref)':24}{without:10.3f}{points / without:12,.0f}")
    print(f"{'with the rules':24}{with_rules:10.3f}{points / with_rules:12,.0f}")
    print("each round (s):", {k: [round(t, 3) for t in v] for k, v in times.items()})
    print(f"A/B difference: {100 * (with_rules / without - 1):+.1f}% (carries the machine's noise)")
    # Measured inside the same runs, this share does not depend on what else the machine does.
    print(f"time inside the rules: {100 * statistics.median(shares):.1f}% of ingest (target < 5%)")
    drop_database(BENCH_DB)


if __name__ == "__main__":
    main()
