// The landing page's status line over its project sockets (webapp/pages/static/tributary/home.js).
import assert from "node:assert/strict";
import test from "node:test";

import { changesLists, liveSummary, stepAfterRead } from "../../webapp/pages/static/tributary/home.js";

test("all sockets open: live, nothing to say", () => {
  assert.deepEqual(liveSummary([{ name: "open" }, { name: "open" }]), { state: "open", text: "" });
});

test("one socket still connecting: not yet open, nothing to say", () => {
  assert.deepEqual(liveSummary([{ name: "open" }, { name: "connecting" }]), { state: "connecting", text: "" });
  assert.deepEqual(liveSummary([{ name: "reconnecting" }]), { state: "connecting", text: "" });
});

test("a socket waiting to reconnect pauses the page for the longest wait", () => {
  const summary = liveSummary([{ name: "waiting", detail: 2 }, { name: "open" }, { name: "waiting", detail: 8 }]);
  assert.equal(summary.state, "closed");
  assert.equal(summary.text, "Live updates paused: reconnecting in 8 s…");
});

test("a refused socket outweighs a waiting one and says to reload", () => {
  const summary = liveSummary([{ name: "waiting", detail: 2 }, { name: "closed", detail: "refused" }]);
  assert.equal(summary.state, "closed");
  assert.match(summary.text, /reload the page/);
});

test("a status message reads the lists again only when it changes them", () => {
  assert.equal(changesLists(undefined, { run: 3, status: "queued" }), true); // not listed yet
  assert.equal(changesLists("queued", { run: 3, status: "starting" }), true);
  assert.equal(changesLists("starting", { run: 3, status: "starting" }), false); // words alone: a phase
});

test("after a read of the lists, a step heard since the read was sent wins", () => {
  assert.equal(stepAfterRead(12, { step: 30, at: 5 }, 4), 30); // heard after the read left: newer
  assert.equal(stepAfterRead(31, { step: 30, at: 3 }, 4), 31); // the read is newer than the message
  assert.equal(stepAfterRead(40, { step: 7, at: 9 }, 4), 7); // a resume went back: the latest word wins
  assert.equal(stepAfterRead(12, undefined, 4), 12);
});
