// Data the JS tests share (not a test file: node --test does not run it).

// The shape of engine/contracts.py's page_contracts().
export const PAGE_CONTRACTS = {
  close_codes: { bad_message: 4400, revoked: 4403, not_found: 4404, unavailable: 1011 },
  browser_fatal_close_codes: [4400, 4403, 4404],
  run_states: ["queued", "starting", "running", "succeeded", "failed", "cancelled", "lost"],
  terminal_states: ["succeeded", "failed", "cancelled", "lost"],
  active_states: ["queued", "starting", "running"],
  event_types: ["status", "metrics", "samples", "checkpoint", "log", "heartbeat"],
};
