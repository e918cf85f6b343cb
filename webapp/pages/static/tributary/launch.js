// New-run page: move focus to the error summary when the server sends one back,
// so keyboard and screen-reader users land on the list of problems.
"use strict";

function focusErrors(root) {
  const summary = (root || document).querySelector("#error-summary");
  if (summary) summary.focus();
}

document.addEventListener("DOMContentLoaded", () => focusErrors(document));
document.addEventListener("htmx:afterSwap", () => {
  if (document.getElementById("launch-form")) focusErrors(document);
});
