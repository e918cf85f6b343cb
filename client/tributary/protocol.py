"""The ingest socket protocol between a worker's run supervisor and the web app.

The worker connects to ``ws(s)://<web>/ws/ingest/<run id>/`` with the header
``Authorization: Bearer <ingest token>``, the only place a token is read (a URL would put it
in access logs). The token is signed by the web app when it queues the run (scoped to that
run and that attempt of it, expiring, renewed over the socket while the run is not final).
Every message is one JSON object with a ``type``. Plain module: both sides import it, and the
worker side runs without Django.

Web app -> worker
    ``hello``   ``{"type": "hello", "last_seq": N, "status": "queued", "cancel": false, "token": "..."}``
                first message after connecting: the highest seq durably stored (resend
                everything after it), the run's status, whether a cancel is pending, and a
                fresh token to use for the next reconnect.
    ``ack``     ``{"type": "ack", "seq": N}`` after each ``events`` batch is committed; may
                carry a fresh ``token``, and ``quarantined: [seq, ...]``: events of the batch
                that could not be stored and were replaced by an error log line (the run's
                Logs tab says why); the worker moves on past them.
    ``cancel``  ``{"type": "cancel", "message": "..."}``: stop the engine (SIGTERM, then
                SIGKILL after the grace period).
    ``error``   ``{"type": "error", "code": 4422, "message": "..."}`` sent just before the
                server closes with that code.
    ``output_ack`` ``{"type": "output_ack", "offset": M}`` after each ``output`` chunk: the web app
                holds the stream's bytes up to M; the worker goes on from M (also when M is below
                what it sent: a gap, resend from M).
    ``hello`` also carries ``output_stream`` and ``output_offset``: the output stream the web app
                holds (``""``: none) and up to which byte (a web app without them takes no ``output``).

Worker -> web app
    ``attach``  ``{"type": "attach", "host": "gpu-7", "pid": 123, "engine_from": 812}`` after each
                ``hello``. ``engine_from`` (``ATTACH_ENGINE_FROM``; a supervisor's): the last seq in
                the run's event log before its engine starts. An attempt resumed in the directory of
                a lost one finds there the seqs that engine wrote and nobody shipped; they come first,
                and the web app stores them as that earlier attempt's, its final status included
                as words only, so the tail of a dead engine cannot end the new attempt.
    ``events``  ``{"type": "events", "events": [...]}``: consecutive engine events in seq order,
                starting right after the last ack; at most ``MAX_BATCH_EVENTS`` events and
                ``MAX_MESSAGE_BYTES`` bytes per message.
    ``ping``    ``{"type": "ping"}``: the worker is alive (also while the engine is silent).
    ``output``  ``{"type": "output", "stream": "host:dev:inode", "offset": N, "data": "<base64>"}``:
                the engine's stdout and stderr (``engine.log``, all its ranks and child processes)
                from byte N of that file, at most ``OUTPUT_CHUNK_BYTES``, cut after a newline when it
                can be. Its own byte cursor, apart from the events' seq, idempotent the same way: the
                worker resumes the stream ``hello`` names at its offset (a run resumed on the same
                machine appends to the same file, so what its lost engine wrote meanwhile arrives
                too), or starts another stream where its own engine's output begins.

The web app handles the messages of a socket one at a time, in order, and answers every
``events`` message with exactly one ``ack`` (or closes), so a worker may send the next batch
before the ack of the one before: the shipper keeps two out while it has a backlog
(``client/tributary/shipper.py``), so the second travels while the first is in the database
(issue 19; nothing changed on the web app's side, which answers a stop-and-wait worker the
same). An ack short of its batch's last seq (a ``resend``, or an engine's final status inside
the batch) means: resend from ``ack + 1`` once the batches still out are answered. On reconnect (with exponential backoff) the worker starts again after
the ``last_seq`` of the new ``hello``: whatever was out unacked is sent again. Duplicates are
ignored by the web app.
"""

from __future__ import annotations

import hashlib
import re

