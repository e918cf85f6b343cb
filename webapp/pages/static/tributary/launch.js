// New-run page: the essentials first, the other sections folded. This script keeps each field's
// "changed" mark and each section's count as the user types (launch_diff.js decides), resets a
// field to the baseline's value in place, remembers which sections are open across the
// server's re-renders, opens a folded section when the error summary links into it, marks the
// review outdated after an edit, and moves focus to the review or the error summary when the
// server sends one.

import { changedLabel, isChanged } from "./launch_diff.js";

function fieldState(field) {
  const kind = field.dataset.kind;
  if (kind === "checkbox") return field.querySelector("input[type=checkbox]").checked ? "true" : "false";
  if (kind === "tuple") return JSON.stringify([...field.querySelectorAll("input")].map((i) => i.value));
  if (kind === "rows") return String(field.querySelector("fieldset.rows").querySelectorAll(":scope > .row").length);
  return field.querySelector("input, select, textarea").value;
}

function setState(field, state) {
  const kind = field.dataset.kind;
  if (kind === "checkbox") {
    field.querySelector("input[type=checkbox]").checked = state === "true";
  } else if (kind === "tuple") {
    const parts = JSON.parse(state);
    field.querySelectorAll("input").forEach((input, i) => { input.value = parts[i] ?? ""; });
  } else {
    field.querySelector("input, select, textarea").value = state;
  }
}

function markField(field) {
  const kind = field.dataset.kind;
  const baseline = field.hasAttribute("data-baseline") ? field.dataset.baseline : null;
  field.classList.toggle("changed", isChanged(kind, fieldState(field), baseline));
}

function countSection(section) {
  const count = section.querySelectorAll(".field.changed").length;
  const label = section.querySelector(".section-changed");
  if (!label) return;
  label.dataset.count = String(count);
  label.textContent = changedLabel(count);
}

function refreshAll(root) {
  root.querySelectorAll(".field[data-kind]").forEach(markField);
  root.querySelectorAll(".config-section.card").forEach(countSection);
}

function onEdit(event) {
  const target = event.target;
  if (!target.closest || !target.closest("#launch-form") || target.closest("#review")) return;
  outdateReview();
  const field = target.closest(".field[data-kind]");
  if (!field) return;
  // A row's field is marked on its own; the list's own mark counts rows.
  markField(field);
  const rows = field.parentElement.closest(".field[data-kind=rows]");
  if (rows) markField(rows);
  countSection(field.closest(".config-section.card"));
}

function outdateReview() {
  const review = document.getElementById("review");
  if (!review || review.classList.contains("outdated")) return;
  review.classList.add("outdated");
  document.getElementById("review-outdated").hidden = false;
  document.getElementById("launch-submit").disabled = true;
}

function rememberOpen() {
  const input = document.getElementById("open-sections");
  if (!input) return;
  input.value = [...document.querySelectorAll("#config-editor details.config-section[open]")]
    .map((d) => d.id)
    .join(" ");
}

function onClick(event) {
  const reset = event.target.closest("button[data-reset]");
  if (reset) {
    const field = reset.closest(".field[data-kind]");
    if (field.dataset.kind === "rows") return; // htmx asks the server for the baseline's rows
    event.preventDefault();
    setState(field, field.dataset.baseline);
    onEdit({ target: field });
    const control = field.querySelector("input, select, textarea");
    if (control) control.focus();
    return;
  }
  const link = event.target.closest("#error-summary a[href^='#']");
  if (link) {
    const target = document.getElementById(link.getAttribute("href").slice(1));
    if (!target) return;
    event.preventDefault();
    const details = target.closest("details");
    if (details && !details.open) details.open = true;
    target.focus();
    target.scrollIntoView({ block: "center" });
  }
}

function focusServerMessage() {
  const review = document.getElementById("review");
  const summary = document.getElementById("error-summary");
  const target = summary || review;
  if (target) target.focus();
}

document.addEventListener("input", onEdit);
document.addEventListener("change", onEdit);
document.addEventListener("click", onClick);
// "toggle" does not bubble: listen in the capture phase.
document.addEventListener("toggle", (event) => {
  if (event.target.matches && event.target.matches("details.config-section")) rememberOpen();
}, true);
document.addEventListener("htmx:afterSwap", () => {
  if (!document.getElementById("launch-form")) return;
  refreshAll(document);
  focusServerMessage();
  outdateReview();
});

refreshAll(document);
focusServerMessage();
