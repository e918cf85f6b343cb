"""The engine's output on the run page (issue 15): stored through the ingest socket with a byte
cursor of its own (idempotent across reconnects and web app restarts), bounded per run, safe
for any bytes; the Logs tab, its catch-up JSON and the full-log download.

Real sockets through ``webapp.asgi.application`` and the configured channel layer; run on SQLite
and on PostgreSQL (``DATABASE_URL``)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from engine import contracts
from engine.log_bridge import mirror_lines
from engine.output_lines import MAX_LINE_CHARS
from tests.webapp.test_live import TIMEOUT, closed_with, connections, ingest, watch  # noqa: F401 - fixtures
from tributary.protocol import HELLO_OUTPUT_OFFSET, HELLO_OUTPUT_STREAM, OUTPUT_CHUNK_BYTES
from webapp.runs import output as output_module
from webapp.runs.ingest import store_events
from webapp.runs.models import LogLine, OutputLine, Run, ShareLink
from webapp.runs.output import full_log_path, store_output
from webapp.runs.tokens import start_attempt


@pytest.fixture(autouse=True)
def _data_dir(settings: Any, tmp_path: Any) -> None:
    settings.DATA_DIR = tmp_path  # each test's full logs in a directory of its own


STREAM = "gpu-7:2049:131"  # the worker's engine.log: host, device, inode


def log_event(seq: int, level: str, message: str) -> dict[str, Any]:
    return {"run": 1, "seq": seq, "type": "log", "level": level, "message": message}


def lines_of(run: Run) -> list[tuple[int, str, str]]:
    return list(
        OutputLine.objects.filter(run=run).order_by("offset").values_list("offset", "level", "message")
    )


def chunk(offset: int, data: bytes, stream: str = STREAM) -> dict[str, Any]:
    return {"type": "output", "stream": stream, "offset": offset, "data": base64.b64encode(data).decode()}


# --------------------------------------------------------------------------- storing


@pytest.mark.django_db
def test_chunks_are_stored_once_whatever_is_resent(run: Run) -> None:
    """A resend after a lost ack (the same chunk, or one overlapping the stored part) stores only
    what is new; a chunk after a gap stores nothing and answers with the cursor to resend from."""
    first = b"loading model\nWARNING: slow tokenizer\n"
    second = b"step 1 done\nTraceback (most recent call last):\n"
    assert store_output(run.pk, 0, STREAM, 0, first) == len(first)
    assert store_output(run.pk, 0, STREAM, 0, first) == len(first)  # the same chunk again: nothing new
    assert store_output(run.pk, 0, STREAM, len(first) + 5, b"ahead\n") == len(first)  # a gap: resend
    overlap = first[10:] + second  # a worker that resent from an older cursor
    assert store_output(run.pk, 0, STREAM, 10, overlap) == len(first) + len(second)
    assert lines_of(run) == [
        (0, "info", "loading model"),
        (14, "warning", "WARNING: slow tokenizer"),
        (38, "info", "step 1 done"),
        (50, "error", "Traceback (most recent call last):"),
    ]
    assert full_log_path(run.pk).read_bytes() == first + second
    run.refresh_from_db()
    size = len(first + second)
    assert (run.output_bytes, run.output_file_bytes, run.output_lines_dropped) == (size, size, 0)


@pytest.mark.django_db
def test_only_the_newest_lines_are_kept_and_the_dropped_ones_counted(run: Run, monkeypatch: Any) -> None:
    monkeypatch.setattr(output_module, "OUTPUT_LINES_KEPT", 10)
    data = b"".join(f"line {i:03d}\n".encode() for i in range(25))
    store_output(run.pk, 0, STREAM, 0, data[:90])
    store_output(run.pk, 0, STREAM, 90, data[90:])
    kept = [message for _, _, message in lines_of(run)]
    assert kept == [f"line {i:03d}" for i in range(15, 25)]
    run.refresh_from_db()
    assert run.output_lines_dropped == 15
    assert full_log_path(run.pk).read_bytes() == data  # the full log keeps every line
    burst = b"".join(f"burst {i:03d}\n".encode() for i in range(30))  # more than the bound at once
    store_output(run.pk, 0, STREAM, len(data), burst)
    assert [message for _, _, message in lines_of(run)] == [f"burst {i:03d}" for i in range(20, 30)]
    run.refresh_from_db()
    assert run.output_lines_dropped == 15 + 30


@pytest.mark.django_db
def test_any_bytes_become_lines_a_page_can_show(run: Run) -> None:
    huge = b"x" * (MAX_LINE_CHARS * 3)
    data = b"\xff\xfe\x00bad\x1b[1mbold\x1b[0m\x01\n" + huge + b"\n" + "ünïcode ✓\n".encode()
    data += mirror_lines(0.0, "info", "engine", "already an event").encode() + b"no newline at the end"
    store_output(run.pk, 0, STREAM, 0, data)
    messages = [message for _, _, message in lines_of(run)]
    assert messages[0] == "\ufffd\ufffdbadbold"
    assert len(messages[1]) < MAX_LINE_CHARS + 60 and messages[1].endswith("more characters in the full log]")
    assert messages[2:] == ["ünïcode ✓", "no newline at the end"]
    assert full_log_path(run.pk).read_bytes() == data


@pytest.mark.django_db
def test_a_run_resumed_on_the_same_machine_gets_what_its_lost_engine_wrote(run: Run) -> None:
    """The worker died after shipping "before"; its engine went on writing to the same file. A new
    attempt's worker ships that file from the web app's cursor: the lost engine's tail arrives,
    then the new engine's output, none of it twice."""
    store_output(run.pk, 0, STREAM, 0, b"before\n")
    start_attempt(run.pk)
    assert store_output(run.pk, 1, STREAM, 7, b"after the worker died\nresumed\n") == 37
    assert full_log_path(run.pk).read_bytes() == b"before\nafter the worker died\nresumed\n"