# ----------------------------------------------------------------------------- close codes
# 4000-4999 are the application's (RFC 6455 section 7.4.2). engine.contracts re-exports them
# with the other contracts between the parts (the browser sockets' codes are there).
CLOSE_BAD_MESSAGE = 4400  # not JSON, not an object, unknown message type (browser sockets too)
CLOSE_BAD_TOKEN = 4401  # missing, forged or expired token: get a new one by requeueing
CLOSE_WRONG_RUN = 4403  # a valid token, but for another run
CLOSE_NO_RUN = 4404  # the run does not exist (deleted)
CLOSE_CLAIM_LOST = 4409  # another script took the external run over (its claim): this one ships no more
CLOSE_RUN_OVER = 4410  # the engine's final status is stored: the attempt takes no more events
CLOSE_TOO_BIG = 4413  # message larger than the limit
CLOSE_BAD_EVENT = 4422  # an event without a usable seq; nothing of the batch was stored
CLOSE_UNAVAILABLE = 1011  # the database failed: the worker reconnects and resends
# Codes after which reconnecting cannot help: the worker's supervisor stops the run instead.
FATAL_CLOSE_CODES: frozenset[int] = frozenset(
    {CLOSE_BAD_TOKEN, CLOSE_WRONG_RUN, CLOSE_NO_RUN, CLOSE_CLAIM_LOST, CLOSE_RUN_OVER, CLOSE_BAD_EVENT}
)

# Where the engine writes an event's seq: right at the start (``{"run":..,"seq":N,...``); read
# without parsing a line json cannot (nested too deeply). The shipper and tributary.events read it.
SEQ_AT_START = re.compile(
    rb'^\s*\{\s*"run"\s*:\s*(?:"[^"\\]{0,200}"|-?\d{1,20}|null)\s*,\s*"seq"\s*:\s*(\d{1,19})\s*[,}]'
)

# How deep one event's JSON may nest on the socket. The engine writes at most
# ``tributary.events.MAX_DEPTH`` (32) levels; the worker replaces a line deeper than this by a
# stand-in log event, so the web app's parser never meets a nesting it cannot read.
MAX_EVENT_DEPTH = 64

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_BATCH_EVENTS = 500
OUTPUT_CHUNK_BYTES = 1024 * 1024  # raw bytes of one ``output`` message (base64 keeps it under the limit)
HELLO_OUTPUT_OFFSET = "output_offset"
HELLO_OUTPUT_STREAM = "output_stream"
OUTPUT_STREAM_MAX_CHARS = 200

# How often a connected worker pings, and how long without hearing from it makes a run lost.
PING_INTERVAL_S = 10.0

INGEST_PATH = "/ws/ingest/{run_id}/"

# Exclusive claims: one supervisor, and only one, starts a run's engine, however many copies of
# the run's queue message are delivered (a broker redelivery, a reconciler's re-send).
# - A web app that grants claims says so in ``hello``: ``{"claims": true, ...}``.
# - The supervisor then sends ``attach`` with ``"claim": "<id unique to this supervisor>"`` and
#   starts nothing until the web app answers ``{"type": "claim", "won": true|false, "message": "..."}``.
# - ``won``: this claim holds the run (a queued run was moved to starting with it, or this same
#   claim already held it: a reconnect). A loser ends its task without touching the run: another
#   supervisor holds it, the run is final, or the run was queued again behind older runs.
# A web app that grants no claims (no ``claims`` in ``hello``) gets the plain ``attach`` of before.
HELLO_CLAIMS = "claims"
ATTACH_CLAIM = "claim"
ATTACH_ENGINE_FROM = "engine_from"
MSG_CLAIM = "claim"
CLAIM_MAX_CHARS = 64

# External runs (``webapp.runs.external``): one script holds its run. A script's claim is
# ``<lineage>.<place>``: the lineage a uuid kept in its run directory (``run.json``, so a copy of
# the directory carries it), the place a digest of the host and the directory's real path, where
# one process at a time writes (the client locks the directory). It goes with the API calls that
# give out a token (``claim``, ``host``, ``pid``: a refusal is a 409 with ``held_by`` and no token)
# and with ``attach``. The same claim keeps the run (a reconnect, a restart in the same directory);
# the same lineage from another place (a copy of the directory on another host or path) takes it
# over only once the run is final or its holder has been silent for ``HOLDER_SILENT_S``.
PLACE_CHARS = 12


def script_claim(lineage: str, host: str, directory: str) -> str:
    """The claim of the script that writes the run directory ``directory`` (its real path) on
    ``host``, for the run directory's ``lineage``: at most ``CLAIM_MAX_CHARS`` characters."""
    place = hashlib.sha256(f"{host}\0{directory}".encode("utf-8", "surrogatepass")).hexdigest()[:PLACE_CHARS]
    return f"{lineage[: CLAIM_MAX_CHARS - PLACE_CHARS - 1]}.{place}"
