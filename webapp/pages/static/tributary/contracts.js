// The contracts the server shares with the pages (engine/contracts.py, page_contracts): run
// states, which of them are final, event types, and the WebSocket close codes after which a page
// stops reconnecting. Every page gets them from base.html as
// <script id="tributary-contracts" type="application/json">; no page writes these values itself.
// parseContracts is pure (tests/js/contracts.test.mjs); contracts() reads the page on first use,
// never at import time.

export const CONTRACTS_ELEMENT_ID = "tributary-contracts";

function stringList(data, key) {
  const value = data[key];
  if (!Array.isArray(value) || !value.every((v) => typeof v === "string")) {
    throw new Error(`contracts: "${key}" must be a list of strings`);
  }
  return Object.freeze(value.slice());
}

function codeList(data, key) {
  const value = data[key];
  if (!Array.isArray(value) || !value.every(Number.isInteger)) {
    throw new Error(`contracts: "${key}" must be a list of integers`);
  }
  return value;
}

// The contracts from their JSON text, checked: a page built against other contracts fails
// loudly here instead of, say, reconnecting forever to a socket that refuses it.
export function parseContracts(text) {
  const data = JSON.parse(text);
  if (!data || typeof data !== "object" || Array.isArray(data)) throw new Error("contracts: not an object");
  const closeCodes = data.close_codes;
  if (!closeCodes || typeof closeCodes !== "object" || !Object.values(closeCodes).every(Number.isInteger)) {
    throw new Error('contracts: "close_codes" must map names to integers');
  }
  const runStates = stringList(data, "run_states");
  const terminalStates = stringList(data, "terminal_states");
  const unknown = terminalStates.filter((s) => !runStates.includes(s));
  if (unknown.length) throw new Error(`contracts: terminal states that are not run states: ${unknown.join(", ")}`);
  const terminal = new Set(terminalStates);
  return Object.freeze({
    closeCodes: Object.freeze({ ...closeCodes }),
    // A browser socket closed with one of these would be refused again: do not retry.
    fatalCloseCodes: new Set(codeList(data, "browser_fatal_close_codes")),
    runStates,
    terminalStates,
    activeStates: Object.freeze(runStates.filter((s) => !terminal.has(s))),
    eventTypes: stringList(data, "event_types"),
    isTerminal: (state) => terminal.has(state),
  });
}

let cached = null;

// The page's contracts (read once).
export function contracts(doc = globalThis.document) {
  if (!cached) {
    const node = doc && doc.getElementById(CONTRACTS_ELEMENT_ID);
    if (!node) throw new Error(`contracts: the page has no #${CONTRACTS_ELEMENT_ID}`);
    cached = parseContracts(node.textContent);
  }
  return cached;
}
