// Continual training (data.stages, engine/config/stages.py) on the run page: each stage boundary
// marked on every chart (charts.js draws the marks from its draw hook, as it does the alerts), and
// the stage x eval-time accuracy heatmap: one row per stage, one column per eval point, each cell
// eval/<stage>/accuracy at that step, coloured on a 0-1 scale (the continual-learning accuracy
// matrix; a drop along a row after its stage ended is forgetting).
//
// The stages come from the page data (`stages`: [{name, first, last}], the server's reading of the
// run's config, webapp/pages/runs/stage_plan.py); a run without them whose metrics still name
// stages (an external run) gets rows in the order the stages were first evaluated. The pure parts
// (stageOfMetric, boundaries, Matrix, colour) are exported for node --test.

const ACCURACY = /^eval\/([^/]+)\/accuracy$/;

// The stage a metric name's accuracy is of ("eval/<stage>/accuracy"), else null.
export function stageOfMetric(name) {
  const m = ACCURACY.exec(name);
  return m && m[1] !== "" ? m[1] : null;
}

// The plan from untrusted page data: [{name, first, last}] with sane types, else [].
export function readPlan(stages) {
  if (!Array.isArray(stages)) return [];
  return stages.filter((s) => s && typeof s.name === "string" && Number.isFinite(s.first) && Number.isFinite(s.last))
    .map((s) => ({ name: s.name, first: s.first, last: s.last }));
}

// The marks on the charts: the first step of every stage after the first, with its name.
export function boundaries(plan) {
  return plan.slice(1).map((s) => ({ step: s.first, name: s.name }));
}

// Accuracy 0..1 as a colour: red (0) through amber to green (1); grey for a missing value.
export function colour(value) {
  if (!Number.isFinite(value)) return "#eceff3";
  const v = Math.min(1, Math.max(0, value));
  return `hsl(${Math.round(120 * v)}, 65%, ${Math.round(78 - 18 * v)}%)`;
}

// The stage x step accuracy values, as they arrive (history first, then live points).
export class Matrix {
  constructor(plan = []) {
    this.order = plan.map((s) => s.name);
    this.cells = new Map(); // stage -> Map(step -> value)
    this.first = new Map(); // stage -> the first step it was evaluated (the order without a plan)
  }

  add(stage, step, value) {
    if (typeof stage !== "string" || !Number.isFinite(step) || typeof value !== "number") return false;
    if (!this.cells.has(stage)) this.cells.set(stage, new Map());
    this.cells.get(stage).set(step, value);
    if (!this.first.has(stage) || step < this.first.get(stage)) this.first.set(stage, step);
    return true;
  }

  // Points at `step` and after were superseded by a resume from an earlier checkpoint.
  rewind(step) {
    for (const row of this.cells.values()) for (const s of [...row.keys()]) if (s >= step) row.delete(s);
  }

  rows() {
    const planned = this.order.filter((name) => this.cells.has(name));
    const others = [...this.cells.keys()].filter((name) => !this.order.includes(name))
      .sort((a, b) => this.first.get(a) - this.first.get(b) || (a < b ? -1 : 1));
    return [...planned, ...others];
  }

  steps() {
    const all = new Set();
    for (const row of this.cells.values()) for (const s of row.keys()) all.add(s);
    return [...all].sort((a, b) => a - b);
  }

  value(stage, step) {
    const v = this.cells.get(stage)?.get(step);
    return v === undefined ? null : v;
  }
}

// Draws the stage marks of one uPlot panel (called from ChartGrid's draw hook): a dotted line at the
// boundary, half a step before the stage's first step, and the stage's name at the top.
export function drawStageMarks(u, marks) {
  const ctx = u.ctx;
  const { left, top, width, height } = u.bbox;
  const dpr = window.devicePixelRatio || 1;
  ctx.save();
  ctx.strokeStyle = "#475467";
  ctx.fillStyle = "#475467";
  ctx.lineWidth = 1 * dpr;
  ctx.setLineDash([2 * dpr, 3 * dpr]);
  ctx.font = `${10 * dpr}px system-ui, sans-serif`;
  ctx.textBaseline = "top";
  for (const m of marks) {
    const px = u.valToPos(m.step - 0.5, "x", true);
    if (!(px >= left && px <= left + width)) continue;
    ctx.beginPath(); ctx.moveTo(px, top); ctx.lineTo(px, top + height); ctx.stroke();
    ctx.fillText(m.name, px + 3 * dpr, top + 2 * dpr);
  }
  ctx.restore();
}

