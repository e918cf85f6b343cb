"""Rollout search over every step of a big run, on PostgreSQL (issue 18: under 300 ms).

A run of ``--steps`` steps x ``--per-step`` completions (arithmetic prompts, completions of
realistic length, one word planted at a few steps) is written with COPY; then the rollout
browser's search view (``GET /runs/<id>/rollouts/?q=...``, through Django's test client, so the
view, the query and the template are all measured) is timed for a rare word, a word in 5% of
the completions and one in all of them. The reference is the same view on one step without a
search, the page a user opens first. Printed: median ms of each over ``--repeat`` requests.

    .venv/bin/python bench/rollout_search.py            # 1,000 steps x 256 completions
    .venv/bin/python bench/rollout_search.py --quick    # 200 steps x 256

Needs the machine's PostgreSQL; creates and drops its own database ``tributary_bench_search``.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pg import django_on_fresh_database, drop_database  # noqa: E402

BENCH_DB = "tributary_bench_search"
TARGET_MS = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--per-step", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--explain", action="store_true", help="print each view's queries with their times")
    parser.add_argument("--keep", action="store_true", help="keep the database (to EXPLAIN by hand)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeat = 200, 5

    django_on_fresh_database(BENCH_DB)
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client

    from webapp.runs.models import Run, prompt_hash
    from webapp.teams.choices import Role
    from webapp.teams.models import Membership, Project, Team

    team = Team.objects.create(name="Bench", slug="bench")
    user = get_user_model().objects.create_user("bench", password="x")
    Membership.objects.create(team=team, user=user, role=Role.VIEWER)
    run = Run.objects.create(project=Project.objects.create(team=team, name="S", slug="s"), name="search")

    rng = random.Random(0)
    rare_steps = set(rng.sample(range(1, args.steps + 1), 3))
    buffer = io.StringIO()
    for step in range(1, args.steps + 1):
        seq = step  # one samples event per step
        for index in range(args.per_step):
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            words = ["Let me add", str(a), "and", str(b), "step by step."] + ["carry the one"] * rng.randint(
                5, 40
            )
            if index % 20 == 0:
                words.append("hmm, wait")  # in 5% of the completions
            if step in rare_steps and index == 7:
                words.append("xylophone")
            completion = " ".join(words) + f" The answer is {a + b}."
            prompt = f"What is {a} + {b}?"
            row = [str(run.pk), str(step), str(seq), str(index), prompt, completion, str(rng.random()), "0",
                   str(len(words) * 2), "stop", json.dumps({"group": index // 8}), "1", "f", prompt_hash(prompt)]  # fmt: skip
            buffer.write("\t".join(v.replace("\\", "\\\\").replace("\t", " ") for v in row) + "\n")
    start = time.perf_counter()
    with connection.cursor() as cursor:
        raw = cursor.connection
        columns = (
            "run_id, step, seq, index, prompt, completion, reward, advantage, length, finish_reason, extra, "
            "attempt, superseded, prompt_hash"
        )
        with raw.cursor().copy(f"COPY runs_sample ({columns}) FROM STDIN") as copy:
            copy.write(buffer.getvalue())
        cursor.execute("ANALYZE runs_sample")
    rows = args.steps * args.per_step
    print(f"{rows:,} completions over {args.steps} steps written in {time.perf_counter() - start:.1f} s")

    client = Client(SERVER_NAME="localhost")  # ALLOWED_HOSTS: localhost by default
    client.force_login(user)
    path = f"/runs/{run.pk}/rollouts/"

    def explain(query: str) -> None:
        from django.test.utils import CaptureQueriesContext

        with CaptureQueriesContext(connection) as queries:
            client.get(path + query)
        for q in queries:
            print(f"  {float(q['time']) * 1000:8.1f} ms  {q['sql'][:150]}")

    def median_ms(query: str) -> float:
        if args.explain:
            print(query)
            explain(query)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            response = client.get(path + query)
            times.append((time.perf_counter() - t0) * 1000)
            assert response.status_code == 200, response.status_code
        return statistics.median(times)

    reference = median_ms("?step=latest")
    print(f"{'view':44}{'median ms':>10}{'/ ref':>8}")
    print(f"{'one step, no search (reference)':44}{reference:10.1f}{1:8.2f}")
    for label, query in (
        ("rare word (3 completions)", "?q=xylophone"),
        ("frequent word (5% of completions)", "?q=hmm%2C+wait"),
        ("word in every completion", "?q=carry"),
    ):
        ms = median_ms(query)
        verdict = "ok" if ms < TARGET_MS else f"over {TARGET_MS} ms"
        print(f"{label:44}{ms:10.1f}{ms / reference:8.2f}  {verdict}")
    if not args.keep:
        drop_database(BENCH_DB)


if __name__ == "__main__":
    main()
