// New-run page: move focus to the error summary when the server sends one back,
// so keyboard and screen-reader users land on the list of problems.

function focusErrors(root) {
  const summary = root.querySelector("#error-summary");
  if (summary) summary.focus();
}

focusErrors(document);
document.addEventListener("htmx:afterSwap", () => {
  if (document.getElementById("launch-form")) focusErrors(document);
});
