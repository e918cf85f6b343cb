// The run page's Logs tab: the engine's log events and the lines of its output (stderr of every
// rank, native libraries, the vLLM engine), live; a level filter, a text search, and follow:
// the list keeps to its newest line until the reader scrolls up, and picks up again at the bottom.
//
// Two cursors keep it free of doubles: the events' seq (the socket's replay may repeat one) and
// the output's byte offset (live lines and the lines read again after a reconnect may overlap).

import { formatClock } from "./format.js";
import { timeElement } from "./times.js";

export const LEVELS = ["debug", "info", "warning", "error"];
export const MAX_LINES = 5000; // lines the page keeps; the full log has the rest
const NEAR_BOTTOM_PX = 24;

// The level a line is shown with: one of LEVELS (anything else reads as info).
export function levelOf(level) {
  return LEVELS.includes(level) ? level : "info";
}

// Whether `text` holds every word of `query`, ignoring case ("" matches everything).
export function matches(text, query) {
  const words = String(query || "").toLowerCase().split(/\s+/).filter(Boolean);
  const hay = String(text || "").toLowerCase();
  return words.every((w) => hay.includes(w));
}

// Whether a scrolled box shows its end (within a few pixels): follow stays on there.
export function nearBottom({ scrollTop, clientHeight, scrollHeight }, slack = NEAR_BOTTOM_PX) {
  return scrollTop + clientHeight >= scrollHeight - slack;
}

// The tab, from the server-rendered list; returns what the socket calls (`event` for a log
// event, `output` for an output message) and `catchUp` (read the output lines after the cursor).
export function setupLogs(doc = document) {
  const $ = (id) => doc.getElementById(id);
  const list = $("logs");
  const card = $("logs-card");
  if (!list || !card) return { event() {}, output() {}, catchUp: async () => {} };
  const level = $("log-level"), search = $("log-search"), follow = $("log-follow"), newest = $("log-newest");
  let maxSeq = 0;
  let maxOffset = Number(card.dataset.lastOffset ?? -1);
  for (const li of list.children) if (li.dataset.seq) maxSeq = Math.max(maxSeq, Number(li.dataset.seq));
  let lastTop = list.scrollTop; // a scroll up from here is the reader's (the page only scrolls down)

  const applySearch = (li) => li.classList.toggle("search-miss", !matches(li.querySelector(".msg")?.textContent, search.value));
  const shown = (li) =>
    LEVELS.indexOf(li.dataset.level) >= LEVELS.indexOf(list.dataset.level) && !li.classList.contains("search-miss");
  const showEmpty = () => {
    const any = list.children.length > 0;
    $("logs-empty").hidden = any;
    $("logs-nomatch").hidden = !any || [...list.children].some(shown);
  };
  const toEnd = () => {
    if (!follow.checked || list.closest("[hidden]")) return;
    list.scrollTop = list.scrollHeight;
    lastTop = list.scrollTop;
  };
  const setFollow = (on) => {
    follow.checked = on;
    newest.hidden = on;
    if (on) toEnd();
  };

  level.addEventListener("change", () => { list.dataset.level = level.value; showEmpty(); toEnd(); });
  search.addEventListener("input", () => { for (const li of list.children) applySearch(li); showEmpty(); toEnd(); });
  follow.addEventListener("change", () => setFollow(follow.checked));
  newest.addEventListener("click", () => setFollow(true));
  list.addEventListener("scroll", () => {
    const top = list.scrollTop, atEnd = nearBottom(list);
    if (follow.checked && top < lastTop - 2 && !atEnd) setFollow(false);
    else if (!follow.checked && atEnd) setFollow(true);
    lastTop = top;
  });
  // The tab becomes visible: its list can only now scroll to the end.
  window.addEventListener("resize", () => toEnd());

  const append = (attrs, lvl, message, when, output) => {
    const li = doc.createElement("li");
    Object.assign(li.dataset, attrs);
    li.dataset.level = lvl;
    li.className = "log-" + lvl + (output ? " log-output" : "");
    const l = doc.createElement("span"); l.className = "lvl"; l.textContent = lvl;
    const m = doc.createElement("span"); m.className = "msg"; m.textContent = message;
    li.append(timeElement(when, formatClock), " ", l, " ", m);
    applySearch(li);
    list.appendChild(li);
    let dropped = 0;
    while (list.children.length > MAX_LINES) { list.firstElementChild.remove(); dropped += 1; }
    if (dropped) $("logs-older").hidden = false;
  };
  const done = () => { showEmpty(); toEnd(); };

  const api = {
    event(e) {
      if (typeof e.seq !== "number" || e.seq <= maxSeq) return;
      maxSeq = e.seq;
      append({ kind: "event", seq: String(e.seq) }, levelOf(e.level), e.message ?? "", new Date(), false);
      done();
    },
    output(msg) {
      let added = false;
      for (const line of msg.lines || []) {
        if (typeof line.offset !== "number" || line.offset <= maxOffset) continue;
        maxOffset = line.offset;
        append({ kind: "output", offset: String(line.offset) }, levelOf(line.level), line.message ?? "", line.time, true);
        added = true;
      }
      if (msg.dropped > 0 || msg.skipped > 0) $("logs-older").hidden = false;
      if (added) done();
    },
    async catchUp() {
      try {
        const res = await fetch(`${card.dataset.outputUrl}?after=${maxOffset}`, { credentials: "same-origin" });
        if (res.ok) api.output(await res.json());
      } catch (err) {
        // Offline: the next connection's hello tries again.
      }
    },
  };
  // The server's lines in the live ones' clock time. app.js localises every <time> to a full date
  // and time on DOMContentLoaded, after this module ran: once more after all of its listeners.
  const clockTimes = () => {
    for (const el of list.querySelectorAll("time[datetime]")) el.textContent = formatClock(el.getAttribute("datetime"));
  };
  clockTimes();
  if (doc.readyState !== "complete") doc.addEventListener("DOMContentLoaded", () => setTimeout(clockTimes, 0));
  window.tributaryLogs = api; // for the browser tests
  showEmpty();
  return api;
}
