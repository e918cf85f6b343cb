// Rollout browser: while the step slider moves, show the step it points at (the slider moves
// over the indices of the steps that have samples; htmx loads on "change"). A module runs once
// per page, however many fragments include it.

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
