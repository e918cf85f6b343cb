// The landing page's status line over its project sockets (webapp/pages/static/tributary/home.js).
import assert from "node:assert/strict";
import test from "node:test";

import { liveSummary } from "../../webapp/pages/static/tributary/home.js";

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
