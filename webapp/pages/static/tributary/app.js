// What every page does (base.html loads it). No framework: htmx does forms and partial updates.

import { localiseTimes } from "./times.js";

document.addEventListener("DOMContentLoaded", () => localiseTimes(document));
document.addEventListener("htmx:afterSwap", (e) => localiseTimes(e.target));
