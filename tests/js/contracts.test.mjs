// Reading the contracts the server gives the pages (webapp/pages/static/tributary/contracts.js).
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import test from "node:test";
import { fileURLToPath } from "node:url";

import { CONTRACTS_ELEMENT_ID, contracts, parseContracts } from "../../webapp/pages/static/tributary/contracts.js";
import { PAGE_CONTRACTS } from "./fixtures.mjs";

test("the page's contracts are parsed into what the scripts ask", () => {
  const c = parseContracts(JSON.stringify(PAGE_CONTRACTS));
  assert.deepEqual([...c.fatalCloseCodes].sort(), [4400, 4403, 4404]);
  assert.equal(c.fatalCloseCodes.has(1011), false); // the database was down: try again
  assert.deepEqual(c.activeStates, PAGE_CONTRACTS.active_states);
  assert.equal(c.isTerminal("lost"), true);
  assert.equal(c.isTerminal("running"), false);
  assert.equal(c.isTerminal("no such state"), false);
  assert.equal(c.closeCodes.not_found, 4404);
  assert.deepEqual(c.eventTypes, PAGE_CONTRACTS.event_types);
  assert.ok(Object.isFrozen(c) && Object.isFrozen(c.runStates));
});

test("contracts of another shape fail loudly", () => {
  const broken = [
    ["[]", /not an object/],
    ["null", /not an object/],
    [JSON.stringify({ ...PAGE_CONTRACTS, close_codes: { x: "4404" } }), /close_codes/],
    [JSON.stringify({ ...PAGE_CONTRACTS, run_states: "queued" }), /run_states/],
    [JSON.stringify({ ...PAGE_CONTRACTS, terminal_states: ["done"] }), /terminal states that are not run states: done/],
    [JSON.stringify({ ...PAGE_CONTRACTS, browser_fatal_close_codes: undefined }), /browser_fatal_close_codes/],
    [JSON.stringify({ ...PAGE_CONTRACTS, event_types: [1] }), /event_types/],
  ];
  for (const [text, message] of broken) assert.throws(() => parseContracts(text), message, text);
  assert.throws(() => parseContracts("{"), SyntaxError);
});

test("contracts() reads the json_script element once, on first use", () => {
  let reads = 0;
  const doc = {
    getElementById(id) {
      reads += 1;
      return id === CONTRACTS_ELEMENT_ID ? { textContent: JSON.stringify(PAGE_CONTRACTS) } : null;
    },
  };
  assert.throws(() => contracts({ getElementById: () => null }), /no #tributary-contracts/);
  const first = contracts(doc);
  assert.equal(contracts(doc), first);
  assert.equal(reads, 1);
});

test("the server's own page_contracts() parse, and the fixture of these tests has its shape", () => {
  // engine/contracts.py is standard library only: any Python 3 reads it.
  const root = fileURLToPath(new URL("../../", import.meta.url));
  const python = existsSync(root + ".venv/bin/python") ? root + ".venv/bin/python" : "python3";
  const out = spawnSync(python, ["-c", "import json, engine.contracts as c; print(json.dumps(c.page_contracts()))"], {
    cwd: root, encoding: "utf8",
  });
  assert.equal(out.status, 0, out.stderr);
  const real = JSON.parse(out.stdout);
  const c = parseContracts(out.stdout);
  assert.deepEqual(Object.keys(real).sort(), Object.keys(PAGE_CONTRACTS).sort());
  for (const key of Object.keys(PAGE_CONTRACTS)) {
    if (key === "close_codes") continue; // the fixture names the browser's codes only
    assert.deepEqual(real[key], PAGE_CONTRACTS[key], key);
  }
  for (const [name, code] of Object.entries(PAGE_CONTRACTS.close_codes)) assert.equal(c.closeCodes[name], code, name);
});
