// The new-run form's change marks (webapp/pages/static/tributary/launch_diff.js).
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import test from "node:test";

import { changedLabel, isChanged, sameState } from "../../webapp/pages/static/tributary/launch_diff.js";

const { cases } = JSON.parse(readFileSync(new URL("./launch_diff_cases.json", import.meta.url), "utf8"));

test("input states compare as the server compares them (the cases layout.py is tested on)", () => {
  assert.ok(cases.length > 20);
  for (const { kind, current, baseline, same } of cases) {
    assert.equal(sameState(kind, current, baseline), same, `${kind}: ${JSON.stringify(current)} vs ${JSON.stringify(baseline)}`);
  }
});

test("a field without a baseline (in a row the preset lacks) is left to its list's mark", () => {
  assert.equal(isChanged("text", "task", null), false);
  assert.equal(isChanged("text", "task", undefined), false);
  assert.equal(isChanged("text", "task", "task"), false);
  assert.equal(isChanged("number", "2", "1"), true);
});

test("a section's summary tail counts its changed values", () => {
  assert.equal(changedLabel(0), "");
  assert.equal(changedLabel(1), " · 1 changed");
  assert.equal(changedLabel(12), " · 12 changed");
});
