// Rollout browser: while the step slider moves, show the step it points at (the slider moves
// over the indices of the steps that have samples; htmx loads on "change"). A module runs once
// per page, however many fragments include it.
//
// The view lives in the run page's URL: ?rollouts=<the partial's query: step, search, sort,
// page, the opened completion>#rollouts, rewritten after every swap and every completion opened,
// so a link or a reload reopens what the user was looking at (the run page hands the query back
// to the partial it loads: webapp/pages/rollouts/views.rollouts_query).

import uPlot from "../vendor/uplot/uPlot.esm.js";
import { binsOf, pointsOf, tokenReadout } from "./rollout_views.js";

document.addEventListener("input", (e) => {
  const slider = e.target;
  if (!slider || slider.id !== "rollout-step") return;
  const steps = (slider.dataset.steps || "").split(",");
  const step = steps[Number(slider.value)];
  if (step === undefined) return;
  const out = document.getElementById("rollout-step-value");
  if (out) out.textContent = step;
  slider.setAttribute("aria-valuetext", "step " + step);
});

let shown = new URLSearchParams(new URL(location.href).searchParams.get("rollouts") || "");

function remember(params) {
  shown = params;
  const here = new URL(location.href);
  const query = params.toString();
  if (query) here.searchParams.set("rollouts", query);
  else here.searchParams.delete("rollouts");
  here.hash = "rollouts";
  history.replaceState(history.state, "", here);
}

// The completion the view names as open, scrolled to (once per load of the partial).
function reveal() {
  const id = shown.get("open");
  const card = id && document.querySelector(`#rollouts [data-sample-id="${CSS.escape(id)}"]`);
  if (card) card.scrollIntoView({ block: "center" });
}

document.body.addEventListener("htmx:afterSwap", (e) => {
  const target = e.detail && e.detail.target;
  const url = e.detail && e.detail.xhr && e.detail.xhr.responseURL;
  if (!target || target.id !== "rollouts" || !url) return;
  remember(new URL(url).searchParams);
  reveal();
});
reveal(); // the first load of the partial ran before this module did

// A completion opened or closed: the one open is part of the view.
document.addEventListener("toggle", (e) => {
  const details = e.target;
  if (!(details instanceof HTMLDetailsElement) || !details.closest("#rollouts")) return;
  const card = details.closest("[data-sample-id]");
  if (!card) return;
  const params = new URLSearchParams(shown);
  if (details.open) params.set("open", card.dataset.sampleId);
  else if (params.get("open") === card.dataset.sampleId) params.delete("open");
  remember(params);
}, true);

// ---- The step's reward histogram and length-against-reward scatter (issue 18) ----------------------
// The server computes the bars and points (webapp/pages/rollouts/analysis.py) into #step-distribution;
// uPlot draws them after every load of the step view (the slider, Latest, a link all reload the partial).

const plots = [];

function plotWidth(el) {
  return Math.max(240, Math.floor(el.getBoundingClientRect().width) || 320);
}

