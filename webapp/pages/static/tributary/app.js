// Small helpers shared by every page. No framework: htmx does forms and partial updates.
"use strict";

// Times are rendered as <time datetime="ISO"> in UTC; show them in the viewer's time zone.
function localiseTimes(root) {
  for (const el of (root || document).querySelectorAll("time[datetime]")) {
    const when = new Date(el.getAttribute("datetime"));
    if (isNaN(when)) continue;
    el.textContent = when.toLocaleString(undefined, { dateStyle: "medium", timeStyle: "short" });
    el.title = when.toISOString();
  }
}

document.addEventListener("DOMContentLoaded", () => localiseTimes(document));
document.addEventListener("htmx:afterSwap", (e) => localiseTimes(e.target));
