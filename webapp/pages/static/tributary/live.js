// The run socket client: a cursor (the last `last_seq` received), reconnect with back-off, and
// handlers per event type. The server replays everything after the cursor on reconnect, so the
// page sees no gap and no duplicate. Exposes window.TributaryLive.
"use strict";

(function () {
  const FATAL_CODES = new Set([4404, 4403, 4400]); // no such run / access revoked / not yours to see: do not retry

  class LiveClient {
    // path: "/ws/runs/<id>/"; afterSeq: where the history (HTTP) ended; share: a share token or "";
    // handlers: {hello, metrics, samples, checkpoint, log, status, heartbeat, batch, state, error}
    constructor({ path, afterSeq = 0, share = "", handlers = {}, finalStatuses = [] }) {
      this.path = path;
      this.cursor = afterSeq;
      this.share = share;
      this.handlers = handlers;
      this.finalStatuses = new Set(finalStatuses);
      this.attempt = 0;
      this.socket = null;
      this.timer = null;
      this.stopped = false;
      this.fatal = false;
      this.received = 0; // events handled (for tests and the status line)
      this._online = () => { if (!this.socket && !this.stopped) this.connect(); };
      window.addEventListener("online", this._online);
    }

    url() {
      const scheme = location.protocol === "https:" ? "wss:" : "ws:";
      let url = `${scheme}//${location.host}${this.path}?after_seq=${encodeURIComponent(this.cursor)}`;
      if (this.share) url += `&share=${encodeURIComponent(this.share)}`;
      return url;
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
        socket = new WebSocket(this.url());
      } catch (err) {
        this.schedule();
        return;
      }
      this.socket = socket;
      socket.onmessage = (e) => this.onMessage(e.data);
      socket.onclose = (e) => {
        if (this.socket === socket) this.socket = null;
        if (FATAL_CODES.has(e.code)) {
          this.fatal = true;
          this.state("closed", "not found");
          return;
        }
        if (!this.stopped) this.schedule();
      };
      socket.onerror = () => { /* onclose follows and schedules the retry */ };
    }

    schedule() {
      if (this.stopped || this.fatal || this.timer) return;
      // 0.5 s, 1 s, 2 s ... capped at 30 s, with jitter so many tabs do not reconnect together.
      const base = Math.min(30000, 500 * 2 ** Math.min(this.attempt, 6));
      const delay = base * (0.75 + Math.random() * 0.5);
      this.attempt += 1;
      this.state("waiting", Math.round(delay / 1000));
      this.timer = setTimeout(() => { this.timer = null; this.connect(); }, delay);
    }

    onMessage(raw) {
      let msg;
      try { msg = JSON.parse(raw); } catch (err) { return; }
      const h = this.handlers;
      switch (msg.type) {
        case "hello":
          this.attempt = 0;
          this.state("open");
          if (h.hello) h.hello(msg);
          break;
        case "events": {
          for (const event of msg.events || []) {
            if (typeof event.seq === "number" && event.seq <= this.cursor) continue; // never twice
            const fn = h[event.type];
            if (fn) fn(event);
            this.received += 1;
          }
          if (typeof msg.last_seq === "number" && msg.last_seq > this.cursor) this.cursor = msg.last_seq;
          if (h.batch) h.batch(msg);
          break;
        }
        case "status":
          if (h.status) h.status(msg);
          // The server sent every event before a final status: nothing more will come.
          if (this.finalStatuses.has(msg.status)) this.stop("finished");
          break;
        case "error":
          if (FATAL_CODES.has(msg.code)) this.fatal = true;
          if (h.error) h.error(msg);
          break;
        default:
          break;
      }
    }

    stop(reason = "stopped") {
      this.stopped = true;
      clearTimeout(this.timer);
      window.removeEventListener("online", this._online);
      if (this.socket) {
        const s = this.socket;
        this.socket = null;
        s.onclose = null;
        s.close(1000);
      }
      this.state("closed", reason);
    }
  }

  window.TributaryLive = { LiveClient };
})();
