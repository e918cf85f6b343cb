// New-run form: whether a field's inputs still hold the baseline's value (the preset, or the
// cloned run). Pure functions, mirrored from webapp/pages/launch/layout.py (same_state), so the
// marks and counts the server renders and the ones this page keeps as the user types agree.
// States are strings: an input's text, "true"/"false" for a checkbox, a JSON list of the parts
// of a tuple, the number of rows of a list.

const TEXT_KINDS = new Set(["textarea", "lines", "mapping"]);

function asNumber(text) {
  const trimmed = String(text).trim();
  if (trimmed === "") return null;
  const value = Number(trimmed);
  return Number.isFinite(value) ? value : null;
}

function sameNumber(a, b) {
  const x = asNumber(a);
  const y = asNumber(b);
  if (x === null || y === null) return String(a).trim() === String(b).trim();
  return x === y;
}

function normaliseText(text) {
  return String(text).replace(/\r\n/g, "\n").trim();
}

export function sameState(kind, current, baseline) {
  if (kind === "number") return sameNumber(current, baseline);
  if (kind === "tuple") {
    const a = JSON.parse(current);
    const b = JSON.parse(baseline);
    return a.length === b.length && a.every((x, i) => sameNumber(x, b[i]));
  }
  if (TEXT_KINDS.has(kind)) return normaliseText(current) === normaliseText(baseline);
  return current === baseline;
}

// A field with no baseline (in a row the preset lacks) is not marked: its list is, by its row count.
export function isChanged(kind, current, baseline) {
  if (baseline === null || baseline === undefined) return false;
  return !sameState(kind, current, baseline);
}

// The tail of a section's summary: "Rollout · 2 changed" (nothing when nothing changed).
export function changedLabel(count) {
  return count > 0 ? ` · ${count} changed` : "";
}
