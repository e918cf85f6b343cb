// Times on the pages: the server renders <time datetime="ISO"> in UTC; the pages show them in
// the viewer's time zone, and the scripts write the times they add the same way.

import { formatDateTime, toDate } from "./format.js";

// Every <time datetime> under `root`, in local time (the UTC instant stays in the title).
export function localiseTimes(root = document) {
  for (const el of root.querySelectorAll("time[datetime]")) {
    const when = toDate(el.getAttribute("datetime"));
    if (!when) continue;
    el.textContent = formatDateTime(when);
    el.title = when.toISOString();
  }
}

// A <time> element for `when` (a Date, an ISO string or epoch seconds), already localised.
export function timeElement(when, format = formatDateTime) {
  const date = toDate(when) || new Date();
  const el = document.createElement("time");
  el.setAttribute("datetime", date.toISOString());
  el.textContent = format(date);
  el.title = date.toISOString();
  return el;
}
