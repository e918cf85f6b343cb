// The pages' one WebSocket client (webapp/pages/static/tributary/socket.js), against a fake
// WebSocket and mocked timers: cursor, duplicates, back-off, close codes.
import assert from "node:assert/strict";
import { afterEach, beforeEach, mock, test } from "node:test";

import { parseContracts } from "../../webapp/pages/static/tributary/contracts.js";
import { LiveSocket, reconnectDelay } from "../../webapp/pages/static/tributary/socket.js";
import { PAGE_CONTRACTS } from "./fixtures.mjs";

const CONTRACTS = parseContracts(JSON.stringify(PAGE_CONTRACTS));

class FakeSocket {
  static made = [];
  constructor(url) { this.url = url; this.closedWith = null; FakeSocket.made.push(this); }
  open() { this.onopen?.(); }
  receive(message) { this.onmessage?.({ data: JSON.stringify(message) }); }
  drop(code) { this.onclose?.({ code }); }
  close(code) { this.closedWith = code; }
}
const last = () => FakeSocket.made.at(-1);

beforeEach(() => {
  FakeSocket.made = [];
  globalThis.WebSocket = FakeSocket;
  globalThis.location = { protocol: "https:", host: "example.test" };
  mock.timers.enable({ apis: ["setTimeout"] });
  mock.method(Math, "random", () => 0.5); // no jitter
});
afterEach(() => {
  mock.timers.reset();
  mock.restoreAll();
  delete globalThis.WebSocket;
  delete globalThis.location;
});

function follow(options = {}) {
  const seen = { states: [], events: [], opens: [], errors: [], statuses: [] };
  const socket = new LiveSocket({
    path: "/ws/runs/7/",
    pageContracts: CONTRACTS,
    handlers: {
      state: (name, detail) => seen.states.push(detail === undefined ? name : `${name}:${detail}`),
      open: (info) => seen.opens.push(info.reconnected),
      metrics: (e) => seen.events.push(e.seq),
      log: (e) => seen.events.push(e.seq),
      status: (m) => seen.statuses.push(m.status || m.state),
      error: (m) => seen.errors.push(m.code),
    },
    ...options,
  });
  socket.connect();
  return { socket, seen };
}

test("the back-off doubles from 0.5 s up to 30 s, with at most 25% jitter", () => {
  const half = () => 0.5;
  assert.deepEqual([0, 1, 2, 5, 6, 20].map((n) => reconnectDelay(n, half)), [500, 1000, 2000, 16000, 30000, 30000]);
  assert.equal(reconnectDelay(0, () => 0), 375);
  assert.equal(reconnectDelay(0, () => 1), 625);
});

test("a run socket asks for what follows its cursor and never hands an event over twice", () => {
  const { socket, seen } = follow({ afterSeq: 5, share: "tok en" });
  assert.equal(last().url, "wss://example.test/ws/runs/7/?after_seq=5&share=tok+en");
  last().open();
  last().receive({ type: "events", events: [{ seq: 5, type: "metrics" }, { seq: 6, type: "metrics" }, { seq: 7, type: "log" }], last_seq: 8 });
  last().receive({ type: "events", events: [{ seq: 8, type: "metrics" }, { seq: 9, type: "metrics" }], last_seq: 9 });
  assert.deepEqual(seen.events, [6, 7, 9]);
  assert.equal(socket.cursor, 9);
  assert.equal(socket.received, 3);
  // After a drop it comes back from the cursor.
  last().drop(1006);
  mock.timers.tick(500);
  assert.equal(last().url, "wss://example.test/ws/runs/7/?after_seq=9&share=tok+en");
});

test("a socket without a cursor (the runs table's) sends no after_seq and hands everything over", () => {
  const { seen } = follow({ path: "/ws/projects/3/" });
  assert.equal(last().url, "wss://example.test/ws/projects/3/");
  last().open();
  last().receive({ type: "status", run: 1, status: "running" });
  last().receive({ type: "status", run: 2, status: "failed" }); // another run's end: keep going
  last().receive({ type: "events", events: [{ seq: 1, type: "log" }, { seq: 1, type: "log" }] });
  assert.deepEqual(seen.statuses, ["running", "failed"]);
  assert.deepEqual(seen.events, [1, 1]);
});

test("it reconnects with growing delays, and starts over once a connection was healthy", () => {
  const { seen } = follow({ afterSeq: 0 });
  last().open();
  last().drop(1011); // accepted, then the database failed
  mock.timers.tick(499);
  assert.equal(FakeSocket.made.length, 1);
  mock.timers.tick(1);
  assert.equal(FakeSocket.made.length, 2);
  last().open();
  last().drop(1011);
  mock.timers.tick(999);
  assert.equal(FakeSocket.made.length, 2);
  mock.timers.tick(1);
  assert.equal(FakeSocket.made.length, 3);
  last().open();
  last().receive({ type: "hello", status: "running" }); // the server answered: healthy
  last().drop(1006);
  mock.timers.tick(500);
  assert.equal(FakeSocket.made.length, 4);
  assert.deepEqual(seen.opens, [false, true, true]);
  assert.deepEqual(seen.states.slice(0, 6), ["connecting", "open", "waiting:1", "reconnecting", "open", "waiting:1"]);
});

test("a fatal close code from the contracts ends the retries; others do not", () => {
  for (const code of [4400, 4403, 4404]) {
    FakeSocket.made = [];
    const { socket, seen } = follow({ afterSeq: 0 });
    last().open();
    last().receive({ type: "error", code, message: "refused" });
    last().drop(code);
    mock.timers.tick(60000);
    assert.equal(FakeSocket.made.length, 1, String(code));
    assert.equal(socket.fatal, true);
    assert.deepEqual(seen.errors, [code]);
    assert.equal(seen.states.at(-1), "closed:refused");
  }
  // The same codes as close codes alone (no error message first).
  FakeSocket.made = [];
  follow({ afterSeq: 0 });
  last().drop(4404);
  mock.timers.tick(60000);
  assert.equal(FakeSocket.made.length, 1);
  // A worker-only code is no reason for a page to give up.
  FakeSocket.made = [];
  follow({ afterSeq: 0 });
  last().drop(4401);
  mock.timers.tick(1000);
  assert.equal(FakeSocket.made.length, 2);
});

test("a run socket stops after the run's final status; stop() closes cleanly", () => {
  const { socket, seen } = follow({ afterSeq: 0, stopOnFinal: true });
  const ws = last();
  ws.open();
  ws.receive({ type: "status", status: "running" });
  assert.equal(socket.stopped, false);
  ws.receive({ type: "status", status: "succeeded" });
  assert.equal(socket.stopped, true);
  assert.equal(ws.closedWith, 1000);
  assert.equal(seen.states.at(-1), "closed:finished");
  mock.timers.tick(60000);
  assert.equal(FakeSocket.made.length, 1);
});

test("messages that are not JSON objects are ignored", () => {
  const { seen } = follow({ afterSeq: 0 });
  last().open();
  last().onmessage({ data: "not json" });
  last().onmessage({ data: "42" });
  last().onmessage({ data: "null" });
  assert.deepEqual(seen.events, []);
});
