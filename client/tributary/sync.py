"""``python -m tributary sync DIR [DIR...]``: ship runs written while no server was reachable.

Each DIR is a run directory of the client (``run.json`` + ``events.jsonl``). Its server run is
created the first time (``POST /api/runs/external``, idempotent through the run's
``client_id``, its id then kept in ``run.json``), else it gets a fresh ingest token; the worker's
shipper then sends the log from where the web app's copy ends (``hello.last_seq``), so syncing
twice, or a directory the script had partly shipped itself, stores nothing twice. It ships
under the directory's claim (``tributary.run.dir_claim``): a copy of a directory whose script
still reports from elsewhere is refused, with the web app's words.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from tributary.api import Api, ApiError
from tributary.cli import Command, add_server_arguments, server_api
from tributary.events import scan_log
from tributary.run import EVENTS_FILE, dir_claim, read_meta, server_run
from tributary.shipper import EventShipper

PROGRESS_EVERY_S = 2.0


def sync_dir(directory: Path, api: Api, *, timeout: float, out: TextIO = sys.stdout) -> bool:
    """Ship one run directory's log; whether the web app acknowledged all of it."""
    meta = read_meta(directory)
    events = directory / EVENTS_FILE
    held = scan_log(events)
    last = held.last_seq
    claim = dir_claim(directory, meta)
    server = server_run(api, directory, meta, claim=claim)
    print(f"{directory}: run {server.id} ({meta['name']}), {last} events in the log", file=out, flush=True)
    shipper = EventShipper(
        api.url, server.id, server.ingest_token, events, claim=claim, backoff_cap=5.0
    ).start()
    result: list[bool] = []
    finisher = threading.Thread(target=lambda: result.append(shipper.finish(timeout)), daemon=True)
    finisher.start()
    while finisher.is_alive():
        finisher.join(PROGRESS_EVERY_S)
        if finisher.is_alive():
            print(f"{directory}: {shipper.acked_seq}/{last} events stored", file=out, flush=True)
    if result and result[0]:
        print(f"{directory}: all {last} events stored: {server.url or server.id}", file=out, flush=True)
        if not held.final_state:
            print(
                f"{directory}: note: the log has no final status (its script did not finish); "
                "the run stays running on the server until it does",
                file=out,
                flush=True,
            )
        return True
    why = str(shipper.error or shipper.claim_lost or f"not done within --timeout {timeout:g} s")
    print(f"{directory}: stopped at {shipper.acked_seq}/{last} events: {why}", file=sys.stderr, flush=True)
    return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dirs", nargs="+", type=Path, metavar="DIR", help="run directories (tributary-runs/<id>)"
    )
    add_server_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for one directory's events to be stored"
    )


def run(args: argparse.Namespace) -> int:
    api = server_api(args)
    failed = 0
    for directory in args.dirs:
        started = time.monotonic()
        try:
            ok = sync_dir(directory, api, timeout=args.timeout)
        except (ValueError, ApiError) as exc:
            print(f"{directory}: {exc}", file=sys.stderr, flush=True)
            ok = False
        failed += not ok
        if ok:
            print(f"{directory}: done in {time.monotonic() - started:.1f} s", flush=True)
    if failed:
        print(
            f"tributary sync: {failed} of {len(args.dirs)} directories not fully sent; run it again",
            file=sys.stderr,
        )
    return 1 if failed else 0


COMMAND = Command("sync", "ship run directories written offline to their server runs", add_arguments, run)