@pytest.mark.django_db
def test_another_file_starts_a_new_stream_after_a_marker(run: Run) -> None:
    """A worker on another machine ships its own engine.log from where its engine's output
    begins: appended to the full log after a marker line, its own cursor from there."""
    store_output(run.pk, 0, STREAM, 0, b"first machine\n")
    start_attempt(run.pk)
    assert store_output(run.pk, 1, "cpu-2:64:9", 120, b"second machine\n") == 135
    assert store_output(run.pk, 1, "cpu-2:64:9", 125, b"d machine\nmore\n") == 140
    assert full_log_path(run.pk).read_bytes() == (
        b"first machine\n\n----- attempt 1: the output of another engine.log -----\nsecond machine\nmore\n"
    )
    assert [m for _, _, m in lines_of(run)] == [
        "first machine",
        "----- attempt 1: the output of another engine.log -----",
        "second machine",
        "more",
    ]


@pytest.mark.django_db
def test_bytes_of_a_rolled_back_chunk_are_cut_before_the_next(run: Run) -> None:
    store_output(run.pk, 0, STREAM, 0, b"committed\n")
    with full_log_path(run.pk).open("ab") as fh:
        fh.write(b"from a transaction that failed\n")  # the file was written, the row was not
    store_output(run.pk, 0, STREAM, 10, b"next\n")
    assert full_log_path(run.pk).read_bytes() == b"committed\nnext\n"


