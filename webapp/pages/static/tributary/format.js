// How the pages write durations, numbers, sizes and times: one formatter for each, used by every
// page (the runs table, the run header, the chart axes and legends, the checkpoint list).
// Pure: no DOM, so Node's test runner imports it (tests/js/format.test.mjs).

export const MISSING = "—"; // what a cell shows when there is no value

// A duration in whole seconds, written like the server writes it (format_duration in
// webapp/pages/teams/views.py), so a runs-table cell the script ticks reads the same as the one
// the server rendered: "5s", "2m 03s", "1h 05m". Negative durations (clock skew) show as "0s".
export function formatDuration(seconds) {
  if (seconds == null || !Number.isFinite(seconds)) return MISSING;
  const total = Math.max(0, Math.floor(seconds));
  const h = Math.floor(total / 3600), m = Math.floor((total % 3600) / 60), s = total % 60;
  const pad = (n) => String(n).padStart(2, "0");
  if (h) return `${h}h ${pad(m)}m`;
  if (m) return `${m}m ${pad(s)}s`;
  return `${s}s`;
}

// A metric value: five significant digits, exponent notation for the very small and the very
// large (a learning rate of 1e-6, a token count of 3e7), trailing zeros dropped.
export function formatNumber(value) {
  if (value == null || !Number.isFinite(value)) return MISSING;
  const a = Math.abs(value);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return value.toExponential(3);
  return String(+value.toPrecision(5));
}

// An axis tick label: formatNumber's digits, a short exponent ("1e-4", "2.5e7": ticks are round
// numbers, so the mantissa's trailing zeros only cost width), and an empty label where uPlot
// passes null (a log axis with little room labels only some ticks of each decade, 1, 2 and 5
// or only 1, and hands the others over as null).
export function formatTick(value) {
  if (value == null || !Number.isFinite(value)) return "";
  const a = Math.abs(value);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) {
    const [mantissa, exponent] = value.toExponential(3).split("e");
    return `${+mantissa}e${+exponent}`;
  }
  return formatNumber(value);
}

const SIZE_UNITS = ["KB", "MB", "GB", "TB", "PB"];

// A size in bytes, written like Django's filesizeformat (which renders the server's rows of the
// same table): "512 bytes", "1.5 MB", with a no-break space so the unit never wraps alone.
export function formatBytes(bytes) {
  if (bytes == null || !Number.isFinite(bytes)) return MISSING;
  const n = Math.max(0, bytes);
  if (n < 1024) return `${Math.floor(n)}\u00a0${Math.floor(n) === 1 ? "byte" : "bytes"}`;
  let value = n / 1024, unit = 0;
  while (value >= 1024 && unit < SIZE_UNITS.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(1)}\u00a0${SIZE_UNITS[unit]}`;
}

// A moment in the viewer's time zone and language: the date and the minute ("Nov 25, 2026, 4:50 PM").
export function formatDateTime(when, locale = undefined) {
  const date = toDate(when);
  return date ? date.toLocaleString(locale, { dateStyle: "medium", timeStyle: "short" }) : MISSING;
}

// The time of day to the second, for lines of a log that all fall on the same day.
export function formatClock(when, locale = undefined) {
  const date = toDate(when);
  return date ? date.toLocaleTimeString(locale) : MISSING;
}

// A Date from a Date, an ISO string, or seconds since the epoch (what events and the API
// carry); null when it is none of these.
export function toDate(when) {
  if (when == null) return null;
  const date = when instanceof Date ? when : new Date(typeof when === "number" ? when * 1000 : when);
  return Number.isNaN(date.getTime()) ? null : date;
}
