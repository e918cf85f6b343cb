// The one WebSocket client of the pages: the run page, the share page and compare follow a run
// (/ws/runs/<id>/), the runs table follows a project (/ws/projects/<id>/).
//
// - Reconnects with back-off (0.5 s, 1 s, 2 s ... capped at 30 s, with jitter so many tabs do
//   not come back together), at once when the browser comes back online, and never after a
//   close code the contracts call fatal (the same request would be refused again).
// - A run socket carries a cursor (`afterSeq`, then the last `last_seq` received): the server
//   replays everything after it on reconnect, and an event at or below it is dropped, so the
//   page sees no gap and no duplicate. A run socket stops after the run's final status.
// - Handlers by message type (hello, status, progress, output, alert, error; batch after each events message) and by event
//   type (metrics, log, checkpoint, status, ...); `open({reconnected})` after each connection,
//   `state(name, detail)` for a status line: connecting, reconnecting, open, waiting (detail:
//   seconds until the next try) and closed (detail: "refused", "finished" or "stopped").
// Touches the browser only when constructed (tests/js/socket.test.mjs runs it under Node).

import { contracts } from "./contracts.js";

const FIRST_DELAY_MS = 500;
const MAX_DELAY_MS = 30000;
// A connection that stays open this long (or delivers a message) is healthy: the back-off
// starts from the beginning after it drops. A server that accepts and then closes at once (its
// database is down: 1011) keeps backing off instead.
const HEALTHY_AFTER_MS = 5000;

// Milliseconds before reconnect attempt `attempt` (0, 1, 2 ...).
export function reconnectDelay(attempt, random = Math.random) {
  const base = Math.min(MAX_DELAY_MS, FIRST_DELAY_MS * 2 ** Math.min(attempt, 6));
  return base * (0.75 + random() * 0.5);
}

export class LiveSocket {
  // path: "/ws/runs/<id>/" or "/ws/projects/<id>/"; afterSeq: where a run page's history (HTTP)
  // ended, null for a socket without replay; share: a share token or "";
  // stopOnFinal: stop after a status message with a final state (a socket following one run).
  constructor({ path, afterSeq = null, share = "", handlers = {}, stopOnFinal = false, pageContracts = contracts() }) {
    this.path = path;
    this.cursor = afterSeq;
    this.share = share;
    this.handlers = handlers;
    this.stopOnFinal = stopOnFinal;
    this.contracts = pageContracts;
    this.attempt = 0; // connections lost since the last healthy one
    this.socket = null;
    this.timer = null;
    this.healthyTimer = null;
    this.stopped = false;
    this.fatal = false;
    this.received = 0; // events handled (for tests and the status line)
    this._online = () => { if (!this.socket) this.connect(); };
    globalThis.addEventListener?.("online", this._online);
  }

  url() {
    const loc = globalThis.location;
    const scheme = loc.protocol === "https:" ? "wss:" : "ws:";
    const query = new URLSearchParams();
    if (this.cursor !== null) query.set("after_seq", String(this.cursor));
    if (this.share) query.set("share", this.share);
    const qs = query.toString();
    return `${scheme}//${loc.host}${this.path}${qs ? "?" + qs : ""}`;
  }

  state(name, detail) {
    if (this.handlers.state) this.handlers.state(name, detail);
  }

  connect() {
    if (this.stopped || this.fatal) return;
    clearTimeout(this.timer);
    this.timer = null;
    this.state(this.attempt ? "reconnecting" : "connecting");
    let socket;
    try {
      socket = new globalThis.WebSocket(this.url());
    } catch (err) {
      this.schedule();
      return;
    }
    this.socket = socket;
    socket.onopen = () => {
      if (this.socket !== socket) return;
      const reconnected = this.attempt > 0;
      this.healthyTimer = setTimeout(() => this.healthy(), HEALTHY_AFTER_MS);
      this.state("open");
      if (this.handlers.open) this.handlers.open({ reconnected });
    };
    socket.onmessage = (e) => { if (this.socket === socket) this.onMessage(e.data); };
    socket.onclose = (e) => {
      if (this.socket !== socket) return;
      this.socket = null;
      clearTimeout(this.healthyTimer);
      if (this.fatal || this.contracts.fatalCloseCodes.has(e.code)) {
        this.fatal = true;
        this.detach();
        this.state("closed", "refused");
        return;
      }
      this.schedule();
    };
    socket.onerror = () => { /* onclose follows and schedules the retry */ };
  }

  healthy() {
    clearTimeout(this.healthyTimer);
    this.attempt = 0;
  }

  schedule() {
    if (this.stopped || this.fatal || this.timer) return;
    const delay = reconnectDelay(this.attempt);
    this.attempt += 1;
    this.state("waiting", Math.ceil(delay / 1000));
    this.timer = setTimeout(() => { this.timer = null; this.connect(); }, delay);
  }

  onMessage(raw) {
    let msg;
    try { msg = JSON.parse(raw); } catch (err) { return; }
    if (!msg || typeof msg !== "object") return;
    this.healthy();
    const h = this.handlers;
    switch (msg.type) {
      case "events": {
        for (const event of msg.events || []) {
          if (this.cursor !== null && typeof event.seq === "number" && event.seq <= this.cursor) continue; // never twice
          const fn = h[event.type];
          if (fn) fn(event);
          this.received += 1;
        }
        if (this.cursor !== null && typeof msg.last_seq === "number" && msg.last_seq > this.cursor) this.cursor = msg.last_seq;
        if (h.batch) h.batch(msg);
        break;
      }
      case "status":
        if (h.status) h.status(msg);
        // The server sends every event before a final status: nothing more will come.
        if (this.stopOnFinal && this.contracts.isTerminal(msg.status)) this.stop("finished");
        break;
      case "error":
        // The server says why before it closes with the code: the close must not be retried.
        if (this.contracts.fatalCloseCodes.has(msg.code)) this.fatal = true;
        if (h.error) h.error(msg);
        break;
      case "hello":
        if (h.hello) h.hello(msg);
        break;
      case "output": // lines of the engine's output (the Logs tab, logs.js)
        if (h.output) h.output(msg);
        break;
      case "progress": // a run's step moved (project sockets, at most once a second per run)
        if (h.progress) h.progress(msg);
        break;
      case "alert": // health alerts fired on a run (webapp/alerts: alerts.js, the runs table)
        if (h.alert) h.alert(msg);
        break;
      default:
        break;
    }
  }

  detach() {
    clearTimeout(this.timer);
    clearTimeout(this.healthyTimer);
    this.timer = null;
    globalThis.removeEventListener?.("online", this._online);
  }

  stop(reason = "stopped") {
    this.stopped = true;
    this.detach();
    if (this.socket) {
      const s = this.socket;
      this.socket = null;
      s.onclose = null;
      s.close(1000);
    }
    this.state("closed", reason);
  }
}