function drawStepCharts() {
  while (plots.length) plots.pop().destroy();
  const data = document.getElementById("step-distribution");
  if (!data) return;
  const dist = JSON.parse(data.textContent);
  const histEl = document.querySelector("#reward-histogram .plot");
  const scatterEl = document.querySelector("#length-reward-scatter .plot");
  if (!dist.histogram || !histEl || !scatterEl) return;
  const bins = binsOf(dist.histogram);
  const bars = uPlot.paths.bars({ size: [bins.fraction, Infinity], align: 0 });
  plots.push(new uPlot({
    width: plotWidth(histEl), height: 180,
    scales: { x: { time: false, range: bins.range }, y: { range: (u, lo, hi) => [0, Math.max(1, hi)] } },
    axes: [{ label: "reward" }, { label: "completions" }],
    legend: { show: false },
    cursor: { points: { show: false } },
    series: [
      { label: "reward" },
      { label: "completions", paths: bars, points: { show: false }, fill: "rgba(33, 96, 196, 0.55)", stroke: "#2160c4" },
    ],
  }, [bins.x, bins.count], histEl));
  const points = pointsOf(dist.scatter);
  plots.push(new uPlot({
    mode: 1, width: plotWidth(scatterEl), height: 180,
    scales: { x: { time: false, range: points.xRange }, y: { range: points.yRange } },
    axes: [{ label: "length (tokens)" }, { label: "reward" }],
    legend: { show: false },
    series: [
      { label: "length" },
      {
        label: "reward",
        paths: () => null,
        points: { show: true, size: 6, fill: "rgba(33, 96, 196, 0.6)", stroke: "#2160c4" },
      },
    ],
  }, [points.x, points.y], scatterEl));
}
drawStepCharts();
document.body.addEventListener("htmx:afterSettle", (e) => {
  if (e.detail && e.detail.target && e.detail.target.id === "rollouts") drawStepCharts();
});

// ---- The token view ---------------------------------------------------------------------------------
// Colour by log-probability or entropy (a radio per card; the choice is part of the view's URL as
// tokens=entropy). Values show on hover (each token's title) and in the readout line below the
// tokens: pointing at a token, or focusing the token list and moving with the arrow keys.

// One choice for the whole view: every card with tokens follows it, and the filters' form carries it
// to the next load.
document.addEventListener("change", (e) => {
  const radio = e.target;
  if (!(radio instanceof HTMLInputElement) || !radio.name.startsWith("token-mode-")) return;
  const mode = radio.value === "entropy" ? "entropy" : "logprob";
  for (const view of document.querySelectorAll("#rollouts .token-view")) {
    const own = view.querySelector(`input[value="${mode}"]`);
    if (!own || own.disabled) continue;
    own.checked = true;
    view.dataset.mode = mode;
  }
  const carried = document.getElementById("rollout-token-mode");
  if (carried) carried.value = mode;
  const params = new URLSearchParams(shown);
  if (mode === "entropy") params.set("tokens", "entropy");
  else params.delete("tokens");
  remember(params);
});

function show(list, tok) {
  const view = list.closest(".token-view");
  const out = view && view.querySelector(".token-readout");
  if (!tok || !out) return;
  for (const old of list.querySelectorAll(".tok.active")) old.classList.remove("active");
  tok.classList.add("active");
  out.textContent = tokenReadout(tok.textContent, tok.title);
}

document.addEventListener("mouseover", (e) => {
  const tok = e.target instanceof Element && e.target.closest(".tokens .tok");
  if (tok) show(tok.parentElement, tok);
});

document.addEventListener("keydown", (e) => {
  const list = e.target instanceof Element && e.target.classList.contains("tokens") ? e.target : null;
  if (!list) return;
  const toks = list.querySelectorAll(".tok");
  if (!toks.length) return;
  const at = Array.prototype.indexOf.call(toks, list.querySelector(".tok.active"));
  const moves = {
    ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1, Home: 0, End: toks.length - 1,
  };
  if (!(e.key in moves)) return;
  e.preventDefault();
  const next = toks[Math.min(Math.max(moves[e.key], 0), toks.length - 1)];
  show(list, next);
  next.scrollIntoView({ block: "nearest" });
});

document.addEventListener("focusin", (e) => {
  const list = e.target instanceof Element && e.target.classList.contains("tokens") ? e.target : null;
  if (list && !list.querySelector(".tok.active")) show(list, list.querySelector(".tok"));
});

// ---- Side by side: a new run to compare with starts at its own latest step --------------------------
document.body.addEventListener("htmx:configRequest", (e) => {
  const form = e.detail && e.detail.elt;
  if (!form || form.id !== "compare-form") return;
  const trigger = e.detail.triggeringEvent && e.detail.triggeringEvent.target;
  if (trigger && trigger.id === "compare-with") delete e.detail.parameters.b_step;
});