# --------------------------------------------------------------------------- the socket


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_the_cursor_survives_a_reconnect(ingest, run: Run) -> None:  # noqa: F811
    comm, hello = await ingest(run.pk)
    assert (hello[HELLO_OUTPUT_STREAM], hello[HELLO_OUTPUT_OFFSET]) == ("", 0)
    await comm.send_json_to(chunk(0, b"one\ntwo\n"))
    assert await comm.receive_json_from(timeout=TIMEOUT) == {"type": "output_ack", "offset": 8}
    await comm.disconnect()
    again, hello = await ingest(run.pk)  # a restarted worker, or the web app came back
    assert (hello[HELLO_OUTPUT_STREAM], hello[HELLO_OUTPUT_OFFSET]) == (STREAM, 8)
    await again.send_json_to(chunk(4, b"two\nthree\n"))  # resent from before the cursor
    assert await again.receive_json_from(timeout=TIMEOUT) == {"type": "output_ack", "offset": 14}
    await again.send_json_to(chunk(20, b"after a gap\n"))
    assert await again.receive_json_from(timeout=TIMEOUT) == {"type": "output_ack", "offset": 14}
    assert [m for _, _, m in await sync_to_async(lines_of)(run)] == ["one", "two", "three"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"type": "output", "stream": STREAM, "offset": -1, "data": ""}, "'offset' must be an integer"),
        ({"type": "output", "stream": STREAM, "offset": True, "data": ""}, "'offset' must be an integer"),
        ({"type": "output", "stream": STREAM, "offset": 0, "data": 5}, "'data' must be a base64 string"),
        (
            {"type": "output", "stream": STREAM, "offset": 0, "data": "not base64!"},
            "'data' is not valid base64",
        ),
        ({"type": "output", "stream": STREAM, "offset": 0, "data": "é"}, "'data' is not valid base64"),
        ({"type": "output", "offset": 0, "data": ""}, "'stream' must name the output file"),
        (
            {"type": "output", "stream": "x" * 201, "offset": 0, "data": ""},
            "'stream' must name the output file",
        ),
        (chunk(0, b"x" * (OUTPUT_CHUNK_BYTES + 1)), "the limit is"),
    ],
)
async def test_a_bad_output_message_is_refused_with_its_field(ingest, run: Run, message, words) -> None:  # noqa: F811
    comm, _ = await ingest(run.pk)
    await comm.send_json_to(message)
    code, text = await closed_with(comm)
    assert code == contracts.CLOSE_BAD_MESSAGE and words in text
    assert await sync_to_async(lines_of)(run) == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_full_log_that_cannot_be_written_closes_with_1011_and_the_resend_lands(
    ingest,  # noqa: F811
    run: Run,
) -> None:
    blocker = full_log_path(run.pk)
    blocker.mkdir(parents=True)  # where the file goes: writing it fails as on a full disk
    comm, _ = await ingest(run.pk)
    await comm.send_json_to(chunk(0, b"kept for later\n"))
    code, _ = await closed_with(comm)
    assert code == contracts.CLOSE_UNAVAILABLE and await sync_to_async(lines_of)(run) == []
    blocker.rmdir()
    again, hello = await ingest(run.pk)
    assert hello[HELLO_OUTPUT_OFFSET] == 0  # nothing was committed: the worker resends it all
    await again.send_json_to(chunk(0, b"kept for later\n"))
    assert (await again.receive_json_from(timeout=TIMEOUT))["offset"] == 15
    assert [m for _, _, m in await sync_to_async(lines_of)(run)] == ["kept for later"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_output_of_an_old_attempt_is_refused(ingest, run: Run) -> None:  # noqa: F811
    comm, _ = await ingest(run.pk)
    await sync_to_async(start_attempt)(run.pk)
    await comm.send_json_to(chunk(0, b"late\n"))
    code, text = await closed_with(comm)
    assert code == contracts.CLOSE_BAD_TOKEN and "attempt 0" in text


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_watchers_get_the_lines_live_but_not_through_a_share_link(
    ingest,  # noqa: F811
    watch,  # noqa: F811
    run,
    member,
    monkeypatch,
) -> None:
    monkeypatch.setattr(output_module, "LIVE_LINES", 2)  # a burst goes out as its newest lines
    page = await watch(f"/ws/runs/{run.pk}/", member)
    assert (await page.receive_json_from(timeout=TIMEOUT))["type"] == "hello"
    link = await sync_to_async(ShareLink.objects.create)(run=run, token="t" * 40)
    shared = await watch(f"/ws/runs/{run.pk}/?share={link.token}")
    assert (await shared.receive_json_from(timeout=TIMEOUT))["type"] == "hello"
    comm, _ = await ingest(run.pk)
    await comm.send_json_to(chunk(0, b"loading\nfrom rank 1\nError: rank 2 died\n"))
    await comm.receive_json_from(timeout=TIMEOUT)
    message = await page.receive_json_from(timeout=TIMEOUT)
    assert message["type"] == "output" and message["skipped"] == 1
    assert [(line["offset"], line["level"], line["message"]) for line in message["lines"]] == [
        (8, "info", "from rank 1"),
        (20, "error", "Error: rank 2 died"),
    ]
    assert await shared.receive_nothing(timeout=0.5)


# --------------------------------------------------------------------------- the pages


@pytest.mark.django_db
def test_the_logs_tab_merges_events_and_output(client_for, member, run: Run) -> None:
    store_events(run.pk, [log_event(1, "warning", "transformers: weights not used")])
    store_output(run.pk, 0, STREAM, 0, b"rank 1: NCCL ready\n")
    page = client_for(member).get(f"/runs/{run.pk}/").content.decode()
    assert 'data-kind="event" data-seq="1" data-level="warning"' in page
    assert 'data-kind="output" data-offset="0" data-level="info"' in page
    assert "transformers: weights not used" in page and "rank 1: NCCL ready" in page
    assert 'id="log-search"' in page and f'href="/runs/{run.pk}/logs/engine.log"' in page
    assert 'id="logs-older"' in page and "hidden>Older lines" in page


@pytest.mark.django_db
def test_the_tab_says_older_lines_were_dropped(client_for, member, run: Run, monkeypatch: Any) -> None:
    monkeypatch.setattr(output_module, "OUTPUT_LINES_KEPT", 3)
    store_output(run.pk, 0, STREAM, 0, b"a\nb\nc\nd\ne\n")
    page = client_for(member).get(f"/runs/{run.pk}/").content.decode()
    assert '<p id="logs-older" class="muted" >Older lines are not shown here (2 output lines dropped' in page


@pytest.mark.django_db
def test_the_full_log_downloads_for_the_team_only(client_for, member, viewer, outsider, run: Run) -> None:
    data = b"line one\n\xff raw bytes kept as they are\n"
    store_output(run.pk, 0, STREAM, 0, data)
    response = client_for(viewer).get(f"/runs/{run.pk}/logs/engine.log")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-engine.log"'
    assert b"".join(response.streaming_content) == data
    assert client_for(outsider).get(f"/runs/{run.pk}/logs/engine.log").status_code == 404
    assert client_for(None).get(f"/runs/{run.pk}/logs/engine.log").status_code == 302  # sign in first
    link = ShareLink.objects.create(run=run, token="s" * 40)
    assert Client().get(f"/share/{link.token}/logs/engine.log").status_code == 404
    shared_page = Client().get(f"/share/{link.token}/").content.decode()
    assert 'id="panel-logs"' not in shared_page


@pytest.mark.django_db
def test_no_output_yet_is_a_404_that_says_so(client_for, member, run: Run) -> None:
    response = client_for(member).get(f"/runs/{run.pk}/logs/engine.log")
    assert response.status_code == 404 and "no output yet" in response.content.decode()


@pytest.mark.django_db
def test_the_catch_up_json(client_for, member, outsider, run: Run) -> None:
    store_output(run.pk, 0, STREAM, 0, b"a\nb\nc\n")
    client = client_for(member)
    body = client.get(f"/runs/{run.pk}/logs/output.json?after=0").json()
    assert [(line["offset"], line["message"]) for line in body["lines"]] == [(2, "b"), (4, "c")]
    assert (body["dropped"], body["skipped"]) == (0, 0)
    for bad_value in ("x", "\u0663", "9" * 30, "1.5", "-"):
        bad = client.get(f"/runs/{run.pk}/logs/output.json", {"after": bad_value})
        assert bad.status_code == 400 and "after:" in bad.json()["detail"], bad_value
    assert client.get(f"/runs/{run.pk}/logs/output.json?after=%00").status_code == 400
    assert client_for(outsider).get(f"/runs/{run.pk}/logs/output.json").status_code == 404


@pytest.mark.django_db
def test_log_events_stay_whole(run: Run) -> None:
    """The engine's log events are not pruned: they are seq-numbered events of its event log
    (the bridge rate-limits them at the source)."""
    store_events(run.pk, [log_event(seq, "info", f"record {seq}") for seq in range(1, 30)])
    assert LogLine.objects.filter(run=run).count() == 29


# --------------------------------------------------------------------------- the API


@pytest.mark.django_db
def test_the_api_pages_output_lines_forward_and_serves_the_full_log(
    token_for, viewer, outsider, run: Run, monkeypatch: Any
) -> None:
    """What the Logs tab shows, for a script: lines oldest first, paged with ``next_after``, the
    dropped ones counted, and every byte from ``/output/full``, to the team's viewers only."""
    monkeypatch.setattr(output_module, "OUTPUT_LINES_KEPT", 4)
    data = b"a\nbb\nccc\nd\ne\nf\n"
    store_output(run.pk, 0, STREAM, 0, data)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token_for(viewer)}"}
    client = Client()
    first = client.get(f"/api/runs/{run.pk}/output", {"limit": 3}, **auth).json()
    assert [(i["offset"], i["message"]) for i in first["items"]] == [(5, "ccc"), (9, "d"), (11, "e")]
    assert first["has_more"] and first["dropped"] == 2 and first["full_log_bytes"] == len(data)
    rest = client.get(f"/api/runs/{run.pk}/output", {"after": first["next_after"]}, **auth).json()
    assert [(i["offset"], i["message"]) for i in rest["items"]] == [(13, "f")] and not rest["has_more"]
    assert rest["next_after"] == 13
    full = client.get(f"/api/runs/{run.pk}/output/full", **auth)
    assert full.status_code == 200 and full["Content-Type"] == "text/plain; charset=utf-8"
    assert b"".join(full.streaming_content) == data
    assert client.get(f"/api/runs/{run.pk}/output", {"after": -2}, **auth).status_code == 422
    stranger = {"HTTP_AUTHORIZATION": f"Bearer {token_for(outsider)}"}
    assert client.get(f"/api/runs/{run.pk}/output", **stranger).status_code == 404
    assert client.get(f"/api/runs/{run.pk}/output/full", **stranger).status_code == 404


