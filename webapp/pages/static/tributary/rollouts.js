// Rollout browser: while the step slider moves, show the step it points at (the slider moves
// over the indices of the steps that have samples; htmx loads on "change"). A module runs once
// per page, however many fragments include it.
//
// The view lives in the run page's URL: ?rollouts=<the partial's query: step, search, sort,
// page, the opened completion>#rollouts, rewritten after every swap and every completion opened,
// so a link or a reload reopens what the user was looking at (the run page hands the query back
// to the partial it loads: webapp/pages/rollouts/views.rollouts_query).

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
