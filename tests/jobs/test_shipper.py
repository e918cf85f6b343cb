"""The at-least-once shipper against a real WebSocket server playing the web app (conftest.FakeIngest)."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import socket
import threading
from pathlib import Path

import pytest

from engine.contracts import FATAL_CLOSE_CODES
from tributary.events import EventSink
from tributary.protocol import MAX_BATCH_EVENTS, MAX_MESSAGE_BYTES
from tributary.shipper import EventLog, EventShipper, backoff_delay, ingest_url

from .conftest import FakeIngest, read_log, write_events

RUN = 42


def shipper_for(fake, path: Path, **options) -> EventShipper:
    options.setdefault("backoff_base", 0.05)
    options.setdefault("backoff_cap", 0.4)
    options.setdefault("poll_interval", 0.05)
    return EventShipper(fake.url, RUN, fake.valid_token, path, **options)


def assert_exactly_once(fake, path: Path) -> None:
    expected = read_log(path)
    assert fake.events() == expected
    assert all(fake.stored_count[e["seq"]] == 1 for e in expected)


def test_ingest_url() -> None:
    assert ingest_url("http://web:8000", 3) == "ws://web:8000/ws/ingest/3/"
    assert ingest_url("https://x.org/prefix/", 3) == "wss://x.org/prefix/ws/ingest/3/"


def test_ships_a_file_in_order_with_acks(fake_ingest, tmp_path: Path) -> None:
    fake = fake_ingest(RUN)
    path = tmp_path / "events.jsonl"
    seqs = write_events(path, RUN, 1234)
    shipper = shipper_for(fake, path).start()
    assert shipper.finish(timeout=60)
    assert shipper.error is None and shipper.acked_seq == seqs[-1]
    assert_exactly_once(fake, path)
    (conn,) = fake.conns
    assert conn.attach and conn.attach[0]["pid"] > 0 and conn.attach[0]["host"]
    assert len(conn.batches) >= 3 and all(len(b) <= MAX_BATCH_EVENTS for b in conn.batches)
    flat = [s for b in conn.batches for s in b]
    assert flat == seqs  # in order, consecutive, nothing sent twice


def test_batches_stay_under_the_message_size_and_an_oversized_event_keeps_its_seq(
    fake_ingest, tmp_path: Path
) -> None:
    fake = fake_ingest(RUN)
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 100, payload=6000)
    sink = EventSink(str(RUN), path)
    big = sink.samples(99, [{"prompt": "x", "completion": "y" * (MAX_MESSAGE_BYTES + 10)}])
    after = sink.log("info", "after the big one")
    sink.close()
    shipper = shipper_for(fake, path, max_message_bytes=20_000).start()
    assert shipper.finish(timeout=60)
    stored = fake.events()
    assert [e["seq"] for e in stored] == list(range(1, after + 1))
    stand_in = fake.stored[big]
    assert stand_in["type"] == "log" and "larger than an ingest message" in stand_in["message"]
    assert str(path) in stand_in["message"]
    (conn,) = fake.conns
    assert max(conn.sizes) < 20_000 and len(conn.batches) > 5


def test_web_app_crash_mid_stream_loses_nothing_and_stores_nothing_twice(fake_ingest, tmp_path: Path) -> None:
    fake = fake_ingest(RUN)
    # The second batch is stored but its ack is lost (the process dies); the web app is down a while.
    fake.crash_after_batch = {2: 0.5, 5: 0.2}
    fake.close_after_batch = {4: 1012}  # and a graceful restart ("service restart") in between
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 2600)
    writer_done = threading.Event()

    def keep_writing() -> None:  # the engine goes on writing while the web app restarts
        for _ in range(20):
            write_events(path, RUN, 25)
        writer_done.set()

    shipper = shipper_for(fake, path).start()
    writer = threading.Thread(target=keep_writing)
    writer.start()
    writer.join()
    assert writer_done.is_set()
    assert shipper.finish(timeout=60)
    assert shipper.error is None
    assert_exactly_once(fake, path)
    assert len(read_log(path)) == 3100
    assert len(fake.conns) == 4  # batches 2, 4 and 5 ended a connection
    for conn in fake.conns[1:]:  # each reconnect resends from the hello's cursor, not before
        assert conn.batches[0][0] == conn.hello["last_seq"] + 1
    assert all(n == 1 for n in fake.received.values())  # the cursor in hello spared every resend


def test_a_torn_last_line_is_sent_only_once_completed(fake_ingest, tmp_path: Path) -> None:
    fake = fake_ingest(RUN)
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 3)
    whole = json.dumps({"run": str(RUN), "seq": 4, "type": "log", "level": "info", "message": "torn"}) + "\n"
    with path.open("a") as fh:
        fh.write(whole[:25])
    shipper = shipper_for(fake, path, ping_interval=0.05).start()
    fake.wait_for(lambda f: f.last_seq == 3)
    # Several pings after the ack: the shipper polled the file again and again meanwhile.
    fake.wait_for(lambda f: f.conns[0].pings >= 5)
    assert fake.last_seq == 3 and 4 not in fake.received
    with path.open("a") as fh:
        fh.write(whole[25:])
    assert shipper.finish(timeout=30)
    assert fake.stored[4]["message"] == "torn"
    assert_exactly_once(fake, path)


def test_lines_torn_by_a_crash_are_skipped(fake_ingest, tmp_path: Path) -> None:
    fake = fake_ingest(RUN)
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 3)
    with path.open("a") as fh:
        fh.write('{"run":"42","seq":4,"type":"metr')  # the engine was killed mid-line
    write_events(path, RUN, 2)  # EventSink starts a fresh line and continues after seq 3
    shipper = shipper_for(fake, path).start()
    assert shipper.finish(timeout=30)
    assert sorted(fake.stored) == [1, 2, 3, 4, 5]
    assert fake.stored[4]["type"] != "metr"


@pytest.mark.parametrize("code", sorted(FATAL_CLOSE_CODES))
def test_a_fatal_close_code_stops_the_shipper_with_a_clear_error(
    fake_ingest, tmp_path: Path, code: int
) -> None:
    fake = fake_ingest(RUN)
    fake.refuse_with = code
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 5)
    shipper = shipper_for(fake, path).start()
    assert shipper.done.wait(30)
    assert shipper.error is not None and shipper.error.code == code
    assert f"close code {code}" in str(shipper.error) and "refused with" in str(shipper.error)
    assert shipper.backoff_delays == [] and len(fake.refused) == 1  # no reconnect
    assert fake.stored == {}


def test_a_gap_is_refused_for_good(fake_ingest, tmp_path: Path) -> None:
    fake = fake_ingest(RUN)  # the web app stored nothing, but this log starts at seq 11
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 5, start_seq=10)
    shipper = shipper_for(fake, path).start()
    assert shipper.done.wait(30)
    assert shipper.error is not None and shipper.error.code == 4422 and "gap" in str(shipper.error)
    assert fake.stored == {}


def test_renewed_tokens_are_used_to_reconnect(fake_ingest, tmp_path: Path) -> None:
    fake = fake_ingest(RUN)
    fake.rotate_tokens = True  # every hello and ack carries a new token; older ones are refused (4401)
    fake.close_after_batch = {1: 1012, 3: 1011}
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 2000)
    shipper = shipper_for(fake, path).start()
    assert shipper.finish(timeout=60)
    assert shipper.error is None and fake.refused == []
    assert len(fake.conns) == 3
    assert [c.token for c in fake.conns] == ["tok-0", fake.conns[0].hello["token"], "tok-3"]
    assert_exactly_once(fake, path)


@pytest.mark.parametrize("woken", [False, True])
def test_cancel_reaches_the_callback_and_pings_flow_while_idle(
    fake_ingest, tmp_path: Path, woken: bool
) -> None:
    # Woken, the idle shipper waits on wake(), not the socket: messages are read after each wait.
    fake = fake_ingest(RUN)
    fake.cancel_when = lambda f: f.last_seq >= 3
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 3)
    cancels: list[str] = []
    got = threading.Event()

    def on_cancel(message: str) -> None:
        cancels.append(message)
        got.set()

    shipper = shipper_for(fake, path, on_cancel=on_cancel, ping_interval=0.05, woken=woken).start()
    assert got.wait(30)
    assert cancels == ["cancelled by the test"]
    fake.wait_for(lambda f: f.conns[0].pings >= 3)
    shipper.stop()
    assert shipper.done.is_set()


def test_backoff_grows_to_its_cap_and_starts_over_after_a_hello(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port where nothing listens (yet)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 3)
    shipper = EventShipper(
        f"http://127.0.0.1:{port}",
        RUN,
        "tok-0",
        path,
        backoff_base=0.01,
        backoff_cap=0.16,
        poll_interval=0.05,
    ).start()
    fake = FakeIngest(RUN)
    fake.port = port
    try:
        wait_until(lambda: len(shipper.backoff_delays) >= 8)
        delays = list(shipper.backoff_delays)
        # Attempts 0-4 double the bound (0.01 ... 0.16 = the cap): with half of it certain, never shrinking.
        assert all(b >= a for a, b in itertools.pairwise(delays[:5]))
        assert delays[0] <= 0.01 and all(0.08 <= d <= 0.16 for d in delays[4:])
        # The web app comes up on that port: the shipper connects; the next outage backs off from the start.
        fake.start()
        fake.wait_for(lambda f: f.last_seq == 3)
        n = len(shipper.backoff_delays)
        fake.crash()
        wait_until(lambda: len(shipper.backoff_delays) > n)
        assert shipper.backoff_delays[n] <= 0.01
    finally:
        shipper.stop()
        fake.close()


def wait_until(predicate, timeout: float = 30.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        done.wait(0.02)
    raise AssertionError("condition not met in time")


def test_backoff_delay_formula() -> None:
    rng = random.Random(0)
    for attempt in range(12):
        d = min(10.0, 0.5 * 2**attempt)
        value = backoff_delay(attempt, base=0.5, cap=10.0, rng=rng)
        assert d / 2 <= value <= d


def test_event_log_resends_from_any_seq_through_its_index(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    seqs = write_events(path, RUN, 3000, start_seq=100)
    log = EventLog(path, index_every=64)
    got, after = [], 100
    while batch := log.read(after, max_events=500):
        got += [s for s, _ in batch]
        after = batch[-1][0]
    assert got == seqs
    rng = random.Random(1)
    lines = path.read_bytes().splitlines()
    for after in [100, 101, 3099, 3100, *rng.sample(range(100, 3100), 20)]:
        batch = log.read(after, max_events=7)
        assert [s for s, _ in batch] == [s for s in seqs if s > after][:7]
        assert [raw for _, raw in batch] == lines[after - 100 : after - 100 + len(batch)]
    # Resending from an old seq seeks to an index entry at or before it, not to the top of the file.
    assert len(log._index_seqs) >= 3000 // 64
    assert 0 < log._start(2000) <= lines_offset(path, 2000 - 100)
    log.close()


def lines_offset(path: Path, index: int) -> int:
    return sum(len(line) for line in path.read_bytes().splitlines(keepends=True)[:index])


def test_a_line_nested_too_deeply_keeps_its_seq_through_a_stand_in(fake_ingest, tmp_path: Path) -> None:
    """A line no parser can read (or nested past MAX_EVENT_DEPTH) would make the web app refuse
    every batch holding it: it travels as an error log event with its seq, and the rest follows."""
    from tributary.protocol import MAX_EVENT_DEPTH

    fake = fake_ingest(RUN)
    path = tmp_path / "events.jsonl"
    write_events(path, RUN, 3)
    with path.open("a") as fh:
        fh.write(
            '{"run":%d,"seq":4,"type":"log","level":"info","message":%s}\n'  # noqa: UP031
            % (RUN, "[" * 100_000 + "]" * 100_000)
        )
        nested: object = "x"
        for _ in range(MAX_EVENT_DEPTH + 1):
            nested = [nested]
        fh.write(json.dumps({"run": RUN, "seq": 5, "type": "log", "level": "info", "message": nested}) + "\n")
    sink = EventSink(str(RUN), path)
    after = sink.log("info", "after the deep ones")
    sink.close()
    shipper = shipper_for(fake, path).start()
    assert shipper.finish(timeout=60)
    assert shipper.error is None and [e["seq"] for e in fake.events()] == list(range(1, after + 1))
    for seq, why in ((4, "nested too deeply to parse"), (5, f"nested deeper than {MAX_EVENT_DEPTH} levels")):
        stand_in = fake.stored[seq]
        assert (stand_in["type"], stand_in["level"]) == ("log", "error")
        assert (
            f"event {seq}" in stand_in["message"]
            and why in stand_in["message"]
            and str(path) in stand_in["message"]
        )


def test_a_woken_shipper_ships_each_write_at_once_not_at_its_poll(fake_ingest, tmp_path: Path) -> None:
    """A writer in the shipper's process (tributary.Run's writer thread, an EventSink with
    ``on_write``) wakes it: with the poll and the ping an hour away, every event still ships, and
    every wait for the log ended by a wake, none by its timeout."""
    fake = fake_ingest(RUN)
    path = tmp_path / "events.jsonl"
    shipper = shipper_for(fake, path, woken=True, poll_interval=3600, ping_interval=3600).start()
    sink = EventSink(str(RUN), path)
    sink.on_write = shipper.wake
    fake.wait_for(lambda f: f.conns and f.conns[0].attach)
    for i in range(1, 6):
        seq = sink.log("info", f"line {i}")
        fake.wait_for(lambda f, seq=seq: f.last_seq >= seq)
    sink.close()
    shipper.stop()
    assert shipper.error is None
    assert [e["seq"] for e in fake.events()] == [1, 2, 3, 4, 5]
    (conn,) = fake.conns
    assert [s for b in conn.batches for s in b] == [1, 2, 3, 4, 5]
    # stop() ends the last wait with a wake too: waits == wakes (a timed-out wait would read the
    # log once more without one), and at most one wait per write plus the first.
    assert shipper.wakeups == shipper.empty_reads <= 6


def test_the_poll_is_fast_while_the_log_grows_and_slows_as_it_stays_quiet(tmp_path: Path) -> None:
    """The wait before the next read: ``poll_fraction`` of the time since the log last grew,
    within [poll_min, poll_interval] (arithmetic on ``_grew_at``; no wall-time bound is asserted)."""
    shipper = EventShipper("http://127.0.0.1:9", RUN, "tok", tmp_path / "e.jsonl")
    assert (shipper.poll_min, shipper.poll_interval, shipper.poll_fraction) == (0.005, 0.05, 0.1)
    shipper._grew_at = float("inf")  # it just grew
    assert shipper._poll_delay() == shipper.poll_min
    shipper._grew_at = 0.0  # quiet since the clock's epoch: the slowest poll
    assert shipper._poll_delay() == shipper.poll_interval
    shipper._grew_at -= 1e9
    assert shipper._poll_delay() == shipper.poll_interval
    fixed = EventShipper(
        "http://127.0.0.1:9", RUN, "tok", tmp_path / "e.jsonl", poll_interval=0.05, poll_min=0.05
    )
    fixed._grew_at = float("inf")
    assert fixed._poll_delay() == 0.05  # poll_min = poll_interval: the fixed poll of before
    woken = EventShipper(
        "http://127.0.0.1:9", RUN, "tok", tmp_path / "e.jsonl", woken=True, poll_interval=0.25
    )
    woken._grew_at = float("inf")
    assert woken._poll_delay() == 0.25  # woken: no fast poll, wake() does it


class HoldingIngest(FakeIngest):
    """The fake web app, reading up to ``hold`` events messages before it answers the first of
    them: the next ones come only if the shipper sends a batch while the one before is still
    unanswered. It waits ``hold_timeout`` seconds for each (``hold_timed_out``: one never came),
    then ``on_held(fake, ws, conn, messages)`` handles those it got (default: each in turn, as
    ``FakeIngest`` does)."""

    def __init__(self, run_id: int, *, hold: int = 2, hold_timeout: float = 10.0, on_held=None, **options) -> None:
        super().__init__(run_id, **options)
        self.hold, self.hold_timeout, self.on_held = hold, hold_timeout, on_held
        self.held = self.hold_timed_out = False

    async def _on_message(self, ws, conn, data) -> bool:
        if self.held or json.loads(data).get("type") != "events":
            return await super()._on_message(ws, conn, data)
        self.held = True
        messages = [data]
        deadline = asyncio.get_running_loop().time() + self.hold_timeout
        while len(messages) < self.hold:  # the next batch, sent before this one's ack
            try:
                more = await asyncio.wait_for(ws.recv(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                self.hold_timed_out = True
                break
            if json.loads(more).get("type") == "events":
                messages.append(more)
            elif await super()._on_message(ws, conn, more):  # a ping: not what is held for
                return True
        if self.on_held is not None:
            return await self.on_held(self, ws, conn, messages)
        for message in messages:
            if await super()._on_message(ws, conn, message):
                return True
        return False


def holding_ingest(request, run_id: int, **options) -> HoldingIngest:
    fake = HoldingIngest(run_id, **options).start()
    request.addfinalizer(fake.close)
    return fake


def test_three_batches_are_out_at_once_and_each_is_acked_in_order(request, tmp_path: Path) -> None:
    fake = holding_ingest(request, RUN, hold=3)
    path = tmp_path / "events.jsonl"
    seqs = write_events(path, RUN, 4 * MAX_BATCH_EVENTS)
    shipper = shipper_for(fake, path).start()
    assert shipper.finish(timeout=60)
    assert shipper.error is None and shipper.acked_seq == seqs[-1] and shipper.backoff_delays == []
    assert not fake.hold_timed_out  # the second and third batches came before the first's ack
    assert_exactly_once(fake, path)
    (conn,) = fake.conns
    assert [s for b in conn.batches for s in b] == seqs  # each batch went on from the one before's end


def test_a_stop_and_wait_shipper_sends_no_batch_before_the_ack(request, tmp_path: Path) -> None:
    """``window=1`` (the shipper before issue 19): the fake web app waits in vain for a second
    batch before it answers the first."""
    fake = holding_ingest(request, RUN, hold_timeout=1.0)
    path = tmp_path / "events.jsonl"
    seqs = write_events(path, RUN, 3 * MAX_BATCH_EVENTS)
    shipper = shipper_for(fake, path, window=1).start()
    assert shipper.finish(timeout=60)
    assert fake.hold_timed_out and shipper.backoff_delays == []
    assert_exactly_once(fake, path)
    (conn,) = fake.conns
    assert [s for b in conn.batches for s in b] == seqs


def test_a_live_trickle_is_stop_and_wait_and_batched_at_the_web_apps_pace(request, tmp_path: Path) -> None:
    """A batch that emptied the log is the only one out: what the engine writes while it is out
    goes in one batch after its ack (a second batch of a few events out at once would cost the
    web app a transaction more for nothing). The first batch is answered only once the later events
    are all written, however slowly the machine writes them."""
    written = threading.Event()

    async def answer_once_written(fake, ws, conn, messages) -> bool:
        await asyncio.to_thread(written.wait, 60)
        for message in messages:
            if await FakeIngest._on_message(fake, ws, conn, message):
                return True
        return False

    fake = holding_ingest(request, RUN, hold_timeout=1.0, on_held=answer_once_written)
    path = tmp_path / "events.jsonl"
    first = write_events(path, RUN, 5)
    shipper = shipper_for(fake, path).start()
    fake.wait_for(lambda f: f.held)
    later = write_events(path, RUN, 5, start_seq=first[-1])  # while the first batch is out
    written.set()
    assert shipper.finish(timeout=60)
    assert fake.hold_timed_out and shipper.backoff_delays == []
    (conn,) = fake.conns
    assert conn.batches == [first, later]


@pytest.mark.parametrize("stored", [0, 1, 2])
def test_batches_out_unacked_at_a_crash_are_resent_from_the_hello_without_gap_or_duplicate(
    request, tmp_path: Path, stored: int
) -> None:
    """Two batches are out when the web app dies, having stored ``stored`` of them and acked
    none: the next connection's ``hello.last_seq`` says where to resume, and the shipper resends
    from there: every event stored exactly once, and the stored ones not sent again."""

    async def store_then_crash(fake, ws, conn, messages) -> bool:
        for message in messages[:stored]:
            fake.crash_after_batch = {fake.batches_total + 1: 0.0} if message is messages[stored - 1] else {}
            await FakeIngest._on_message(fake, ws, conn, message)
        if not stored:
            ws.transport.abort()
            fake._restarts.add(asyncio.get_running_loop().create_task(fake._restart_after(0.0)))
        return True

    fake = holding_ingest(request, RUN, on_held=store_then_crash)
    path = tmp_path / "events.jsonl"
    seqs = write_events(path, RUN, 4 * MAX_BATCH_EVENTS)
    shipper = shipper_for(fake, path).start()
    assert shipper.finish(timeout=60)
    assert shipper.error is None and shipper.acked_seq == seqs[-1]
    assert_exactly_once(fake, path)
    first, second = fake.conns  # one reconnect: the crash
    assert len(first.batches) == stored and len(shipper.backoff_delays) == 1
    assert second.hello["last_seq"] == stored * MAX_BATCH_EVENTS
    assert second.batches[0][0] == second.hello["last_seq"] + 1
    assert all(n == 1 for n in fake.received.values())  # nothing stored was sent again


def test_an_ack_short_of_its_batch_resends_from_there_once_the_batches_out_are_answered(
    request, tmp_path: Path
) -> None:
    """The web app stores only part of the first batch and acks that (as after a resend request);
    the two batches already out then leave a gap, which it answers as the real web app does (an
    ack of its cursor with ``resend``): the shipper goes on from that cursor, after all three answers."""
    cut = 123

    async def store_part(fake, ws, conn, messages) -> bool:
        first = json.loads(messages[0])
        first["events"] = first["events"][:cut]
        await FakeIngest._on_message(fake, ws, conn, json.dumps(first))  # acks `cut`
        for _ in messages[1:]:  # the gap
            await ws.send(json.dumps({"type": "ack", "seq": fake.last_seq, "resend": True}))
        return False

    fake = holding_ingest(request, RUN, hold=3, on_held=store_part)
    path = tmp_path / "events.jsonl"
    seqs = write_events(path, RUN, 4 * MAX_BATCH_EVENTS)
    shipper = shipper_for(fake, path).start()
    assert shipper.finish(timeout=60)
    assert shipper.error is None and shipper.acked_seq == seqs[-1] and shipper.backoff_delays == []
    assert_exactly_once(fake, path)
    (conn,) = fake.conns
    assert conn.batches[0] == seqs[:cut] and conn.batches[1][0] == cut + 1
    assert [s for b in conn.batches for s in b] == seqs  # the resent ones once, after the cut