@pytest.mark.django_db
def test_before_any_output_the_api_has_an_empty_log(token_for, viewer, run: Run) -> None:
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token_for(viewer)}"}
    response = Client().get(f"/api/runs/{run.pk}/output/full", **auth)
    assert response.status_code == 200 and b"".join(response.streaming_content) == b""
    page = Client().get(f"/api/runs/{run.pk}/output", **auth).json()
    assert page == {"items": [], "next_after": -1, "has_more": False, "dropped": 0, "full_log_bytes": 0}


@pytest.mark.django_db
def test_the_full_log_stops_growing_at_its_cap_and_says_so(
    client_for, member, run: Run, settings: Any
) -> None:
    """Past FULL_LOG_MAX_BYTES the file ends with one line naming the cap and where the rest is;
    lines past the cap still reach the tab with offsets that go on in one byte space; the file is
    not touched again, also when the cap is raised or lowered afterwards (its committed length is
    stored, never derived from the setting)."""
    settings.FULL_LOG_MAX_BYTES = 16
    store_output(run.pk, 0, STREAM, 0, b"0123456789\n")  # 11 bytes: under the cap
    store_output(run.pk, 0, STREAM, 11, b"abcdefghij\n")  # crosses it: 5 bytes kept, then the line
    store_output(run.pk, 0, STREAM, 22, b"after the cap\n")
    kept = full_log_path(run.pk).read_bytes()
    assert kept.startswith(b"0123456789\nabcde\n----- the web app keeps the first ")
    assert kept.count(b"FULL_LOG_MAX_MB") == 1 and b"after the cap" not in kept
    run.refresh_from_db()
    assert (run.output_kept_bytes, run.output_file_bytes) == (len(kept), 36)
    assert [(offset, message) for offset, _, message in lines_of(run)] == [
        (0, "0123456789"),
        (11, "abcdefghij"),
        (22, "after the cap"),
    ]
    for cap in (10_000, 4):
        settings.FULL_LOG_MAX_BYTES = cap
        store_output(run.pk, 0, STREAM, 36 if cap > 4 else 41, b"more\n")
        assert full_log_path(run.pk).read_bytes() == kept
    response = client_for(member).get(f"/runs/{run.pk}/logs/engine.log")
    assert b"".join(response.streaming_content) == kept and response["Content-Length"] == str(len(kept))


def test_a_rolled_back_chunk_is_cut_before_the_next_under_the_cap(run: Run, settings: Any) -> None:
    settings.FULL_LOG_MAX_BYTES = 64
    store_output(run.pk, 0, STREAM, 0, b"committed\n")
    with full_log_path(run.pk).open("ab") as fh:
        fh.write(b"from a transaction that failed")
    store_output(run.pk, 0, STREAM, 10, b"next\n")
    assert full_log_path(run.pk).read_bytes() == b"committed\nnext\n"
