"""kombu's filesystem transport, with each file written whole before a reader can see it.

The embedded broker (``jobs.app``) is kombu's ``filesystem://`` transport: a message is a file
``<ms>_<uuid>.<queue>.msg`` in the queue folder, and a consumer takes the oldest by moving it
out and reading it. kombu writes a message in place: ``open(name, "wb")`` makes the file,
empty, and the bytes follow. A consumer polling in between (it takes no lock) moves the empty
file out, and ``json.loads("")`` raises in the worker's consumer loop, which Celery reports as
"Unrecoverable error" and stops the worker; the message is gone too (kombu issue #1551, open).
This happened in CI: the web app sent a run while the worker polled its queue. The same holds
for an exchange's binding table, created empty and filled after its lock is taken.

Here a file is written under a name no reader matches (``….msg.<hex>.part``), synced to disk,
and hard-linked to its real name: a link is atomic within a folder, so a reader sees no file or
the whole file. The names, the order (the millisecond prefix) and the folder layout stay kombu's,
so the reconciler's view of waiting messages (``webapp.runs.reconcile.FileBroker``) and messages
already written by kombu's own transport read the same.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

PART_SUFFIX = ".part"
# What link(2) says on a filesystem that has no hard links (FAT, SMB and VirtualBox shared folders).
NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}


def write_whole(path: Path, data: bytes) -> bool:
    """Put ``data`` at ``path`` in one step: written beside it, synced, then linked to ``path``.

    Returns False, changing nothing, if ``path`` already exists (another process created it
    first): a creator never clobbers a live file. On a filesystem without hard links (some
    network and shared-folder mounts) the name comes by an atomic rename instead, after a
    check that it is free: whole all the same, and only a creation raced to the instant could
    replace another's.
    """
    partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}{PART_SUFFIX}")
    try:
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # a crash after the link must not leave the name on no bytes
        try:
            os.link(partial, path)  # atomic, and fails if ``path`` exists
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in NO_HARD_LINKS:
                raise
            if path.exists():
                return False
            os.replace(partial, path)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)


class Channel(filesystem.Channel):
    def _put(self, queue, payload, **kwargs):
        """Put ``payload`` on ``queue`` as a file that appears whole (kombu's name and order)."""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        path = Path(self.data_folder_out) / name
        try:
            write_whole(path, str_to_bytes(dumps(payload)))
        except OSError as exc:
            raise ChannelError(f"Cannot add file {str(path)!r} to directory") from exc

    def _queue_bind(self, exchange, routing_key, pattern, queue):
        """Create the exchange's table whole (empty) before kombu adds the binding under its lock."""
        table = self._exchange_file(exchange)
        if not table.exists():
            self.control_folder.mkdir(parents=True, exist_ok=True)
            try:
                write_whole(table, str_to_bytes(dumps([])))
            except OSError as exc:
                raise ChannelError(f"Cannot open {table}") from exc
        super()._queue_bind(exchange, routing_key, pattern, queue)


class Transport(filesystem.Transport):
    Channel = Channel
    # One broker state for both transports' channels, as kombu shares it among its own.
    global_state = filesystem.Transport.global_state
