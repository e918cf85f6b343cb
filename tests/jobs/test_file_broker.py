"""The embedded broker shows a consumer a message whole or not at all (``jobs.file_broker``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection
from kombu.transport.virtual.base import Empty

from jobs.app import broker_settings, make_app
from jobs.file_broker import write_whole


def _connection(folder: Path, transport: str) -> Connection:
    options = broker_settings({"TRIBUTARY_BROKER_DIR": str(folder)})["broker_transport_options"]
    return Connection("filesystem://", transport=transport, transport_options=options)


class _Peek:
    """A payload field whose encoding looks at the queue from a second connection, as a worker
    polling at that instant would: kombu encodes a message while its producer writes it."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self.seen: list[str] = []

    def __json__(self) -> str:
        self.seen.append(f"waiting={self.consumer._size('cpu')}")
        try:
            self.seen.append(f"took {self.consumer._get('cpu')!r}")
        except Empty:
            self.seen.append("empty")
        except ValueError as exc:  # json.JSONDecodeError
            self.seen.append(f"unreadable: {exc}")
        return "peeked"


def _put_while_peeking(folder: Path, transport: str) -> list[str]:
    """What a consumer saw while a message was being put; the message stays for the caller."""
    with _connection(folder, transport) as producer, _connection(folder, transport) as consumer:
        peek = _Peek(consumer.default_channel)
        producer.default_channel._put("cpu", {"run_id": 7, "peek": peek})
        return peek.seen


def test_a_consumer_never_sees_a_message_being_written(tmp_path: Path) -> None:
    """While a message is being written, a consumer polling the queue finds nothing; afterwards it
    takes the whole message. (The web app sends a run while its worker polls: CI saw the worker
    take the empty file and stop.)"""
    transport = make_app({"TRIBUTARY_BROKER_DIR": str(tmp_path)}).conf.broker_transport
    assert _put_while_peeking(tmp_path, transport) == ["waiting=0", "empty"]
    with _connection(tmp_path, transport) as consumer:
        assert consumer.default_channel._get("cpu") == {"run_id": 7, "peek": "peeked"}
    assert sorted(p.name for p in (tmp_path / "queue").iterdir()) == []  # no leftovers of the write


def test_kombus_own_transport_still_shows_the_empty_file(tmp_path: Path) -> None:
    """Why ``jobs.file_broker`` exists (kombu issue #1551). When this fails, kombu writes its
    messages whole itself: delete ``jobs/file_broker.py`` and the ``broker_transport`` setting."""
    seen = _put_while_peeking(tmp_path, "filesystem")
    assert seen[0] == "waiting=1"
    assert seen[1].startswith("unreadable: Expecting value")


def test_bindings_of_two_queues_share_one_exchange_table(tmp_path: Path) -> None:
    """The exchange's table, created whole and empty, then filled under kombu's lock, holds every
    binding, and a third connection routes by it."""
    transport = make_app({"TRIBUTARY_BROKER_DIR": str(tmp_path)}).conf.broker_transport
    with _connection(tmp_path, transport) as a, _connection(tmp_path, transport) as b:
        a.default_channel._queue_bind("runs", "cpu", "cpu", "cpu")
        b.default_channel._queue_bind("runs", "gpu", "gpu", "gpu")
        a.default_channel._queue_bind("runs", "cpu", "cpu", "cpu")  # again: no duplicate
    with _connection(tmp_path, transport) as reader:
        table = reader.default_channel.get_table("runs")
    assert sorted(q.queue for q in table) == ["cpu", "gpu"]
    assert [p.name for p in (tmp_path / "control").iterdir()] == ["runs.exchange"]


def test_a_file_created_meanwhile_is_never_replaced(tmp_path: Path) -> None:
    """Two processes creating one table: the second's whole write finds the first's file and
    leaves it as it is (then adds its binding under kombu's lock), and leaves no partial file."""
    table = tmp_path / "runs.exchange"
    assert write_whole(table, b'[["cpu", "cpu", "cpu"]]')
    assert not write_whole(table, b"[]")
    assert table.read_bytes() == b'[["cpu", "cpu", "cpu"]]'
    assert [p.name for p in tmp_path.iterdir()] == ["runs.exchange"]


def test_without_hard_links_a_file_still_appears_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a filesystem that refuses link(2) (EPERM), the name comes by a rename: the message is
    taken whole, and a table another process created is still kept."""
    def no_links(src: object, dst: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    transport = make_app({"TRIBUTARY_BROKER_DIR": str(tmp_path)}).conf.broker_transport
    assert _put_while_peeking(tmp_path, transport) == ["waiting=0", "empty"]
    with _connection(tmp_path, transport) as consumer:
        assert consumer.default_channel._get("cpu") == {"run_id": 7, "peek": "peeked"}
    table = tmp_path / "runs.exchange"
    assert write_whole(table, b"[1]") and not write_whole(table, b"[2]")
    assert table.read_bytes() == b"[1]"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control", "processed", "queue", "runs.exchange"]
