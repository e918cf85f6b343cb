// The pages' formatters (webapp/pages/static/tributary/format.js).
import assert from "node:assert/strict";
import test from "node:test";

import {
  MISSING, formatBytes, formatClock, formatDateTime, formatDuration, formatNumber, formatTick, toDate,
} from "../../webapp/pages/static/tributary/format.js";

test("durations read like the server's format_duration (tests/webapp/test_pages_runs_table.py)", () => {
  const seconds = [-3, 0, 59, 61, 3599, 3600, 90061];
  assert.deepEqual(seconds.map(formatDuration), ["0s", "0s", "59s", "1m 01s", "59m 59s", "1h 00m", "25h 01m"]);
  // Whole seconds, rounded down like the server (a ticking cell never runs ahead of it).
  assert.equal(formatDuration(59.99), "59s");
  assert.equal(formatDuration(3659.5), "1h 00m");
});

test("a missing duration is a dash", () => {
  for (const v of [null, undefined, NaN, Infinity]) assert.equal(formatDuration(v), MISSING);
});

test("numbers keep five significant digits and switch to exponents at the extremes", () => {
  assert.equal(formatNumber(0), "0");
  assert.equal(formatNumber(0.5), "0.5");
  assert.equal(formatNumber(1 / 3), "0.33333");
  assert.equal(formatNumber(-12.345678), "-12.346");
  assert.equal(formatNumber(99999), "99999");
  assert.equal(formatNumber(100000), "1.000e+5");
  assert.equal(formatNumber(0.001), "0.001");
  assert.equal(formatNumber(0.000999), "9.990e-4");
  assert.equal(formatNumber(-3e-6), "-3.000e-6");
  for (const v of [null, undefined, NaN, -Infinity]) assert.equal(formatNumber(v), MISSING);
});

test("axis ticks are numbers, with short exponents, and blank where uPlot skips a label", () => {
  // A log axis over 1e-4..1 as uPlot hands it over: every tick, null where a label is skipped.
  const logTicks = [1e-4, null, null, 5e-4, null, 1e-3, 0.002, null, 0.01, 0.1, 0.5, 1];
  assert.deepEqual(logTicks.map(formatTick), ["1e-4", "", "", "5e-4", "", "0.001", "0.002", "", "0.01", "0.1", "0.5", "1"]);
  assert.ok(!logTicks.map(formatTick).includes(MISSING));
  assert.equal(formatTick(2.5e-6), "2.5e-6");
  assert.equal(formatTick(-3e-5), "-3e-5");
  assert.equal(formatTick(3e7), "3e7");
  assert.equal(formatTick(123456), "1.235e5");
  // Linear ticks: floating-point noise does not show.
  assert.equal(formatTick(0.1 + 0.2), "0.3");
  assert.equal(formatTick(0), "0");
  assert.equal(formatTick(-1.5), "-1.5");
  for (const v of [undefined, NaN, Infinity]) assert.equal(formatTick(v), "");
});

test("sizes read like Django's filesizeformat (the server's rows of the same table)", () => {
  // Expected values printed by django.template.defaultfilters.filesizeformat.
  const cases = [
    [0, "0\u00a0bytes"], [1, "1\u00a0byte"], [512, "512\u00a0bytes"], [1023, "1023\u00a0bytes"],
    [1024, "1.0\u00a0KB"], [1536, "1.5\u00a0KB"], [1048575, "1024.0\u00a0KB"], [1048576, "1.0\u00a0MB"],
    [5 * 2 ** 30 + 2 ** 29, "5.5\u00a0GB"], [3 * 2 ** 40, "3.0\u00a0TB"],
  ];
  for (const [bytes, text] of cases) assert.equal(formatBytes(bytes), text, String(bytes));
  assert.equal(formatBytes(undefined), MISSING);
});

test("times come from Dates, ISO strings and epoch seconds alike", () => {
  const iso = "2026-11-25T16:50:00.000Z";
  for (const when of [new Date(iso), iso, Date.parse(iso) / 1000]) assert.equal(toDate(when).toISOString(), iso);
  assert.equal(toDate(null), null);
  assert.equal(toDate("not a time"), null);
  const options = { dateStyle: "medium", timeStyle: "short" };
  assert.equal(formatDateTime(iso, "en-GB"), new Date(iso).toLocaleString("en-GB", options));
  assert.equal(formatClock(iso, "en-GB"), new Date(iso).toLocaleTimeString("en-GB"));
  assert.equal(formatDateTime("garbage"), MISSING);
});