// The heatmap panel (a table: readable, selectable, and a screen reader reads its cells).
export class StageHeatmap {
  constructor(host, plan, doc = document) {
    this.doc = doc;
    this.plan = plan;
    this.matrix = new Matrix(plan);
    this.card = doc.createElement("section");
    this.card.className = "card stage-heatmap";
    this.card.id = "stage-heatmap";
    this.card.hidden = true;
    const title = doc.createElement("h2");
    title.textContent = "Accuracy per stage";
    const note = doc.createElement("p");
    note.className = "muted";
    note.textContent = "eval/<stage>/accuracy at each eval point (0 red, 1 green); a drop along a row after its stage is forgetting.";
    this.wrap = doc.createElement("div");
    this.wrap.className = "table-wrap";
    this.card.append(title, note, this.wrap);
    host.parentNode.insertBefore(this.card, host);
    this.pending = false;
  }

  add(step, values) {
    let changed = false;
    for (const name in values || {}) {
      const stage = stageOfMetric(name);
      if (stage !== null) changed = this.matrix.add(stage, step, values[name]) || changed;
    }
    if (changed) this.schedule();
  }

  // The history the chart grid loaded (its SeriesStore): every eval/<stage>/accuracy series.
  loadStore(store) {
    for (const s of store.series.values()) {
      const stage = stageOfMetric(s.name);
      if (stage === null || s.run !== 0) continue;
      s.step.forEach((step, i) => this.matrix.add(stage, step, s.value[i]));
    }
    this.schedule();
  }

  rewind(step) { this.matrix.rewind(step); this.schedule(); }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => { this.pending = false; this.render(); });
  }

  stageAt(step) {
    const s = this.plan.find((p) => step >= p.first && step <= p.last);
    return s ? s.name : "";
  }

  render() {
    const doc = this.doc;
    const rows = this.matrix.rows(), steps = this.matrix.steps();
    this.card.hidden = rows.length === 0;
    const table = doc.createElement("table");
    table.className = "heatmap";
    const head = doc.createElement("tr");
    const corner = doc.createElement("th");
    corner.scope = "col";
    corner.textContent = "stage \\ step";
    head.appendChild(corner);
    for (const step of steps) {
      const th = doc.createElement("th");
      th.scope = "col";
      th.textContent = String(step);
      const training = this.stageAt(step);
      if (training) th.title = `training ${training}`;
      head.appendChild(th);
    }
    const thead = doc.createElement("thead");
    thead.appendChild(head);
    const tbody = doc.createElement("tbody");
    for (const stage of rows) {
      const tr = doc.createElement("tr");
      tr.dataset.stage = stage;
      const th = doc.createElement("th");
      th.scope = "row";
      th.textContent = stage;
      tr.appendChild(th);
      for (const step of steps) {
        const td = doc.createElement("td");
        const v = this.matrix.value(stage, step);
        td.dataset.step = String(step);
        td.style.background = colour(v);
        td.style.textAlign = "center";
        td.style.minWidth = "3em";
        if (v !== null) {
          td.dataset.value = String(v);
          td.textContent = v.toFixed(2);
          td.title = `${stage} at step ${step}: ${v.toFixed(3)}`;
        }
        tr.appendChild(td);
      }
      tbody.appendChild(tr);
    }
    table.append(thead, tbody);
    this.wrap.replaceChildren(table);
  }
}

// The run page's stages: marks on the grid's charts and the heatmap above them.
export function setupStages(data, grid, host) {
  const plan = readPlan(data.stages);
  grid.markStages(boundaries(plan));
  const heatmap = new StageHeatmap(host, plan);
  window.tributaryStages = heatmap; // for the browser tests
  return heatmap;
}
