// Pure helpers of the rollout browser's analysis views (rollouts.js draws; tests/js tests these).

// The histogram's bars as uPlot data: x (bar centres), count, the bar width as a fraction of the
// x step uPlot's bars path expects, and an x range with half a bar of margin on each side.
export function binsOf(histogram) {
  const x = histogram.x.slice();
  const count = histogram.count.slice();
  const width = histogram.width > 0 ? histogram.width : 1;
  const lo = x[0] - width / 2;
  const hi = x[x.length - 1] + width / 2;
  // uPlot sizes a bar as a fraction of the smallest gap between x values; one bar has no gap.
  let gap = Infinity;
  for (let i = 1; i < x.length; i++) gap = Math.min(gap, x[i] - x[i - 1]);
  const fraction = Number.isFinite(gap) && gap > 0 ? Math.min(0.95, (0.9 * width) / gap) : 0.6;
  return { x, count, fraction, range: () => [lo, hi === lo ? lo + 1 : hi] };
}

// The scatter's points (sorted by length on the server) and ranges padded by 5% so no point sits on
// the frame; a single value gets a unit range around it.
export function pointsOf(scatter) {
  const pad = (lo, hi) => {
    if (!(hi > lo)) return [lo - 0.5, hi + 0.5];
    const m = (hi - lo) * 0.05;
    return [lo - m, hi + m];
  };
  const x = scatter.length.slice();
  const y = scatter.reward.slice();
  const [xlo, xhi] = pad(Math.min(...x), Math.max(...x));
  const [ylo, yhi] = pad(Math.min(...y), Math.max(...y));
  return { x, y, xRange: () => [xlo, xhi], yRange: () => [ylo, yhi] };
}

// The readout of one token: its text made visible (spaces, newlines), then its values (the token's
// title, written by the server: "logprob -0.105 (p 0.900) · entropy 0.300").
export function tokenReadout(text, values) {
  const shown = JSON.stringify(text).slice(1, -1).replace(/ /g, "\u2423");
  return `“${shown}”: ${values}`;
}
