// The Logs tab's pure parts (webapp/pages/static/tributary/logs.js): search, follow, levels.
import assert from "node:assert/strict";
import test from "node:test";

import { LEVELS, levelOf, matches, nearBottom } from "../../webapp/pages/static/tributary/logs.js";

test("a search matches lines holding every word, in any case and order", () => {
  assert.equal(matches("rank 1: NCCL ready", ""), true);
  assert.equal(matches("rank 1: NCCL ready", "nccl"), true);
  assert.equal(matches("rank 1: NCCL ready", "  ready   RANK "), true);
  assert.equal(matches("rank 1: NCCL ready", "nccl failed"), false);
  assert.equal(matches(undefined, "x"), false);
  assert.equal(matches("a.b*c", "b*c"), true); // words are text, not patterns
});

test("follow holds at the end of the list, within a few pixels", () => {
  assert.equal(nearBottom({ scrollTop: 900, clientHeight: 100, scrollHeight: 1000 }), true);
  assert.equal(nearBottom({ scrollTop: 880, clientHeight: 100, scrollHeight: 1000 }), true);
  assert.equal(nearBottom({ scrollTop: 800, clientHeight: 100, scrollHeight: 1000 }), false);
  assert.equal(nearBottom({ scrollTop: 0, clientHeight: 100, scrollHeight: 50 }), true); // nothing to scroll
});

test("a level the page does not know reads as info", () => {
  assert.deepEqual(LEVELS, ["debug", "info", "warning", "error"]);
  assert.equal(levelOf("error"), "error");
  assert.equal(levelOf("critical"), "info");
  assert.equal(levelOf(undefined), "info");
});
