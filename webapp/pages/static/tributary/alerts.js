// Health alerts on the run page: the list in the side column, a toast for each alert heard live,
// and the marks on the charts (charts.js draws them; this hands them over). The server renders
// the alerts stored when the page loaded; the run socket's "alert" messages add later ones, each
// once (by id), so a reconnect that repeats one changes nothing.

import { timeElement } from "./times.js";

const TOAST_MS = 10000;

// Shows a short-lived notice in the page's toast region (created on first use, aria-live polite).
export function toast(text, { kind = "danger", ms = TOAST_MS, doc = document } = {}) {
  let region = doc.getElementById("toasts");
  if (!region) {
    region = doc.createElement("div");
    region.id = "toasts";
    region.className = "toasts";
    region.setAttribute("role", "status");
    region.setAttribute("aria-live", "polite");
    doc.body.appendChild(region);
  }
  const item = doc.createElement("div");
  item.className = "toast " + kind;
  const words = doc.createElement("span");
  words.textContent = text;
  const close = doc.createElement("button");
  close.type = "button";
  close.className = "secondary";
  close.textContent = "Dismiss";
  close.addEventListener("click", () => item.remove());
  item.append(words, close);
  region.appendChild(item);
  setTimeout(() => item.remove(), ms);
  return item;
}

// `titles`: rule name -> its title; `mark(alerts)`: draws alerts on the charts.
export function setupAlerts({ titles = {}, mark = () => {}, doc = document } = {}) {
  const list = doc.getElementById("alerts");
  const count = doc.getElementById("alerts-count");
  const empty = doc.getElementById("alerts-empty");
  const seen = new Set(list ? [...list.children].map((li) => li.dataset.id) : []);

  const render = (a) => {
    const li = doc.createElement("li");
    li.dataset.id = String(a.id);
    li.dataset.rule = a.rule;
    li.dataset.step = String(a.step);
    const rule = doc.createElement("span");
    rule.className = "alert-rule";
    rule.textContent = titles[a.rule] || a.rule;
    const step = doc.createElement("span");
    step.className = "muted";
    step.textContent = "step " + a.step;
    const message = doc.createElement("span");
    message.className = "alert-message";
    message.textContent = a.message;
    li.append(rule, " ", step, " ", timeElement(a.time || Date.now() / 1000), doc.createElement("br"), message);
    return li;
  };

  // New alerts (from the socket): listed, counted, toasted, marked. Returns those that were new.
  const add = (alerts) => {
    const fresh = (alerts || []).filter((a) => a && !seen.has(String(a.id)));
    for (const a of fresh) {
      seen.add(String(a.id));
      if (list) list.appendChild(render(a));
      toast(`${titles[a.rule] || a.rule} at step ${a.step}: ${a.message}`, { doc });
    }
    if (fresh.length) {
      const n = seen.size;
      if (count) { count.textContent = String(n); count.dataset.count = String(n); count.className = "badge danger"; }
      if (empty) empty.hidden = true;
      mark(fresh);
    }
    return fresh;
  };
  return { add };
}
